"""Positional encodings: pure functions first, thin modules on top (MAE ``util/pos_embed.py``).

Every module maps tokens (B, P + h*w, dim) -> same shape, where the first P are prefix tokens
(class token, registers) and the rest are patches in row-major order, for *any* grid (h, w):
learned tables are resampled bicubically, fixed ones recomputed. So a checkpoint trained at
224 px evaluates at 384 px. Fixed tables are non-persistent buffers; learned ones parameters.

``forward_naflex(x, coord, sizes)`` is the same encoding for a patch-dict batch (``vitpipe.nn.naflex``):
each token's position is its (row, col) on its own image's grid ``sizes[b]``. Learned tables are
resampled as timm's ``NaFlexVit`` does: by default aspect-preserving (``ar_preserving=True``, timm's
``pos_embed_ar_preserving`` of its ``par``/``parfac`` models): both axes by one scale, just enough to
cover (h, w), then cropped to (h, w), so rows and columns keep one spacing whatever the image's aspect
(``par_size``); with ``ar_preserving=False`` each axis to its own length. At the built grid both are
the table itself, as in the tensor path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitpipe.nn.rope import rope_2d

POS_EMBED_KINDS = ("none", "learned", "sincos1d", "sincos2d", "learned2d", "rope2d")


def sincos_1d(positions: Tensor | int, dim: int, *, temperature: float = 10000.0) -> Tensor:
    """Sinusoidal table of "Attention Is All You Need" (Vaswani et al. 2017, section 3.5).

    PE(pos, 2i) = sin(pos / T^(2i/dim)), PE(pos, 2i+1) = cos(pos / T^(2i/dim)): interleaved.
    positions: an int n (positions 0..n-1) or a float tensor (L,). Returns (L, dim) float32.
    """
    if dim % 2 != 0:
        raise ValueError(f"sincos_1d needs an even dim, got dim={dim}")
    if isinstance(positions, int):
        positions = torch.arange(positions)
    pos = positions.to(torch.float64)
    inv_freq = temperature ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,) = T^(-2i/dim)
    angles = pos[:, None] * inv_freq[None, :]  # (L, dim/2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1).float()  # (L, dim), sin/cos interleaved


def sincos_2d(h: int, w: int, dim: int, *, temperature: float = 10000.0) -> Tensor:
    """Factorized 2D sinusoid (MAE; Chen et al. 2021 MoCo v3): first dim/2 channels encode the row,
    the last dim/2 the column. Returns (h*w, dim) in row-major token order."""
    if dim % 4 != 0:
        raise ValueError(f"sincos2d needs dim divisible by 4 (two axes x sin/cos), got dim={dim}")
    rows = sincos_1d(h, dim // 2, temperature=temperature)  # (h, dim/2)
    cols = sincos_1d(w, dim // 2, temperature=temperature)  # (w, dim/2)
    return torch.cat([rows[:, None, :].expand(h, w, -1), cols[None, :, :].expand(h, w, -1)], dim=-1).reshape(h * w, dim)


def resample_grid(table: Tensor, old: tuple[int, int], new: tuple[int, int]) -> Tensor:
    """Bicubic resampling of a per-patch table (..., H*W, D) from grid `old` to grid `new` (timm's
    ``resample_abs_pos_embed``; antialias when shrinking)."""
    if tuple(old) == tuple(new):
        return table
    lead, D = table.shape[:-2], table.shape[-1]
    grid = table.reshape(-1, old[0], old[1], D).permute(0, 3, 1, 2).float()  # (B', D, H, W)
    grid = F.interpolate(grid, size=new, mode="bicubic", align_corners=False, antialias=True)
    return grid.permute(0, 2, 3, 1).reshape(*lead, new[0] * new[1], D).to(table.dtype)


def par_size(built: tuple[int, int], grid: tuple[int, int], ar_preserving: bool = True) -> tuple[int, int]:
    """Size to resample a table built for ``built`` to before cropping it to ``grid``: one scale for
    both axes, the smallest covering ``grid``. For timm's square tables (G, G) this is its
    (max(h, w), max(h, w)); the built grid itself maps to itself. Without ``ar_preserving``: ``grid``."""
    if not ar_preserving:
        return tuple(grid)
    scale = max(grid[0] / built[0], grid[1] / built[1])
    return max(grid[0], round(built[0] * scale)), max(grid[1], round(built[1] * scale))


def per_grid(coord: Tensor, sizes: Tensor, table_fn) -> Tensor:
    """Per-token rows (B, N, D) of per-grid tables: token n of image b reads row ``r * w + c`` of
    ``table_fn(h, w) -> (h*w, D)`` for its grid (h, w) = sizes[b]; each distinct grid built once."""
    B, N, _ = coord.shape
    index = coord[..., 0] * sizes[:, 1:] + coord[..., 1]  # (B, N): row-major position on its own grid
    out = None
    for h, w in torch.unique(sizes, dim=0).tolist():
        table = table_fn(h, w)  # (h*w, D)
        out = table.new_zeros(B, N, table.shape[-1]) if out is None else out
        rows = (sizes == sizes.new_tensor([h, w])).all(dim=1)  # (B,) images on this grid
        out[rows] = table[index[rows]]
    return out


def full_grid(x: Tensor, grid_size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(coord (B, h*w, 2), sizes (B, 2)) of a whole (h, w) grid for each image of x: an image tensor's
    patches as a patch dict sees them (``naflex_rule``: the tensor path takes the patch-dict positions)."""
    h, w = grid_size
    rows, cols = torch.meshgrid(torch.arange(h, device=x.device), torch.arange(w, device=x.device), indexing="ij")
    coord = torch.stack([rows.flatten(), cols.flatten()], dim=1)[None].expand(x.shape[0], -1, -1)  # (B, h*w, 2)
    return coord, coord.new_tensor([[h, w]]).expand(x.shape[0], 2)


