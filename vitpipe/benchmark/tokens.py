"""``--only tokens``: fewer tokens per step, side by side on the same weights.

- train: a training step (forward, cross-entropy, backward, AdamW) at ``model.patch_drop_rate`` 0, 0.25 and
  0.5 (PatchDropout, Liu et al. 2023), as time ratios to rate 0, the unmodified model;
- infer: eval forwards under ``no_grad`` at ``model.tome_r`` 0, a middle and a high r (ToMe, Bolya et al.
  2023), as images/s ratios to r=0; and how far ToMe moves the outputs: the largest |logit difference|
  and the top-1 agreement with the unmerged model (the models are untrained, so agreement with the
  unmerged model, not accuracy, is what means something).

Two shapes: ``fmnist``, a 28-px Fashion-MNIST ViT (4-px patches, dim 128, depth 6, 4 heads, mlp_ratio 2,
the one-conv-per-stage conv stem, mean pooling, no class token: fmnist_vit's blocks, two more of them and a
lighter stem, so the rows of docs/time-budget.md stay comparable; agreement on the
first ``agree_images`` Fashion-MNIST test images where Debian's copy is installed, else random images), and
``s16``, ViT-S/16 at 224 px (196 patches; random images). The settings that matter are ``--device``,
``--precision``, ``--steps``, ``--warmup`` and ``--repeats``; the batch sizes are this module's (``SHAPES``).
"""

from __future__ import annotations

import copy
import gzip
import os

import numpy as np
import torch

from vitpipe.benchmark.common import infer_step, interleave_steps, paired_ratio, summarize, train_step
from vitpipe.benchmark.config import BenchConfig
from vitpipe.data.fashion_mnist import DEBIAN_DIR
from vitpipe.models.vit import ViT

FMNIST = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, dim=128, depth=6, num_heads=4, mlp_ratio=2.0,
              pos_embed="sincos2d", stem="conv", pool="mean", class_token=False)
S16 = dict(img_size=224, patch_size=16, in_chans=3, num_classes=1000, dim=384, depth=12, num_heads=6)
# name -> (ViT kwargs, train batch, infer batch, ToMe r: middle, high). r: the paper's ViT-S/16 settings
# (8; 13 leaves 40 of 196 patches), and for 49 patches the same fractions of a block's maximum (24)
SHAPES = {"fmnist": (FMNIST, 64, 256, (4, 8)), "s16": (S16, 4, 8, (8, 13))}
DROP_RATES = (0.0, 0.25, 0.5)


def compare_tokens(
    cfg: BenchConfig,
    *,
    shapes: tuple[str, ...] = tuple(SHAPES),
    drop_rates: tuple[float, ...] = DROP_RATES,
    overrides: dict | None = None,
    batches: tuple[int, int] | None = None,
    agree_images: int = 512,
) -> dict:
    """Contenders ``<shape>/drop<rate>`` (phase ``train``) and ``<shape>/tome<r>`` (phase ``infer``);
    ratios against rate 0 and r=0 of the same shape; ``agreement[<shape>/tome<r>]``: max |logit diff|
    and top-1 agreement with r=0. ``overrides`` (ViT kwargs) and ``batches`` (train, infer) shrink the
    shapes for tests."""
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"shapes {unknown} unknown; valid choices: {', '.join(SHAPES)}")
    contenders, ratios, agreement, setting = {}, {}, {}, {}
    for shape in shapes:
        kw, train_batch, infer_batch, rs = SHAPES[shape]
        kw = {**kw, **(overrides or {})}
        train_batch, infer_batch = batches or (train_batch, infer_batch)
        tome_rs = (0, *rs)
        torch.manual_seed(cfg.seed)
        base = ViT(**kw).to(cfg.device)
        setting[shape] = {"model": kw, "train_batch": train_batch, "infer_batch": infer_batch,
                          "patches": base.grid_size[0] * base.grid_size[1], "drop_rates": list(drop_rates),
                          "tome_r": list(tome_rs)}
        g = torch.Generator().manual_seed(cfg.seed + 1)
        size = (kw["in_chans"], kw["img_size"], kw["img_size"])
        x = torch.randn(train_batch, *size, generator=g).to(cfg.device)
        y = torch.randint(0, kw["num_classes"], (train_batch,), generator=g).to(cfg.device)

        # train: the same weights with each drop rate (PatchDropout has no parameters), each its own AdamW
        steps, names, tokens = {}, {}, {}
        for rate in drop_rates:
            name = f"{shape}/drop{rate:g}"
            net = ViT(**kw, patch_drop_rate=rate).to(cfg.device)
            net.load_state_dict(base.state_dict())
            net.train()
            tokens[name] = _tokens_into_blocks(net, x[:1])
            steps[name] = train_step(net, torch.optim.AdamW(net.parameters(), lr=1e-4), x, y, cfg)
            names[rate] = name
        times = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
        for name in steps:
            contenders[name] = {"train": {**summarize(times[name], train_batch), "tokens": tokens[name]}}
        ref = names[drop_rates[0]]
        for rate in drop_rates[1:]:
            a, b = contenders[names[rate]]["train"], contenders[ref]["train"]
            ratios[f"train time drop{rate:g}/drop{drop_rates[0]:g} @{shape}"] = a["step_s"] / b["step_s"]
            ratios[f"train time drop{rate:g}/drop{drop_rates[0]:g} @{shape} (paired)"] = paired_ratio(times[names[rate]],
                                                                                                        times[ref])

        # infer: copies of the same weights, each with its own tome_r
        xi = torch.randn(infer_batch, *size, generator=g).to(cfg.device)
        nets = {}
        for r in tome_rs:
            net = copy.deepcopy(base).eval()
            net.set_tome_r(r)
            nets[r] = net
        steps = {f"{shape}/tome{r}": infer_step(net, xi, cfg) for r, net in nets.items()}
        times = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
        for r, net in nets.items():
            name = f"{shape}/tome{r}"
            with torch.no_grad():
                tokens = net.forward_features(xi[:1]).shape[1]
            contenders[name] = {"infer": {**summarize(times[name], infer_batch), "tokens_after_last_block": tokens}}
        ref = f"{shape}/tome0"
        images, source = _agreement_images(shape, kw, agree_images, cfg)
        setting[shape]["agreement_images"] = {"count": images.shape[0], "source": source}
        with torch.no_grad(), cfg.autocast():
            plain = _logits(nets[0], images, infer_batch)
            for r in rs:
                name = f"{shape}/tome{r}"
                a, b = contenders[name]["infer"], contenders[ref]["infer"]
                ratios[f"infer img/s tome{r}/tome0 @{shape}"] = a["img_s"] / b["img_s"]
                ratios[f"infer img/s tome{r}/tome0 @{shape} (paired)"] = 1 / paired_ratio(times[name], times[ref])
                merged = _logits(nets[r], images, infer_batch)
                agreement[name] = {"max_abs_logit_diff": (merged - plain).abs().max().item(),
                                   "top1_agreement": (merged.argmax(-1) == plain.argmax(-1)).float().mean().item(),
                                   "images": images.shape[0]}
    return {"contenders": contenders, "ratios": ratios, "agreement": agreement, "setting": setting}


