"""Native-resolution patch sequences (NaViT, Dehghani et al. 2023; timm's ``NaFlexVit``).

An image keeps its aspect ratio: it is resized to the largest patch grid of at most ``max_seq_len``
patches and cut into patches, flattened in timm's order (row, column, channel: ``(p, q, C)``,
channel fastest). A batch is the dictionary timm's ``NaFlexCollator`` builds:

    patches     (B, N, p*q*C) float   the patches of each image, padded to the batch's N
    patch_coord (B, N, 2) int64       (row, col) of each patch on its own image's grid
    patch_valid (B, N) bool           False for padding

An image's grid is (max valid row + 1, max valid col + 1), so no other size travels with it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

NAFLEX_KEYS = ("patches", "patch_coord", "patch_valid")


def seq_grid(image_hw: tuple[int, int], patch_size: tuple[int, int], max_seq_len: int) -> tuple[int, int]:
    """The largest grid (h, w) with h * w <= max_seq_len for an image of ``image_hw`` scaled by one
    ratio r, each side rounded up to whole patches: (ceil(H r / p), ceil(W r / q)), at least 1 each.

    timm's ``get_image_size_for_seq`` finds r by bisection; the feasible ratios form an interval
    (0, r*] whose end is a step of one of the two ceilings, so trying every step is exact.
    """
    (H, W), (p, q) = image_hw, patch_size
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len={max_seq_len} must be at least 1 (one patch)")

    def grid(r: float) -> tuple[int, int]:
        # a tiny slack: at a step r = k p / H, float rounding must not push the ceiling to k + 1
        return max(1, math.ceil(H * r / p - 1e-9)), max(1, math.ceil(W * r / q - 1e-9))

    steps = [k * p / H for k in range(1, max_seq_len + 1)] + [k * q / W for k in range(1, max_seq_len + 1)]
    best = max((r for r in steps if math.prod(grid(r)) <= max_seq_len), default=None)
    return (1, 1) if best is None else grid(best)


def patchify_image(img: Tensor, patch_size: int | tuple[int, int], max_seq_len: int) -> dict[str, Tensor]:
    """One image (C, H, W) at its own aspect -> {patches (N, p*q*C), patch_coord (N, 2), patch_valid (N,)}.

    Resized (bicubic, antialiased, as timm's ``ResizeToSequence``) to ``seq_grid``'s grid, N = h * w
    patches in row-major order.
    """
    if img.ndim != 3:
        raise ValueError(f"patchify_image takes one image (C, H, W), got shape {tuple(img.shape)}")
    p, q = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
    C, H, W = img.shape
    h, w = seq_grid((H, W), (p, q), max_seq_len)
    if (h * p, w * q) != (H, W):
        img = F.interpolate(img[None].float(), size=(h * p, w * q), mode="bicubic", align_corners=False,
                            antialias=True)[0]
    patches = img.reshape(C, h, p, w, q).permute(1, 3, 2, 4, 0).reshape(h * w, p * q * C)  # (h*w, p*q*C)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    coord = torch.stack([rows.flatten(), cols.flatten()], dim=1)  # (h*w, 2) as (row, col)
    return {"patches": patches, "patch_coord": coord, "patch_valid": torch.ones(h * w, dtype=torch.bool)}


def pad_batch(items: list[dict[str, Tensor]], seq_len: int | None = None) -> dict[str, Tensor]:
    """Stack per-image dicts into one batch padded to ``seq_len`` (default: the longest image) with
    zero patches at coordinate (0, 0) and ``patch_valid`` False, as timm's ``NaFlexCollator``."""
    if not items:
        raise ValueError("pad_batch needs at least one image")
    longest = max(len(it["patches"]) for it in items)
    seq_len = longest if seq_len is None else seq_len
    if seq_len < longest:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest image ({longest} patches); "
                         f"use seq_len >= {longest} or None")
    B, D = len(items), items[0]["patches"].shape[-1]
    patches = items[0]["patches"].new_zeros(B, seq_len, D)
    coord = torch.zeros(B, seq_len, 2, dtype=torch.long)
    valid = torch.zeros(B, seq_len, dtype=torch.bool)
    for i, it in enumerate(items):
        n = len(it["patches"])
        patches[i, :n], coord[i, :n], valid[i, :n] = it["patches"], it["patch_coord"], it["patch_valid"]
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def check_batch(batch: dict, patch_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """(patches, patch_coord with padding at (0, 0), patch_valid) of a batch dict; a one-line
    ValueError naming the bad value and what is valid."""
    missing = [k for k in NAFLEX_KEYS if k not in batch]
    if missing:
        raise ValueError(f"patch dict is missing {', '.join(map(repr, missing))}; it needs "
                         f"{', '.join(map(repr, NAFLEX_KEYS))} (has {', '.join(map(repr, batch)) or 'no keys'})")
    if "attn_mask" in batch:
        raise ValueError("patch dict key 'attn_mask' is not supported: padding is masked from 'patch_valid'")
    patches, coord, valid = (batch[k] for k in NAFLEX_KEYS)
    if not isinstance(patches, Tensor) or patches.ndim != 3 or patches.shape[-1] != patch_dim:
        raise ValueError(f"'patches' must be a tensor (B, N, {patch_dim}) (patch height * width * channels), "
                         f"got {_shape(patches)}")
    B, N = patches.shape[:2]
    if not isinstance(coord, Tensor) or tuple(coord.shape) != (B, N, 2) or coord.is_floating_point():
        raise ValueError(f"'patch_coord' must be an integer tensor (B, N, 2) = ({B}, {N}, 2) of (row, col), "
                         f"got {_shape(coord)}")
    if not isinstance(valid, Tensor) or tuple(valid.shape) != (B, N) or valid.dtype != torch.bool:
        raise ValueError(f"'patch_valid' must be a bool tensor (B, N) = ({B}, {N}), got {_shape(valid)}")
    coord = coord.long() * valid[..., None]  # padding at (0, 0): its coordinates may be anything
    empty = (~valid.any(dim=1)).nonzero().flatten().tolist()
    if empty or bool((coord < 0).any()):
        what = f"image(s) {empty} have no valid patch" if empty else "'patch_coord' has negative values"
        raise ValueError(f"{what}; each image needs at least one valid patch at coordinates >= 0")
    return patches, coord, valid


def grid_sizes(coord: Tensor, valid: Tensor) -> Tensor:
    """(B, 2) grid (h, w) of each image: its largest valid (row, col) + 1."""
    return (coord * valid[..., None]).amax(dim=1) + 1


def _shape(v) -> str:
    if isinstance(v, Tensor):
        return f"{v.dtype} {tuple(v.shape)}".replace("torch.", "")
    return type(v).__name__
