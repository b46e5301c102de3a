"""Is a relevance map faithful to the model? Deletion and insertion AUC (Petsiuk et al. 2018, "RISE"; the
perturbation test of Chefer et al. 2021).

Deletion: replace the image's patches by a neutral fill, most relevant first (by the map), and follow the
probability of the class the model predicted on the intact image; a faithful map makes it fall at once
(low area under the curve). Insertion: start from the fill and put patches back in the same order; a
faithful map makes the probability rise at once (high area). The same images with a random patch order
give the baseline a method has to beat.

Fill (``fill=``):
    mean  the normalised input's zero, i.e. the data set's mean colour (what the model sees as "nothing"
          under its own normalisation); the default
    blur  a Gaussian blur of the image itself (Petsiuk's insertion start), which keeps colours and coarse
          layout, so it removes less evidence than ``mean``

Curves are sampled at ``steps + 1`` fractions 0, 1/steps, ..., 1 of the patches and integrated with the
trapezoid rule over that fraction: AUCs lie in [0, 1]. The network is used as given: put it in eval mode.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitpipe.config.options import FILLS
from vitpipe.errors import ConfigError


def fill_image(x: Tensor, fill: str) -> Tensor:
    """The neutral image (B, C, H, W) that deleted patches take (see the module docstring)."""
    if fill == "mean":
        return torch.zeros_like(x)
    if fill == "blur":
        from torchvision.transforms.v2.functional import gaussian_blur

        k = 2 * (max(x.shape[-2:]) // 8) + 1  # a kernel an eighth of the image wide: patch detail is gone
        return gaussian_blur(x, kernel_size=[k, k], sigma=[k / 4.0, k / 4.0])
    raise ConfigError(f"fill={fill!r} is not valid; choose one of {list(FILLS)}")


@torch.no_grad()
def perturbation_curves(net: nn.Module, x: Tensor, maps: Tensor, *, mode: str, fill: str = "mean",
                        steps: int | None = None, target: Tensor | None = None) -> Tensor:
    """Probability of ``target`` (default: the class predicted on ``x``) as patches are deleted or inserted.

    x: (B, C, H, W) model input; maps: (B, h, w) relevance on the patch grid (H, W multiples of h, w);
    mode: "deletion" | "insertion"; steps: points on the curve besides the start (default: one per patch).
    Returns (B, steps + 1): column k after round(k / steps * h * w) patches.
    """
    if mode not in ("deletion", "insertion"):
        raise ConfigError(f"mode={mode!r} is not valid; choose deletion or insertion")
    B, _, H, W = x.shape
    h, w = maps.shape[-2:]
    if H % h or W % w:
        raise ConfigError(f"maps of {h}x{w} patches do not tile {H}x{W} images; give maps on the model's patch grid")
    n = h * w
    steps = n if steps is None else min(int(steps), n)
    if steps < 1:
        raise ConfigError(f"steps={steps} is not valid; use a positive int")
    if target is None:
        target = net(x).argmax(dim=-1)  # (B,)
    order = torch.argsort(maps.reshape(B, n).float(), dim=1, descending=True, stable=True)  # (B, n) best first
    background = fill_image(x, fill)
    rows = torch.arange(B, device=x.device)
    probs = []
    for k in range(steps + 1):
        chosen = torch.zeros(B, n, dtype=torch.bool, device=x.device)
        chosen.scatter_(1, order[:, : round(k * n / steps)], True)  # the k-th fraction of the ranking
        mask = chosen.reshape(B, 1, h, w).repeat_interleave(H // h, dim=2).repeat_interleave(W // w, dim=3)
        xk = torch.where(mask, background, x) if mode == "deletion" else torch.where(mask, x, background)
        probs.append(net(xk).float().softmax(dim=-1)[rows, target])  # (B,)
    return torch.stack(probs, dim=1)  # (B, steps + 1)


def auc(curves: Tensor) -> Tensor:
    """(B, K + 1) curves over fractions 0..1 -> (B,) trapezoid areas."""
    return torch.trapezoid(curves, dx=1.0 / (curves.shape[1] - 1), dim=1)


def random_maps(like: Tensor, seed: int = 0) -> Tensor:
    """Maps of i.i.d. uniform noise shaped like ``like``: a random patch order per image, reproducible."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(like.shape, generator=gen).to(like.device)


def deletion_insertion(net: nn.Module, x: Tensor, maps: Tensor, **kw) -> tuple[Tensor, Tensor]:
    """(deletion AUC (B,), insertion AUC (B,)) of ``maps`` on images x; ``kw`` as in perturbation_curves."""
    target = kw.pop("target", None)
    if target is None:
        with torch.no_grad():
            target = net(x).argmax(dim=-1)
    return (auc(perturbation_curves(net, x, maps, mode="deletion", target=target, **kw)),
            auc(perturbation_curves(net, x, maps, mode="insertion", target=target, **kw)))


def faithfulness_table(net: nn.Module, x: Tensor, methods: dict[str, Tensor], *, fill: str = "mean",
                       steps: int | None = None, seed: int = 0, batch_size: int = 64) -> list[dict]:
    """One row per method, plus ``random`` (a random patch order on the same images):
    {method, deletion_auc (lower is better), insertion_auc (higher is better), n_images}."""
    methods = {**methods, "random": random_maps(next(iter(methods.values())), seed)}
    totals = {m: [0.0, 0.0] for m in methods}
    for start in range(0, len(x), batch_size):
        xb = x[start:start + batch_size]
        with torch.no_grad():
            target = net(xb).argmax(dim=-1)  # the prediction on the intact image, shared by every method
        for name, maps in methods.items():
            d, i = deletion_insertion(net, xb, maps[start:start + batch_size].to(xb.device), target=target,
                                      fill=fill, steps=steps)
            totals[name][0] += d.sum().item()
            totals[name][1] += i.sum().item()
    return [{"method": m, "deletion_auc": d / len(x), "insertion_auc": i / len(x), "n_images": len(x)}
            for m, (d, i) in totals.items()]


def format_table(rows: list[dict]) -> str:
    """The table as aligned text (what the CLI prints)."""
    head = (f"{'method':<12} {'deletion AUC (lower is better)':>31} {'insertion AUC (higher is better)':>33} "
            f"{'n images':>9}")
    lines = [head] + [f"{r['method']:<12} {r['deletion_auc']:>31.3f} {r['insertion_auc']:>33.3f} {r['n_images']:>9d}"
                      for r in rows]
    return "\n".join(lines)


__all__ = ["auc", "deletion_insertion", "faithfulness_table", "fill_image", "format_table",
           "perturbation_curves", "random_maps"]