def _add_to_naflex_patches(x: Tensor, pe: Tensor) -> Tensor:
    """Add per-token positions pe (B, N, dim) to the patch tokens of x (B, P + N, dim)."""
    P = x.shape[1] - pe.shape[1]
    return torch.cat([x[:, :P], x[:, P:] + pe.to(x.dtype)], dim=1)


class NoPosEmbed(nn.Module):
    """No positions: the encoder is permutation-equivariant over patch tokens."""

    def forward(self, x: Tensor, grid_size: tuple[int, int]) -> Tensor:
        return x

    def forward_naflex(self, x: Tensor, coord: Tensor, sizes: Tensor) -> Tensor:
        return x


class LearnedPosEmbed(nn.Module):
    """Learned 1D table over the flattened tokens (ViT, Dosovitskiy et al. 2021).

    Holds one row per prefix token too (timm's layout with ``no_embed_class=False``), so timm
    weights map one to one. On another grid the patch rows are resampled as the 2D grid they are.
    """

    def __init__(self, dim: int, grid_size: tuple[int, int], num_prefix_tokens: int = 0, *,
                 ar_preserving: bool = True) -> None:
        super().__init__()
        self.grid_size, self.num_prefix_tokens = tuple(grid_size), num_prefix_tokens
        self.ar_preserving = ar_preserving  # the patch-dict path's resampling (module docstring)
        self.naflex_rule = False  # True: image tensors too take the patch-dict resampling (timm NaFlexVit's)
        self.weight = nn.Parameter(torch.zeros(1, num_prefix_tokens + grid_size[0] * grid_size[1], dim))
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, grid_size: tuple[int, int]) -> Tensor:
        if self.naflex_rule:
            return self.forward_naflex(x, *full_grid(x, grid_size))
        P = self.num_prefix_tokens
        patches = resample_grid(self.weight[:, P:], self.grid_size, grid_size)  # (1, h*w, dim)
        return x + torch.cat([self.weight[:, :P], patches], dim=1)

    def forward_naflex(self, x: Tensor, coord: Tensor, sizes: Tensor) -> Tensor:
        P, table = self.num_prefix_tokens, self.weight[0, self.num_prefix_tokens :]  # (H*W, dim): built grid

        def at(h: int, w: int) -> Tensor:  # timm's par: resampled by one scale for both axes, cropped
            # (bicubic, antialiased, align_corners=False: timm's pos_embed_interp_mode and defaults)
            if (h, w) == self.grid_size:
                return table
            H, W = par_size(self.grid_size, (h, w), self.ar_preserving)
            return resample_grid(table, self.grid_size, (H, W)).reshape(H, W, -1)[:h, :w].reshape(h * w, -1)

        pe = per_grid(coord, sizes, at)  # (B, N, dim)
        return x + torch.cat([self.weight[:, :P].expand(x.shape[0], -1, -1), pe], dim=1).to(x.dtype)


