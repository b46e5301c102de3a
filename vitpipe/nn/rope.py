"""2D rotary position embedding (RoPE) for image tokens.

Axial RoPE (Su et al. 2021, RoFormer; Heo et al. 2024, "Rotary Position Embedding for Vision
Transformer"): the first half of each head's channels rotates with the patch row, the second half
with the patch column. Rotating q and k makes their dot product depend on the *relative* offset,
so a model runs on any grid without resampling anything: the phases are recomputed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ROPE_COORDS = ("index", "centered")


def rope_2d(h: int, w: int, head_dim: int, *, base: float = 10000.0, num_prefix_tokens: int = 0,
            coords: str = "index", ref_grid: tuple[int, int] | None = None, offset: float = 0.0,
            device=None, dtype=torch.float32) -> tuple[Tensor, Tensor]:
    """Phases for an (h, w) patch grid, row-major like the token sequence.

    ``coords="index"``: a patch's position is its row and column (RoFormer, EVA-02); with ``ref_grid``
    they are rescaled so the grid spans ``ref_grid`` (EVA-02 fine-tuned at another resolution: timm's
    ``ref_feat_shape``). ``coords="centered"``: patch centres normalised to [-1, 1] per axis, angles in
    turns (DINOv3: period base^(k/quarter), so theta = 2 pi x base^(-k/quarter)). ``offset`` is added to
    every index before any rescaling (timm's ``grid_offset``: the Perception Encoder counts from 1).

    Returns (cos, sin), each (num_prefix_tokens + h * w, head_dim). Prefix tokens (class token,
    registers) get the identity rotation: they have no position.
    """
    if head_dim % 4 != 0:
        raise ValueError(f"rope2d needs head_dim divisible by 4 (two axes x rotation pairs), got head_dim={head_dim}")
    if coords not in ROPE_COORDS:
        raise ValueError(f"unknown rope_coords={coords!r}; valid choices: {', '.join(ROPE_COORDS)}")
    quarter = head_dim // 4
    # theta_k = base^(-k / quarter): the RoFormer frequencies for one axis of width head_dim / 2
    freqs = base ** (-torch.arange(quarter, device=device, dtype=torch.float64) / quarter)  # (quarter,)
    ys = torch.arange(h, device=device, dtype=torch.float64)  # (h,) row positions
    xs = torch.arange(w, device=device, dtype=torch.float64)  # (w,) column positions
    if offset:
        ys, xs = ys + offset, xs + offset
    if coords == "centered":
        ys, xs, freqs = (ys + 0.5) / h * 2 - 1, (xs + 0.5) / w * 2 - 1, 2 * math.pi * freqs
    elif ref_grid is not None:
        ys, xs = ys / h * ref_grid[0], xs / w * ref_grid[1]
    rows = ys.repeat_interleave(w)  # (h*w,) row of each token
    cols = xs.repeat(h)  # (h*w,) column of each token
    angles = torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=1)  # (h*w, head_dim/2)
    angles = angles.repeat_interleave(2, dim=1)  # (h*w, head_dim): both members of a pair share the angle
    if num_prefix_tokens:
        angles = torch.cat([angles.new_zeros(num_prefix_tokens, head_dim), angles])
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_pairs(x: Tensor) -> Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): a quarter turn of each channel pair."""
    x = x.unflatten(-1, (-1, 2))  # (..., head_dim/2, 2)
    return torch.stack([-x[..., 1], x[..., 0]], dim=-1).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, heads, N, head_dim) by phases (N, head_dim)."""
    return x * cos.to(x.dtype) + rotate_pairs(x) * sin.to(x.dtype)
