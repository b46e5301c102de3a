"""Comparison (a)/(b): vitpipe's ViT vs timm's VisionTransformer, same config and weights."""

from __future__ import annotations

import torch

from vitpipe.bench.flops import flops_per_image, peak_tflops, utilisation
from vitpipe.bench.memory import StepMemory, state_bytes
from vitpipe.bench.models import build_pair, infer_step, make_optimizer, maybe_compile, random_batch, train_step
from vitpipe.bench.settings import BenchConfig
from vitpipe.bench.timing import interleave_steps, paired_ratio, summarize


def max_logit_diff(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> float:
    """Largest |logit difference| in eval mode, fp32: zero up to rounding means the same network."""
    modes = a.training, b.training
    a.eval(), b.eval()
    with torch.no_grad():
        diff = (a(x).float() - b(x).float()).abs().max().item()
    a.train(modes[0]), b.train(modes[1])
    return diff


def compare_vit(cfg: BenchConfig) -> dict:
    vitpipe_net, timm_net = build_pair(cfg)
    nets = {"vitpipe": vitpipe_net, "timm": timm_net}
    x, y = random_batch(cfg)
    logit_diff = max_logit_diff(vitpipe_net, timm_net, x)
    flops = flops_per_image(vitpipe_net, cfg.size)
    peak = peak_tflops(torch.cuda.get_device_name(), cfg.precision) if cfg.device == "cuda" else None

    runs = {name: maybe_compile(net.train(), cfg) for name, net in nets.items()}
    opts = {name: make_optimizer(net) for name, net in nets.items()}
    steps = {name: train_step(runs[name], opts[name], x, y, cfg) for name in nets}
    train = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
    train_mem = {}
    for name, step in steps.items():  # one contender at a time: each peak is its own
        with StepMemory(cfg.device) as mem:
            step()
        train_mem[name] = {**mem.as_dict(), "state_bytes": state_bytes(nets[name], opts[name])}

    for net in nets.values():
        net.eval()
    fwd = {name: infer_step(runs[name], x, cfg) for name in nets}
    infer = interleave_steps(fwd, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
    infer_mem = {}
    for name, step in fwd.items():
        with StepMemory(cfg.device) as mem:
            step()
        infer_mem[name] = {**mem.as_dict(), "state_bytes": state_bytes(nets[name])}

    contenders = {}
    for name in nets:
        tr, inf = summarize(train[name], cfg.batch_size), summarize(infer[name], cfg.batch_size)
        tr.update(utilisation(flops["train"], tr["img_s"], peak), memory=train_mem[name])
        inf.update(utilisation(flops["forward"], inf["img_s"], peak), memory=infer_mem[name])
        contenders[name] = {"train": tr, "infer": inf}
    vp, tm = contenders["vitpipe"], contenders["timm"]
    return {
        "contenders": contenders,
        "ratios": {
            "train_step_time vitpipe/timm": vp["train"]["step_s"] / tm["train"]["step_s"],
            "train_step_time vitpipe/timm (paired)": paired_ratio(train["vitpipe"], train["timm"]),
            "infer_time vitpipe/timm": vp["infer"]["step_s"] / tm["infer"]["step_s"],
            "infer_time vitpipe/timm (paired)": paired_ratio(infer["vitpipe"], infer["timm"]),
        },
        "max_abs_logit_diff": logit_diff,
        "flops_per_image": flops,
        "peak_tflops": peak,
    }
