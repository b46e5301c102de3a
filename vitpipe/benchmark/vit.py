"""``--only vit``: vitpipe's ViT against timm's VisionTransformer with the same weights, train and
inference steps, peak step memory, FLOPs and MFU."""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer

from vitpipe.benchmark.common import (
    StepMemory,
    compiled,
    flops_per_image,
    infer_step,
    interleave_steps,
    max_logit_diff,
    paired_ratio,
    peak_tflops,
    random_batch,
    state_bytes,
    summarize,
    train_step,
    utilisation,
)
from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.recipe import optimizer, recipe
from vitpipe.models.registry import VARIANTS
from vitpipe.models.timm_compat import from_timm


def build_pair(cfg: BenchConfig) -> tuple[torch.nn.Module, VisionTransformer]:
    """(vitpipe ViT, timm VisionTransformer) of the variant with the same weights, on ``cfg.device``."""
    torch.manual_seed(cfg.seed)
    v = VARIANTS[cfg.variant]
    tm = VisionTransformer(img_size=cfg.size, patch_size=v["patch_size"], num_classes=cfg.num_classes,
                           embed_dim=v["dim"], depth=v["depth"], num_heads=v["num_heads"], global_pool="token")
    return from_timm(tm).to(cfg.device), tm.to(cfg.device)


def compare_vit(cfg: BenchConfig) -> dict:
    """vitpipe's ViT vs timm's VisionTransformer: train and inference steps, same weights and optimizer."""
    nets = dict(zip(("vitpipe", "timm"), build_pair(cfg)))
    x, y = random_batch(cfg)
    logit_diff = max_logit_diff(nets["vitpipe"], nets["timm"], x)
    flops = flops_per_image(nets["vitpipe"], cfg.size)
    peak = peak_tflops(torch.cuda.get_device_name(), cfg.precision) if cfg.device == "cuda" else None
    train_cfg = recipe(cfg)
    runs = {name: compiled(net.train(), cfg) for name, net in nets.items()}
    opts = {name: optimizer(train_cfg, net) for name, net in nets.items()}
    contenders, times = {name: {} for name in nets}, {}
    for phase, make, fl in (("train", lambda n: train_step(runs[n], opts[n], x, y, cfg), flops["train"]),
                            ("infer", lambda n: infer_step(runs[n], x, cfg), flops["forward"])):
        if phase == "infer":
            for net in nets.values():
                net.eval()
        steps = {name: make(name) for name in nets}
        times[phase] = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats,
                                        device=cfg.device)
        for name, step in steps.items():  # one contender at a time: each peak is its own
            with StepMemory(cfg.device) as mem:
                step()
            held = state_bytes(nets[name], opts[name] if phase == "train" else None)
            s = summarize(times[phase][name], cfg.batch_size)
            contenders[name][phase] = {**s, **utilisation(fl, s["img_s"], peak),
                                       "memory": {**mem.as_dict(), "state_bytes": held}}
    ratios = {}
    for phase, key in (("train", "train_step_time"), ("infer", "infer_time")):
        ratios[f"{key} vitpipe/timm"] = contenders["vitpipe"][phase]["step_s"] / contenders["timm"][phase]["step_s"]
        ratios[f"{key} vitpipe/timm (paired)"] = paired_ratio(times[phase]["vitpipe"], times[phase]["timm"])
    return {"contenders": contenders, "ratios": ratios, "max_abs_logit_diff": logit_diff,
            "flops_per_image": flops, "peak_tflops": peak}
