"""Peak memory of one step, measured the same way for every contender on a device.

CUDA: ``torch.cuda.max_memory_allocated`` after a reset, minus what was allocated when the step
began. CPU has no allocator high-water mark, so the torch profiler's allocation records
(``profile_memory=True``) are replayed instead: the peak of tensor bytes allocated during the step
and not yet freed. Neither counts the allocator's cache; the CPU figure also misses frees of tensors
that existed before the step (it cannot size them), so it errs high by at most those.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from torch import nn

METHOD = {
    "cuda": "peak_step_bytes = torch.cuda.max_memory_allocated() during one step minus memory_allocated() at its start",
    "cpu": "peak_step_bytes = peak of torch CPU tensor bytes allocated during one step (torch.profiler "
           "profile_memory allocation records; not process RSS)",
}


class StepMemory:
    """``with StepMemory(device) as m: step()`` -> ``m.peak_step_bytes`` (and ``m.cuda_max_allocated``)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.peak_step_bytes: int | None = None
        self.cuda_max_allocated: int | None = None

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
    """Peak of the running sum of the CPU allocation records (bytes +, frees -) in the profiler's
    public trace. Not its 'Total Allocated' field: that counter carries over between profiling
    sessions (blocks allocated under one and freed outside it are never subtracted)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    records = sorted((e["ts"], e["args"]["Bytes"]) for e in events
                     if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0)
    held = peak = 0
    for _, nbytes in records:
        held += nbytes
        peak = max(peak, held)
    return peak


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes a contender holds between steps: parameters, buffers and optimizer state."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)
