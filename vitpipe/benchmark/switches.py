"""``--only switches``: each speed switch (AdamW kernels, compile, channels-last, SDPA backends) against
the eager baseline on the recipe's ViT."""

from __future__ import annotations

import functools

import torch
from hydra.utils import instantiate
from torch.nn.attention import sdpa_kernel

from vitpipe.benchmark.common import interleave_steps, paired_ratio, random_batch, summarize, train_step
from vitpipe.benchmark.config import SWITCHES, BenchConfig
from vitpipe.benchmark.recipe import recipe


def compare_switches(cfg: BenchConfig) -> dict:
    """Each speed switch against the eager baseline (torch's defaults) on the recipe's ViT, train step."""
    train_cfg = recipe(cfg)
    torch.manual_seed(cfg.seed)
    state = instantiate(train_cfg.model).to(cfg.device).state_dict()
    x, y = random_batch(cfg)
    steps, failed = {}, {}
    for name in ["baseline", *(cfg.switches or SWITCHES)]:
        spec = SWITCHES.get(name, {})
        net = instantiate(train_cfg.model).to(cfg.device)
        net.load_state_dict(state)
        # the recipe's AdamW with torch's own default kernel (build_optimizer would turn fused on on CUDA)
        opt = instantiate(train_cfg.module.optimizer, **spec.get("adamw", {}))(net.parameters())
        xs = x.contiguous(memory_format=torch.channels_last) if spec.get("channels_last") else x
        if spec.get("channels_last"):
            net = net.to(memory_format=torch.channels_last)
        step = train_step(torch.compile(net) if spec.get("compile") else net, opt, xs, y, cfg)
        if "sdpa" in spec:
            step = functools.partial(_with_backend, step, spec["sdpa"])
        try:
            step()  # a backend or kernel this device lacks (sdpa_cudnn on a CPU) fails here, not mid-timing
            steps[name] = step
        except (RuntimeError, NotImplementedError) as e:
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    times = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
    contenders = {name: {"train": summarize(t, cfg.batch_size)} for name, t in times.items()}
    base, others = contenders["baseline"]["train"]["step_s"], [n for n in contenders if n != "baseline"]
    ratios = {f"step_time {n}/baseline": contenders[n]["train"]["step_s"] / base for n in others}
    ratios |= {f"step_time {n}/baseline (paired)": paired_ratio(times[n], times["baseline"]) for n in others}
    return {"contenders": contenders, "ratios": ratios, "unavailable": failed}


def _with_backend(step, backend) -> None:
    with sdpa_kernel(backend):
        step()
