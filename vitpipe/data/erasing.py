"""Random erasing (Zhong et al. 2020), batched on the device for the fast path.

Same distribution as timm's ``RandomErasing(probability=p, mode="pixel")`` with one box per image
(the standard path uses timm's own class, ``standard_transform``): with probability ``p`` an image
gets a box of area ``U(min_area, max_area) * H * W`` and aspect ``exp(U(log 0.3, log 1/0.3))``, the
first of 10 attempts that fits strictly inside the image, filled with N(0, 1) noise per pixel and
channel (the input is normalised, so that is noise of the data's own scale). DeiT uses p = 0.25.

Every draw comes from the one ``generator`` that also drew the batch's crops and flips, so the
erasing of a batch is a function of (seed, rank, step): exact resume holds (vitpipe.data.resume).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ATTEMPTS = 10  # timm's


def random_erasing(x: Tensor, p: float, *, min_area: float = 0.02, max_area: float = 1 / 3,
                   min_aspect: float = 0.3, generator: torch.Generator | None = None) -> Tensor:
    """Erase one random box per image with probability ``p``. x: float (B, C, H, W), normalised.

    Returns a new tensor; ``p <= 0`` returns ``x`` itself.
    """
    if p <= 0:
        return x
    B, C, H, W = x.shape
    dev, gen = x.device, generator

    def uniform(lo: float, hi: float, *shape: int) -> Tensor:
        return lo + (hi - lo) * torch.rand(*shape, device=dev, generator=gen)

    apply = torch.rand(B, device=dev, generator=gen) < p  # (B,)
    area = uniform(min_area, max_area, B, ATTEMPTS) * (H * W)  # (B, A)
    aspect = uniform(math.log(min_aspect), math.log(1 / min_aspect), B, ATTEMPTS).exp()  # (B, A)
    h = (area * aspect).sqrt().round().long()  # (B, A)
    w = (area / aspect).sqrt().round().long()
    fits = (h < H) & (w < W)  # (B, A): timm's acceptance test
    first = torch.where(fits, torch.arange(ATTEMPTS, device=dev), ATTEMPTS).min(dim=1).values  # (B,)
    apply &= first < ATTEMPTS  # no attempt fitted: timm leaves the image as is
    pick = first.clamp(max=ATTEMPTS - 1)[:, None]
    h, w = h.gather(1, pick)[:, 0], w.gather(1, pick)[:, 0]  # (B,)
    # top uniform in [0, H - h], left in [0, W - w] (inclusive, as random.randint)
    top = (torch.rand(B, device=dev, generator=gen) * (H - h + 1)).floor().long()
    left = (torch.rand(B, device=dev, generator=gen) * (W - w + 1)).floor().long()
    rows = torch.arange(H, device=dev)[None, :]  # (1, H)
    cols = torch.arange(W, device=dev)[None, :]
    in_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])  # (B, H)
    in_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])  # (B, W)
    mask = (in_rows[:, :, None] & in_cols[:, None, :] & apply[:, None, None])[:, None]  # (B, 1, H, W)
    noise = torch.randn(x.shape, device=dev, dtype=x.dtype, generator=gen)  # (B, C, H, W), mode "pixel"
    return torch.where(mask, noise, x)


def timm_random_erasing(p: float):
    """The standard path's per-image op: timm's own class, the same settings as above."""
    from timm.data.random_erasing import RandomErasing

    return RandomErasing(probability=p, mode="pixel", device="cpu")
