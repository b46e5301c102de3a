"""The benchmark's toolbox: interleaved step timing, peak step memory, FLOPs and MFU, the train and
inference steps every comparison times, and the machine it ran on.

Contenders take turns (A B, B A, A B, ...) so the load of a shared, noisy machine falls on all of
them alike; warm-up steps are dropped; a figure is the median over repeats of each repeat's median.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from vitpipe.benchmark.config import BenchConfig

# --------------------------------------------------------------------------- timing


def sync(device: str) -> None:
    """Wait for queued kernels, so a host clock reading covers the work (CUDA is asynchronous)."""
    if device == "cuda":
        torch.cuda.synchronize()


def _order(names: list[str], turn: int) -> list[str]:
    return names if turn % 2 == 0 else names[::-1]  # alternate who goes first: drift cancels


def interleave_steps(fns: dict[str, Callable[[], object]], *, steps: int, warmup: int, repeats: int,
                     device: str) -> dict[str, list[list[float]]]:
    """Per-step seconds ``{name: [repeat][step]}``; the contenders alternate step by step, after
    ``warmup`` untimed steps each (compilation, allocator growth)."""
    names = list(fns)
    for turn in range(warmup):
        for name in _order(names, turn):
            fns[name]()
    sync(device)
    times = {name: [[] for _ in range(repeats)] for name in names}
    for r, i in itertools.product(range(repeats), range(steps)):
        for name in _order(names, r * steps + i):
            t0 = time.perf_counter()
            fns[name]()
            sync(device)
            times[name][r].append(time.perf_counter() - t0)
    return times


def interleave_runs(runs: dict[str, Callable[[], list[float]]], *, repeats: int) -> dict[str, list[list[float]]]:
    """``{name: [repeat][step]}`` for contenders that time themselves (a whole ``Trainer.fit``, a
    loader run): each call is one repeat returning its steady-state step times; runs alternate."""
    times = {name: [] for name in runs}
    for r in range(repeats):
        for name in _order(list(runs), r):
            times[name].append(list(runs[name]()))
    return times


class StepClock:
    """Timestamps at the end of each step; step k's time is the gap since step k-1 ended, so data
    loading and framework work between steps count. Steps 1..warmup are dropped."""

    def __init__(self, *, warmup: int, device: str) -> None:
        self.warmup, self.device, self.stamps = warmup, device, []

    def tick(self) -> None:
        sync(self.device)
        self.stamps.append(time.perf_counter())

    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])][self.warmup - 1 :]  # gap j is step j+2


def summarize(times: list[list[float]], batch_size: int) -> dict:
    """Median step time of each repeat, then the median over repeats; images per second from it."""
    per_repeat = [statistics.median(r) for r in times]
    step = statistics.median(per_repeat)
    return {"step_s": step, "img_s": batch_size / step, "per_repeat_step_s": per_repeat,
            "min_step_s": min(min(r) for r in times), "timed_steps": sum(len(r) for r in times)}


def paired_ratio(a: list[list[float]], b: list[list[float]]) -> float:
    """Median of step-by-step ratios a/b: with interleaved steps each pair saw nearly the same load."""
    return statistics.median(x / y for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def paired_repeat_ratio(a: list[float], b: list[float]) -> float:
    """Median over repeats of ``a[r] / b[r]`` (per-repeat step times, ``summarize``'s
    ``per_repeat_step_s``): ``interleave_runs`` runs a repeat's contenders back to back, so each pair
    saw nearly the same load, which on a shared machine drifts more between repeats than within one."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- memory

MEMORY_METHOD = {
    "cuda": "peak_step_bytes = torch.cuda.max_memory_allocated() during one step minus memory_allocated() at its start",
    "cpu": "peak_step_bytes = peak of torch CPU tensor bytes allocated during one step (torch.profiler "
           "profile_memory allocation records; not process RSS)",
}


