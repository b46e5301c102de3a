"""Conv patch stem: image (B, C, H, W) -> tokens (B, h*w, dim), any H x W divisible by the patch."""

from __future__ import annotations

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
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=self.patch_size, stride=self.patch_size)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Returns tokens (B, h*w, dim) and the grid (h, w) of this input."""
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f"expected images (B, {self.in_chans}, H, W), got shape {tuple(x.shape)}")
        grid = grid_for(x.shape[-2:], self.patch_size)
        x = self.proj(x)  # (B, dim, h, w)
        return x.flatten(2).transpose(1, 2), grid  # (B, h*w, dim)
