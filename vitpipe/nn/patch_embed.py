"""Conv patch stem: image (B, C, H, W) -> tokens (B, h*w, dim), any H x W divisible by the patch;
or flattened patches (B, N, p*q*C) -> tokens (B, N, dim) with the same weights (``embed_patches``).

FlexiViT (Beyer et al. 2023, "FlexiViT: One Model for All Patch Sizes"): ``forward(x, patch_size=s)``
embeds at another patch size with the stored kernel PI-resized to s x s on the fly (``pi_resize``);
the parameters keep their built ``patch_size``, so the state_dict is the same at every size.
"""

from __future__ import annotations

from functools import lru_cache

import torch
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


@lru_cache(maxsize=32)
def resize_matrix(old: tuple[int, int], new: tuple[int, int], interpolation: str = "bicubic",
                  antialias: bool = True) -> Tensor:
    """B (new_h*new_w, old_h*old_w), float64: ``resize(x).flatten() = B @ x.flatten()`` for one
    channel x (old_h, old_w), the resize being ``F.interpolate`` (align_corners=False), as timm's."""
    n = old[0] * old[1]
    basis = torch.eye(n, dtype=torch.float64).reshape(n, 1, *old)  # one image per pixel of the old patch
    resized = F.interpolate(basis, size=new, mode=interpolation, antialias=antialias, align_corners=False)
    return resized.reshape(n, new[0] * new[1]).T  # (new_total, old_total): column i = resize of pixel i


@lru_cache(maxsize=32)
def _pinv(old: tuple[int, int], new: tuple[int, int], interpolation: str, antialias: bool) -> Tensor:
    # w' = pinv(B^T) w as rows: w'^T = w^T pinv(B), since pinv(B^T) = pinv(B)^T; once per size pair, in float64
    return torch.linalg.pinv(resize_matrix(old, new, interpolation, antialias))  # (old_total, new_total)


def pi_resize(weight: Tensor, new_size: int | tuple[int, int], *, interpolation: str = "bicubic",
              antialias: bool = True) -> Tensor:
    """PI-resize a patch kernel (D, C, p, q) -> (D, C, p', q') (FlexiViT, section 3.4).

    With B the matrix of the resize from (p, q) to (p', q') (``resize_matrix``), each kernel slice w
    becomes w' = pinv(B^T) w: the solution of B^T w' = w closest to 0, so <B x, w'> = <x, w> for every
    patch x when upsampling (B has full column rank), the least-squares fit when downsampling. The
    same map as timm's ``resample_patch_embed``; differentiable in ``weight`` (the matrix is constant).
    """
    old, new = tuple(weight.shape[-2:]), to_2tuple(new_size)
    if old == new:
        return weight
    dtype = torch.promote_types(weight.dtype, torch.float32)  # half kernels resized in float32, as timm's
    pinv = _pinv(old, new, interpolation, antialias).to(device=weight.device, dtype=dtype)
    D, C = weight.shape[:2]
    out = weight.reshape(D, C, -1).to(dtype) @ pinv  # (D, C, p*q) @ (p*q, p'*q') -> (D, C, p'*q')
    return out.reshape(D, C, *new).to(weight.dtype)


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

    def forward(self, x: Tensor, patch_size: int | tuple[int, int] | None = None) -> tuple[Tensor, tuple[int, int]]:
        """Returns tokens (B, h*w, dim) and the grid (h, w) of this input, cut into ``patch_size``
        patches (None: the built size; another size: the kernel PI-resized to it, ``pi_resize``)."""
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f"expected images (B, {self.in_chans}, H, W), got shape {tuple(x.shape)}")
        size = self.patch_size if patch_size is None else to_2tuple(patch_size)
        grid = grid_for(x.shape[-2:], size)
        if size == self.patch_size:
            x = self.proj(x)  # (B, dim, h, w)
        else:
            x = F.conv2d(x, pi_resize(self.proj.weight, size), self.proj.bias, stride=size)  # (B, dim, h, w)
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

    ``depth`` (``model.stem_depth``): 3x3 conv-BN-ReLU layers per stride-2 stage. 1 is the paper's stem;
    each further layer is a stride-1 3x3 conv at that stage's width (a hybrid stem, as LeViT's or
    ViT-R's convolutional front ends: more of the early features computed by convolutions).
    """

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, dim: int = 768, depth: int = 1) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"stem_depth={depth!r}; use an int >= 1 (3x3 conv layers per stride-2 stage of "
                             "stem='conv'; 1: Xiao et al. 2021)")
        self.depth = depth
        super().__init__(img_size, patch_size, in_chans, dim)

    def build_proj(self, in_chans: int, dim: int) -> nn.Module:
        p, q = self.patch_size
        if p != q or p < 2 or p & (p - 1):
            raise ValueError(f"stem='conv' needs a square power-of-two patch (2, 4, 8, 16, ...), got {p}x{q}; "
                             "use stem='patch' for other patch sizes")
        n = p.bit_length() - 1  # each stride-2 layer halves H and W exactly
        widths = [max(dim >> (n - 1 - i), 8) for i in range(n)]
        layers, c = [], in_chans
        for w in widths:
            for k in range(self.depth):  # the stage's first layer halves H and W, the others keep them
                layers += [nn.Conv2d(c, w, 3, stride=2 if k == 0 else 1, padding=1, bias=False),
                           nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
                c = w
        return nn.Sequential(*layers, nn.Conv2d(c, dim, kernel_size=1))

    def forward(self, x: Tensor, patch_size: int | tuple[int, int] | None = None) -> tuple[Tensor, tuple[int, int]]:
        if patch_size is not None and to_2tuple(patch_size) != self.patch_size:
            raise ValueError(f"stem='conv' embeds at its built patch {self.patch_size[0]} only, got patch size "
                             f"{patch_size}; use stem='patch' for other patch sizes (FlexiViT)")
        return super().forward(x)

    def embed_patches(self, patches: Tensor) -> Tensor:
        raise ValueError("stem='conv' sees across patch borders, so it cannot embed a patch dict's separate "
                         "patches; use stem='patch' for patch-dict (NaFlex) input")


STEMS = {"patch": PatchEmbed, "conv": ConvStem}