class SinCosPosEmbed(nn.Module):
    """A fixed table ``table_fn(h, w, dim) -> (h*w, dim)`` added to the patches; prefix tokens get none.
    The built grid's table is a non-persistent buffer; another grid's is recomputed."""

    @staticmethod
    def table_fn(h: int, w: int, dim: int) -> Tensor:
        raise NotImplementedError

    def __init__(self, dim: int, grid_size: tuple[int, int]) -> None:
        super().__init__()
        self.dim, self.grid_size = dim, tuple(grid_size)
        self.register_buffer("table", self.table_fn(*grid_size, dim)[None], persistent=False)  # (1, h*w, dim)

    def forward(self, x: Tensor, grid_size: tuple[int, int]) -> Tensor:
        table = self.table if tuple(grid_size) == self.grid_size else self.table_fn(*grid_size, self.dim)[None]
        return _add_to_patches(x, table.to(device=x.device, dtype=x.dtype))

    def forward_naflex(self, x: Tensor, coord: Tensor, sizes: Tensor) -> Tensor:
        # a fixed table needs no grid but each image's own: computed at that grid, read per token
        table = per_grid(coord, sizes, lambda h, w: self.table_fn(h, w, self.dim).to(x.device))
        return _add_to_naflex_patches(x, table)


class SinCos1DPosEmbed(SinCosPosEmbed):
    """Fixed 1D sinusoid over the flattened patch sequence (row-major)."""

    @staticmethod
    def table_fn(h: int, w: int, dim: int) -> Tensor:
        return sincos_1d(h * w, dim)


class SinCos2DPosEmbed(SinCosPosEmbed):
    """Fixed factorized 2D sinusoid."""

    table_fn = staticmethod(sincos_2d)


class Learned2DPosEmbed(nn.Module):
    """Factorized learned table: pe[i, j] = row[i] + col[j] (h + w rows instead of h * w).

    Additive rather than concatenated halves, so each axis can use every channel.
    """

    def __init__(self, dim: int, grid_size: tuple[int, int], *, ar_preserving: bool = True) -> None:
        super().__init__()
        self.grid_size = tuple(grid_size)
        self.ar_preserving = ar_preserving  # the patch-dict path's resampling (module docstring)
        self.naflex_rule = False  # True: image tensors too take the patch-dict resampling (timm NaFlexVit's)
        self.row = nn.Parameter(torch.zeros(grid_size[0], dim))
        self.col = nn.Parameter(torch.zeros(grid_size[1], dim))
        nn.init.trunc_normal_(self.row, std=0.02)
        nn.init.trunc_normal_(self.col, std=0.02)

    @staticmethod
    def _resample(axis: Tensor, n: int) -> Tensor:
        if axis.shape[0] == n:
            return axis
        t = axis.T[None, :, :, None].float()  # (1, dim, L, 1): a 1-pixel-wide image for bicubic
        t = F.interpolate(t, size=(n, 1), mode="bicubic", align_corners=False, antialias=n < axis.shape[0])
        return t[0, :, :, 0].T.to(axis.dtype)  # (n, dim)

    def forward(self, x: Tensor, grid_size: tuple[int, int]) -> Tensor:
        if self.naflex_rule:
            return self.forward_naflex(x, *full_grid(x, grid_size))
        h, w = grid_size
        row, col = self._resample(self.row, h), self._resample(self.col, w)
        table = (row[:, None, :] + col[None, :, :]).reshape(1, h * w, -1)  # (1, h*w, dim)
        return _add_to_patches(x, table)

    @staticmethod
    def _resample_linear(axis: Tensor, n: int) -> Tensor:
        """timm's factorized NaFlex resampling: linear, align_corners=False, no antialias."""
        if axis.shape[0] == n:
            return axis
        t = F.interpolate(axis.T[None].float(), size=n, mode="linear", align_corners=False)  # (1, dim, n)
        return t[0].T.to(axis.dtype)  # (n, dim)

    def forward_naflex(self, x: Tensor, coord: Tensor, sizes: Tensor) -> Tensor:
        def at(h: int, w: int) -> Tensor:  # timm's parfac: both axes resampled by one scale, then cropped
            H, W = par_size(self.grid_size, (h, w), self.ar_preserving)
            row, col = self._resample_linear(self.row, H)[:h], self._resample_linear(self.col, W)[:w]
            return (row[:, None, :] + col[None, :, :]).reshape(h * w, -1)  # (h*w, dim)

        return _add_to_naflex_patches(x, per_grid(coord, sizes, at))


