"""Speed switches, each against the eager baseline on vitpipe's ViT (train step, interleaved).

AdamW implementations (torch's default is the per-tensor loop on CPU and ``foreach`` on CUDA;
``fused`` exists on CPU and CUDA in torch >= 2.4), ``torch.compile``, channels-last (touches only
the conv patch stem of a ViT), and each SDPA backend this device offers.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vitpipe.bench.models import build_vit, random_batch, train_step
from vitpipe.bench.settings import BenchConfig
from vitpipe.bench.timing import interleave_steps, paired_ratio, summarize

SDPA_BACKENDS = {
    "cpu": {"sdpa_math": SDPBackend.MATH, "sdpa_flash": SDPBackend.FLASH_ATTENTION},
    "cuda": {"sdpa_math": SDPBackend.MATH, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
             "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION},
}


def _variants(cfg: BenchConfig) -> dict[str, dict]:
    """name -> {optimizer kwargs, compile, channels_last, sdpa backend}; "baseline" is torch's default."""
    base = dict(adamw={}, compile=False, channels_last=False, sdpa=None)
    out = {
        "baseline": base,
        "adamw_foreach": {**base, "adamw": {"foreach": True}},
        "adamw_fused": {**base, "adamw": {"fused": True}},
        "compile": {**base, "compile": True},
        "channels_last": {**base, "channels_last": True},
    }
    out.update({name: {**base, "sdpa": backend} for name, backend in SDPA_BACKENDS[cfg.device].items()})
    return {n: v for n, v in out.items() if n == "baseline" or not cfg.switches or n in cfg.switches}


def _step(cfg: BenchConfig, spec: dict, state: dict, x, y):
    net = build_vit(cfg)
    net.load_state_dict(state)
    # torch's own default here, not build_optimizer's (which turns fused on for CUDA)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.05, **spec["adamw"])
    if spec["channels_last"]:
        net = net.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    model = torch.compile(net) if spec["compile"] else net
    step = train_step(model, optimizer, x, y, cfg)
    if spec["sdpa"] is None:
        return step

    def with_backend() -> None:
        with sdpa_kernel(spec["sdpa"]):
            step()

    return with_backend


def compare_switches(cfg: BenchConfig) -> dict:
    x, y = random_batch(cfg)
    state = {k: v.detach().clone() for k, v in build_vit(cfg).state_dict().items()}
    steps = {}
    failed = {n: f"not offered on {cfg.device}" for n in cfg.switches if n not in _variants(cfg)}
    for name, spec in _variants(cfg).items():
        try:
            step = _step(cfg, spec, state, x, y)
            step()  # an unsupported backend or kernel fails here, not mid-timing
            steps[name] = step
        except (RuntimeError, NotImplementedError) as e:
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    times = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
    contenders = {name: {"train": summarize(t, cfg.batch_size)} for name, t in times.items()}
    base = contenders["baseline"]["train"]["step_s"]
    return {
        "contenders": contenders,
        "ratios": {f"step_time {n}/baseline": c["train"]["step_s"] / base for n, c in contenders.items()
                   if n != "baseline"}
        | {f"step_time {n}/baseline (paired)": paired_ratio(times[n], times["baseline"]) for n in contenders
           if n != "baseline"},
        "unavailable": failed,
    }