class StepMemory:
    """``with StepMemory(device) as m: step()`` -> ``m.peak_step_bytes`` (and ``m.cuda_max_allocated``).

    CPU has no allocator high-water mark, so the profiler's allocation records are replayed: the
    peak of bytes allocated during the step and not yet freed. Neither device counts the allocator's
    cache; the CPU figure misses frees of tensors older than the step, so it errs high by those.
    """

    def __init__(self, device: str) -> None:
        self.device, self.peak_step_bytes, self.cuda_max_allocated = device, None, None

    def __enter__(self) -> StepMemory:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.cuda_max_allocated = torch.cuda.max_memory_allocated()
            self.peak_step_bytes = self.cuda_max_allocated - self._base
            return
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak_step_bytes = _profiled_cpu_peak(self._prof)

    def as_dict(self) -> dict:
        return {"peak_step_bytes": self.peak_step_bytes, "cuda_max_allocated": self.cuda_max_allocated}


def _profiled_cpu_peak(prof) -> int:
    """Peak of the running sum of the CPU allocation records (bytes +, frees -) in the public trace.
    Not the profiler's 'Total Allocated': that counter carries over between profiling sessions."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    records = sorted((e["ts"], e["args"]["Bytes"]) for e in events
                     if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0)
    return max(itertools.accumulate(nbytes for _, nbytes in records), default=0)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes a contender holds between steps: parameters, buffers and optimizer state."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------- FLOPs and MFU

# Dense peak TFLOP/s per GPU from NVIDIA's data sheets, by the math the precision runs: bf16/fp16
# tensor cores; tf32 when fp32 matmuls may use TF32; plain fp32 otherwise. First match wins
# ("H100 PCIe" before "H100", "L40S" before "L4").
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The data-sheet peak for this GPU and Lightning precision, or None when the GPU is not in the table."""
    fp32 = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    kind = {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(precision, fp32)
    return next((peaks.get(kind) for key, peaks in PEAK_TFLOPS.items() if key.lower() in device_name.lower()), None)


def flops_per_image(model: nn.Module, img_size: int, in_chans: int = 3) -> dict[str, int]:
    """{"forward": ..., "train": forward + backward} FLOPs of one image (a multiply-add = 2 FLOPs).

    Counted by ``torch.utils.flop_counter`` on a meta-device copy (no real compute), with SDPA's
    math backend so attention counts as matmuls on every device (MFU: Chowdhery et al. 2022, app. B).
    """
    meta = copy.deepcopy(model).to("meta")
    x = torch.empty(1, in_chans, img_size, img_size, device="meta")
    flops = {}
    for phase in ("forward", "train"):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            out = meta(x)
            if phase == "train":
                out.sum().backward()
        flops[phase] = counter.get_total_flops()
    return flops


def utilisation(flops_per_img: int, img_s: float, peak: float | None) -> dict:
    """Achieved TFLOP/s, and MFU when the peak is known."""
    achieved = flops_per_img * img_s / 1e12
    return {"tflops": achieved, "mfu": None if peak is None else achieved / peak}


# --------------------------------------------------------------------------- the steps


def random_batch(cfg: BenchConfig, *, seed: int = 1):
    """A normalised float batch and labels on the device: isolates the model from the data path."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.batch_size, 3, cfg.size, cfg.size, generator=g)
    return x.to(cfg.device), torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=g).to(cfg.device)


def train_step(model, opt, x, y, cfg: BenchConfig):
    """forward, cross-entropy, backward, optimizer step; gradients freed after the step."""
    scaler = torch.amp.GradScaler(cfg.device, enabled=cfg.precision == "16-mixed")  # fp16 only

    def step() -> None:
        with cfg.autocast():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def infer_step(model, x, cfg: BenchConfig):
    def step() -> None:
        with torch.no_grad(), cfg.autocast():
            model(x)

    return step


@torch.no_grad()
def max_logit_diff(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> float:
    """Largest |logit difference| in eval mode (both are left in it): 0 up to rounding = the same network."""
    return (a.eval()(x).float() - b.eval()(x).float()).abs().max().item()


def compiled(net, cfg: BenchConfig):
    return torch.compile(net) if cfg.compile else net


# --------------------------------------------------------------------------- the machine


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def environment(cfg: BenchConfig) -> dict:
    return {"torch": torch.__version__, "timm": timm.__version__, "lightning": L.__version__,
            "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name() if cfg.device == "cuda" else cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