class RoPE2D(nn.Module):
    """2D rotary embedding: adds nothing to the tokens; attention rotates q and k with ``phases``."""

    def __init__(self, head_dim: int, num_prefix_tokens: int = 0, base: float = 10000.0, *, coords: str = "index",
                 ref_grid: tuple[int, int] | None = None, offset: float = 0.0) -> None:
        super().__init__()
        rope_2d(1, 1, head_dim, coords=coords)  # validate head_dim and coords now, not at the first forward
        self.head_dim, self.num_prefix_tokens, self.base = head_dim, num_prefix_tokens, base
        self.coords, self.ref_grid, self.offset = coords, None if ref_grid is None else tuple(ref_grid), offset

    def forward(self, x: Tensor, grid_size: tuple[int, int]) -> Tensor:
        return x

    def phases(self, grid_size: tuple[int, int], device=None) -> tuple[Tensor, Tensor]:
        return rope_2d(*grid_size, self.head_dim, base=self.base, num_prefix_tokens=self.num_prefix_tokens,
                       coords=self.coords, ref_grid=self.ref_grid, offset=self.offset, device=device)

    def forward_naflex(self, x: Tensor, coord: Tensor, sizes: Tensor) -> Tensor:
        return x

    def phases_naflex(self, coord: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token phases (cos, sin), each (B, 1, P + N, head_dim), for patches at ``coord``
        (B, N, 2): the rows of one grid covering the whole batch (a phase depends on (row, col) only)."""
        if self.coords != "index" or self.ref_grid is not None or self.offset:  # phases that depend on each image's grid size
            raise ValueError(f"rope_coords={self.coords!r}, rope_ref_grid={self.ref_grid}, rope_offset={self.offset}: "
                             "NaFlex patch dicts take rope_coords='index' without rope_ref_grid or rope_offset")
        P = self.num_prefix_tokens
        H, W = sizes.amax(dim=0).tolist()
        cos, sin = self.phases((H, W), device=coord.device)  # (P + H*W, head_dim)
        prefix = torch.arange(P, device=coord.device).expand(coord.shape[0], P)
        index = torch.cat([prefix, P + coord[..., 0] * W + coord[..., 1]], dim=1)  # (B, P + N)
        return cos[index][:, None], sin[index][:, None]


def _add_to_patches(x: Tensor, table: Tensor) -> Tensor:
    """Add a (1, h*w, dim) table to the patch tokens of x (B, P + h*w, dim), leaving prefixes."""
    P = x.shape[1] - table.shape[1]
    return torch.cat([x[:, :P], x[:, P:] + table], dim=1)


def build_pos_embed(kind: str, *, dim: int, grid_size: tuple[int, int], num_heads: int,
                    num_prefix_tokens: int = 0, rope: dict | None = None) -> nn.Module:
    """The positional-encoding module for ``kind`` (one of ``POS_EMBED_KINDS``); ``rope``: RoPE2D's
    keyword arguments (base, coords, ref_grid) for ``rope2d``."""
    grid_size = tuple(grid_size)
    if kind == "none":
        return NoPosEmbed()
    if kind == "learned":
        return LearnedPosEmbed(dim, grid_size, num_prefix_tokens)
    if kind == "sincos1d":
        return SinCos1DPosEmbed(dim, grid_size)
    if kind == "sincos2d":
        return SinCos2DPosEmbed(dim, grid_size)
    if kind == "learned2d":
        return Learned2DPosEmbed(dim, grid_size)
    if kind == "rope2d":
        return RoPE2D(dim // num_heads, num_prefix_tokens, **(rope or {}))
    raise ValueError(f"unknown pos_embed={kind!r}; valid choices: {', '.join(POS_EMBED_KINDS)}")
