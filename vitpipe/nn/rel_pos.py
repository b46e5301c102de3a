"""Relative position bias for images: a per-head bias on the attention logits from the offset of two patches.

Two kinds, each a module mapping a grid (h, w) to a bias (1, heads, P + h*w, P + h*w) that the attention
core adds to its logits (``attn_bias``), fused or explicit alike:

- ``bias``: a learned table of ``(2H-1)(2W-1)`` rows by heads, indexed by the offset (dy, dx) of query and
  key (Swin, Shaw et al. 2018 in 2D; BEiT). With prefix tokens (class token, registers) the table has
  BEiT's three extra rows: prefix -> patch, patch -> prefix, prefix -> prefix. At another grid than the
  built one the table is resized with timm's ``resize_rel_pos_bias_table`` (BEiT's geometric
  interpolation), so a model trained at 224 px evaluates at 384 px as BEiT fine-tunes do.
- ``mlp_cr`` / ``mlp_swin``: a small MLP of the log-spaced offset (Swin-V2's continuous position bias;
  timm's ``vit_relpos_*``): ``cr`` is sign(d) log(1 + |d|), ``swin`` normalises offsets to [-8, 8] by the
  grid first and squashes the output with 16 sigmoid. Any grid works: the coordinates are recomputed.
  Prefix tokens get a zero bias.

Offsets are query minus key, rows first, as timm's ``gen_relative_position_index``: parity with timm's
``vit_relpos_*`` and ``beit_*`` is a weight rename (``vitpipe.models.timm_relpos``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.layers import Mlp, resize_rel_pos_bias_table
from torch import Tensor, nn

REL_POS_KINDS = ("none", "bias", "mlp_cr", "mlp_swin")


def relative_position_index(h: int, w: int, num_prefix: int = 0, device=None) -> Tensor:
    """Long (P + h*w, P + h*w): the table row of each (query, key) pair.

    Patches: ``(dy + h - 1) * (2w - 1) + (dx + w - 1)`` with (dy, dx) = query - key. Prefix tokens
    (BEiT, for any number of them): prefix -> patch reads row ``n``, patch -> prefix ``n + 1``,
    prefix -> prefix ``n + 2``, where ``n = (2h - 1)(2w - 1)``.
    """
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    coords = torch.stack([rows.flatten(), cols.flatten()])  # (2, h*w)
    rel = coords[:, :, None] - coords[:, None, :]  # (2, q, k): query minus key
    index = (rel[0] + h - 1) * (2 * w - 1) + (rel[1] + w - 1)
    if num_prefix:
        n = (2 * h - 1) * (2 * w - 1)
        index = F.pad(index, [num_prefix, 0, num_prefix, 0])
        index[:num_prefix, :] = n
        index[:, :num_prefix] = n + 1
        index[:num_prefix, :num_prefix] = n + 2
    return index


def log_offsets(h: int, w: int, mode: str) -> Tensor:
    """(2h-1, 2w-1, 2) float: each offset (dy, dx) on the log scale of ``mode`` ('cr' or 'swin')."""
    dy = torch.arange(-(h - 1), h, dtype=torch.float32)
    dx = torch.arange(-(w - 1), w, dtype=torch.float32)
    d = torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1)  # (2h-1, 2w-1, 2)
    if mode == "swin":  # Swin-V2: offsets to [-8, 8] by the grid, then log2(1 + |d|) / log2(8)
        d = d / torch.tensor([max(h - 1, 1), max(w - 1, 1)], dtype=torch.float32) * 8
        return torch.sign(d) * torch.log2(1.0 + d.abs()) / math.log2(8)
    return torch.sign(d) * torch.log(1.0 + d.abs())


class RelPosBias(nn.Module):
    """The learned table (BEiT/Swin): ``relative_position_bias_table`` ((2H-1)(2W-1) [+3], heads)."""

    def __init__(self, grid_size: tuple[int, int], num_heads: int, num_prefix_tokens: int = 0) -> None:
        super().__init__()
        self.grid_size, self.num_heads, self.num_prefix = tuple(grid_size), num_heads, num_prefix_tokens
        rows = (2 * self.grid_size[0] - 1) * (2 * self.grid_size[1] - 1) + (3 if num_prefix_tokens else 0)
        self.relative_position_bias_table = nn.Parameter(torch.zeros(rows, num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self._index: dict = {}

    def table_for(self, grid: tuple[int, int]) -> Tensor:
        """The table at ``grid``: the parameter itself at the built grid, else timm's resize of it."""
        grid = tuple(grid)
        if grid == self.grid_size:
            return self.relative_position_bias_table
        rows = (2 * grid[0] - 1) * (2 * grid[1] - 1) + (3 if self.num_prefix else 0)
        return resize_rel_pos_bias_table(self.relative_position_bias_table, new_window_size=grid,
                                         new_bias_shape=(rows, self.num_heads), old_window_size=self.grid_size)

    def forward(self, grid: tuple[int, int]) -> Tensor:
        """(1, heads, P + h*w, P + h*w) for grid (h, w)."""
        table = self.table_for(grid)
        key = (tuple(grid), table.device)
        if key not in self._index:
            self._index[key] = relative_position_index(*grid, self.num_prefix, device=table.device)
        return table[self._index[key]].permute(2, 0, 1)[None]