def _tokens_into_blocks(net: ViT, x: torch.Tensor) -> int:
    """Tokens a forward of ``net`` (in its mode) feeds its first block: prefix + kept patches in training."""
    seen = []
    handle = net.blocks[0].register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    with torch.no_grad():
        net(x)
    handle.remove()
    return seen[0]


def _logits(net: ViT, images: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([net(images[i : i + batch]).float() for i in range(0, images.shape[0], batch)])


def _agreement_images(shape: str, kw: dict, count: int, cfg: BenchConfig) -> tuple[torch.Tensor, str]:
    """Fashion-MNIST test images for the fmnist shape where Debian's copy is installed, else random ones."""
    path = os.path.join(DEBIAN_DIR, "t10k-images-idx3-ubyte.gz")
    if shape == "fmnist" and kw["img_size"] == 28 and kw["in_chans"] == 1 and os.path.exists(path):
        with gzip.open(path, "rb") as f:
            pixels = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 1, 28, 28)[:count]
        x = torch.from_numpy(pixels.astype(np.float32) / 255)
        return ((x - 0.2860) / 0.3530).to(cfg.device), f"fashion-mnist test[:{count}]"  # the training set's mean/std
    n = min(count, 64)  # random images for the big shape: a forward per image costs more there
    g = torch.Generator().manual_seed(cfg.seed + 2)
    return torch.randn(n, kw["in_chans"], kw["img_size"], kw["img_size"], generator=g).to(cfg.device), "random"


def markdown(res: dict) -> str:
    """The comparison as a markdown table: one row per contender, its phase, step time, images/s, ratio to
    the unmodified model, and for ToMe the tokens left and the agreement with r=0 (docs/performance.md)."""
    c, r, a = res["contenders"], res["ratios"], res["agreement"]
    lines = ["| shape | setting | phase | tokens | step ms | img/s | x unmodified | max abs logit diff | top-1 agree |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, phases in c.items():
        shape, what = name.split("/")
        for phase, s in phases.items():
            if phase == "train":
                ratio = r.get(f"train time {what}/drop0 @{shape}")
                ratio = "1 (time)" if ratio is None else f"{ratio:.2f} (time)"
                tokens, diff, agree = s["tokens"], "", ""
            else:
                ratio = r.get(f"infer img/s {what}/tome0 @{shape}")
                ratio = "1 (img/s)" if ratio is None else f"{ratio:.2f} (img/s)"
                tokens = s["tokens_after_last_block"]
                fig = a.get(name)
                diff, agree = ("", "") if fig is None else (f"{fig['max_abs_logit_diff']:.3g}",
                                                            f"{100 * fig['top1_agreement']:.1f}%")
            lines.append(f"| {shape} | {what} | {phase} | {tokens} | {1e3 * s['step_s']:.1f} | {s['img_s']:.0f} | "
                         f"{ratio} | {diff} | {agree} |")
    return "\n".join(lines)
