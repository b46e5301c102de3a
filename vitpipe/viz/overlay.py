"""Heatmap overlays and figures for attention maps.

Figures are built as ``matplotlib.figure.Figure`` objects, not through pyplot:
no GUI backend is needed (PNG goes through Agg), nothing global is switched,
and no figure lingers in pyplot's registry. Jupyter still displays a returned
Figure inline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from torch import Tensor

from vitpipe.errors import ConfigError
from vitpipe.run.files import atomic_write, save_figure  # noqa: F401 (save_figure is public here: vitpipe.viz)


def unnormalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Undo ``Normalize(mean, std)``: (C, H, W) or (B, C, H, W) -> same shape, clamped to [0, 1]."""
    mean_t = torch.as_tensor(mean, dtype=images.dtype, device=images.device).reshape(-1, 1, 1)  # (C, 1, 1)
    std_t = torch.as_tensor(std, dtype=images.dtype, device=images.device).reshape(-1, 1, 1)
    if mean_t.shape[0] != images.shape[-3] or std_t.shape[0] != images.shape[-3]:
        raise ConfigError(
            f"mean/std have {mean_t.shape[0]}/{std_t.shape[0]} entries but the images have {images.shape[-3]} channels"
        )
    return (images * std_t + mean_t).clamp(0.0, 1.0)


def to_numpy_image(image) -> np.ndarray:
    """A displayable (H, W, 3) float array in [0, 1].

    Accepts a torch (C, H, W) / (H, W) tensor (float in [0, 1] or uint8), a PIL
    image, or a numpy (H, W, C) / (H, W) array (float in [0, 1] or uint8).
    """
    if isinstance(image, Tensor):
        image = image.detach().cpu()
        if image.dim() == 3:
            image = image.permute(1, 2, 0)  # (C, H, W) -> (H, W, C)
        array = image.numpy()
    else:
        array = np.asarray(image)  # PIL images convert to (H, W[, C]) uint8
    if array.dtype == np.uint8:
        array = array.astype(np.float32) / 255.0
    array = np.clip(array.astype(np.float32), 0.0, 1.0)
    if array.ndim == 2:
        array = array[..., None]  # (H, W, 1)
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        raise ConfigError(
            f"image of shape {array.shape} is not an image; use (C, H, W) tensors "
            "or (H, W, C) arrays with 1, 3 or 4 channels"
        )
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)  # grayscale -> RGB
    return array[..., :3]  # drop alpha


def upsample_heatmap(heatmap, size: tuple[int, int]) -> np.ndarray:
    """(h, w) map -> (H, W) float array in [0, 1]: bilinear upsampling, then min-max normalisation.

    A constant map becomes all zeros (nothing stands out).
    """
    heat = torch.as_tensor(np.asarray(heatmap.detach().cpu() if isinstance(heatmap, Tensor) else heatmap))
    if heat.dim() != 2:
        raise ConfigError(f"heatmap must be (h, w), got shape {tuple(heat.shape)}")
    heat = heat.float()[None, None]  # (1, 1, h, w)
    heat = F.interpolate(heat, size=tuple(size), mode="bilinear", align_corners=False)[0, 0]  # (H, W)
    low, high = heat.min(), heat.max()
    heat = (heat - low) / (high - low) if high > low else torch.zeros_like(heat)
    return heat.numpy()


def overlay(image, heatmap, *, alpha: float = 0.5, cmap: str = "jet", ax: Axes | None = None) -> np.ndarray:
    """Blend a colour-mapped heatmap over an image.

    image: see ``to_numpy_image``; heatmap: (h, w), upsampled to the image size.
    Returns the blended (H, W, 3) float array in [0, 1]; when ``ax`` is given it
    is also drawn there (axis ticks off).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha={alpha!r} is not valid; use a number in [0, 1]")
    if cmap not in colormaps:
        raise ConfigError(f"cmap={cmap!r} is not a matplotlib colormap; e.g. 'jet', 'viridis', 'inferno'")
    rgb = to_numpy_image(image)  # (H, W, 3)
    heat = upsample_heatmap(heatmap, rgb.shape[:2])  # (H, W)
    colored = colormaps[cmap](heat)[..., :3]  # (H, W, 3)
    blended = (1.0 - alpha) * rgb + alpha * colored
    if ax is not None:
        ax.imshow(blended)
        ax.set_axis_off()
    return blended


def overlay_grid(
    images,
    heatmaps,
    titles: Sequence[str] | None = None,
    *,
    ncols: int = 4,
    alpha: float = 0.5,
    cmap: str = "jet",
    panel_size: float = 2.5,
    side_by_side: bool = False,
) -> Figure:
    """A figure with one overlay per image (``ncols`` per row).

    images: (B, C, H, W) tensor or a list of images (any ``to_numpy_image`` input);
    heatmaps: (B, h, w) tensor or a list of (h, w) maps; titles: one per image.
    side_by_side: each image is drawn beside its overlay (two panels per entry, the title over the pair),
    so the object stays visible under the map.
    """
    images, heatmaps = list(images), list(heatmaps)
    if len(images) != len(heatmaps):
        raise ConfigError(f"{len(images)} images but {len(heatmaps)} heatmaps; give one heatmap per image")
    if titles is not None and len(titles) != len(images):
        raise ConfigError(f"{len(titles)} titles for {len(images)} images; give one title per image or None")
    if len(images) == 0:
        raise ConfigError("overlay_grid needs at least one image")
    ncols = max(1, min(ncols, len(images)))
    nrows = math.ceil(len(images) / ncols)
    if side_by_side:
        return _pairs_grid(images, heatmaps, titles, ncols=ncols, nrows=nrows, alpha=alpha, cmap=cmap,
                           panel_size=panel_size)
    fig = Figure(figsize=(panel_size * ncols, panel_size * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for i, ax in enumerate(axes):
        if i >= len(images):
            ax.set_axis_off()  # empty panels in the last row
            continue
        overlay(images[i], heatmaps[i], alpha=alpha, cmap=cmap, ax=ax)
        if titles is not None:
            ax.set_title(str(titles[i]), fontsize=9)
    return fig


def _pairs_grid(images, heatmaps, titles, *, ncols, nrows, alpha, cmap, panel_size) -> Figure:
    """``overlay_grid(side_by_side=True)``: one subfigure per entry holding the image and its overlay."""
    fig = Figure(figsize=(2 * panel_size * ncols, panel_size * nrows + 0.25 * nrows), layout="constrained")
    subfigs = fig.subfigures(nrows, ncols, squeeze=False).ravel()
    for i, sub in enumerate(subfigs):
        if i >= len(images):
            continue
        left, right = sub.subplots(1, 2)
        left.imshow(to_numpy_image(images[i]))
        left.set_axis_off()
        overlay(images[i], heatmaps[i], alpha=alpha, cmap=cmap, ax=right)
        if titles is not None:
            sub.suptitle(str(titles[i]), fontsize=9)
    return fig


def save_overlay(image, heatmap, path, *, alpha: float = 0.5, cmap: str = "jet") -> Path:
    """Write the overlay as a PNG at the image's own pixel size (no axes, no margins)."""
    from PIL import Image

    blended = overlay(image, heatmap, alpha=alpha, cmap=cmap)  # (H, W, 3)
    png = Image.fromarray((blended * 255.0).round().astype(np.uint8))
    path = Path(path)
    atomic_write(path, lambda f: png.save(f, format="PNG"))  # parents created; a kill leaves no half PNG
    return path