class RelPosMlp(nn.Module):
    """Swin-V2's continuous bias: an MLP (2 -> hidden -> heads, ReLU, dropout 0.125 as timm's) of the
    log-spaced offsets; ``mode='swin'`` adds 16 sigmoid on its output. Zero bias for prefix tokens."""

    def __init__(self, num_heads: int, hidden_dim: int = 128, num_prefix_tokens: int = 0, mode: str = "cr") -> None:
        super().__init__()
        if mode not in ("cr", "swin"):
            raise ValueError(f"unknown relative position MLP mode={mode!r}; valid choices: cr, swin")
        self.num_heads, self.num_prefix, self.mode = num_heads, num_prefix_tokens, mode
        bias = (True, False) if mode == "swin" else True
        self.mlp = Mlp(2, hidden_features=hidden_dim, out_features=num_heads, act_layer=nn.ReLU, bias=bias,
                       drop=(0.125, 0.0))
        self._buffers_for: dict = {}

    def forward(self, grid: tuple[int, int]) -> Tensor:
        """(1, heads, P + h*w, P + h*w) for grid (h, w)."""
        device = self.mlp.fc1.weight.device
        key = (tuple(grid), device)
        if key not in self._buffers_for:
            self._buffers_for[key] = (log_offsets(*grid, self.mode).to(device),
                                      relative_position_index(*grid, device=device).flatten())
        coords, index = self._buffers_for[key]
        n = grid[0] * grid[1]
        table = self.mlp(coords.to(self.mlp.fc1.weight.dtype)).reshape(-1, self.num_heads)  # ((2h-1)(2w-1), heads)
        bias = table[index].reshape(n, n, self.num_heads).permute(2, 0, 1)  # (heads, n, n)
        if self.mode == "swin":
            bias = 16 * torch.sigmoid(bias)
        if self.num_prefix:
            bias = F.pad(bias, [self.num_prefix, 0, self.num_prefix, 0])
        return bias[None]


def build_rel_pos(kind: str, *, grid_size: tuple[int, int], num_heads: int, num_prefix_tokens: int,
                  hidden_dim: int | None = None) -> nn.Module | None:
    """The module of ``kind`` (REL_POS_KINDS), or None for 'none'."""
    if kind == "none":
        return None
    if kind == "bias":
        return RelPosBias(grid_size, num_heads, num_prefix_tokens)
    if kind in ("mlp_cr", "mlp_swin"):
        return RelPosMlp(num_heads, hidden_dim or 128, num_prefix_tokens, mode=kind.split("_")[1])
    raise ValueError(f"unknown rel_pos={kind!r}; valid choices: {', '.join(REL_POS_KINDS)}")
