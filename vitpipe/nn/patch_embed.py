"""Conv patch stem: image (B, C, H, W) -> tokens (B, h*w, dim), any H x W divisible by the patch;
or flattened patches (B, N, p*q*C) -> tokens (B, N, dim) with the same weights (``embed_patches``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


def to_2tuple(v: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(s) for s in v)
    if len(v) != 2:
        raise ValueError(f"expected an int or (height, width), got {v!r}")
    return v


def grid_for(img_size, patch_size) -> tuple[int, int]:
    """Patch grid (h, w) of an image size; ValueError when a side does not divide."""
    (H, W), (p, q) = to_2tuple(img_size), to_2tuple(patch_size)
    if H <= 0 or W <= 0 or H % p or W % q:
        raise ValueError(
            f"image size {H}x{W} is not divisible by patch size {p}x{q}; "
            f"use a multiple of the patch, e.g. {max(p, H - H % p)}x{max(q, W - W % q)}"
        )
    return H // p, W // q


class PatchEmbed(nn.Module):
    """Non-overlapping patches projected by one strided conv (Dosovitskiy et al. 2021).

    The conv runs on any input size; ``grid_size`` is the grid at the build size.
    """

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, dim: int = 768) -> None:
        super().__init__()
        self.img_size, self.patch_size = to_2tuple(img_size), to_2tuple(patch_size)
        self.grid_size = grid_for(self.img_size, self.patch_size)
        self.in_chans = in_chans
        self.proj = self.build_proj(in_chans, dim)

    def build_proj(self, in_chans: int, dim: int) -> nn.Module:
        """(B, in_chans, H, W) -> (B, dim, H / p, W / q)."""
        return nn.Conv2d(in_chans, dim, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Returns tokens (B, h*w, dim) and the grid (h, w) of this input."""
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f"expected images (B, {self.in_chans}, H, W), got shape {tuple(x.shape)}")
        grid = grid_for(x.shape[-2:], self.patch_size)
        x = self.proj(x)  # (B, dim, h, w)
        return x.flatten(2).transpose(1, 2), grid  # (B, h*w, dim)

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: p * q * in_chans."""
        return self.patch_size[0] * self.patch_size[1] * self.in_chans

    def embed_patches(self, patches: Tensor) -> Tensor:
        """Flattened patches (B, N, p*q*C) in timm NaFlex's order (row, column, channel; channel
        fastest) -> tokens (B, N, dim). A patchify conv is a linear map of each patch: its weight
        (dim, C, p, q) read in that order is the linear weight (dim, p*q*C)."""
        weight = self.proj.weight.permute(0, 2, 3, 1).flatten(1)  # (dim, p*q*C)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class ConvStem(PatchEmbed):
    """Overlapping conv stem in place of the patchify conv (Xiao et al. 2021, "Early Convolutions
    Help Transformers See Better"): log2(patch) 3x3 stride-2 conv-BN-ReLU layers, widths doubling up
    to ``dim`` (dim/8, dim/4, dim/2, dim for patch 16, as in the paper), then a 1x1 conv to ``dim``.

    Same interface and grid as ``PatchEmbed``; the patch must be a power of two, equal on both sides.
    Small data sets gain most: the stem gives the locality prior that patchify leaves to be learned.
    """

    def build_proj(self, in_chans: int, dim: int) -> nn.Module:
        p, q = self.patch_size
        if p != q or p < 2 or p & (p - 1):
            raise ValueError(f"stem='conv' needs a square power-of-two patch (2, 4, 8, 16, ...), got {p}x{q}; "
                             "use stem='patch' for other patch sizes")
        n = p.bit_length() - 1  # each stride-2 layer halves H and W exactly
        widths = [max(dim >> (n - 1 - i), 8) for i in range(n)]
        layers, c = [], in_chans
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
            c = w
        return nn.Sequential(*layers, nn.Conv2d(c, dim, kernel_size=1))

    def embed_patches(self, patches: Tensor) -> Tensor:
        raise ValueError("stem='conv' sees across patch borders, so it cannot embed a patch dict's separate "
                         "patches; use stem='patch' for patch-dict (NaFlex) input")


STEMS = {"patch": PatchEmbed, "conv": ConvStem}
