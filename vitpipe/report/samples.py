"""What one test sample is, from a data set and its index: file path, label, displayable image.

The data modules wrap their loaded splits (a uint8 tensor data set on the fast path; a transformed
subset over a torchvision data set on the standard path). These helpers look through the wrappers
by duck typing (``base``/``indices``, ``dataset``/``indices``) to the loaded images, so the report
shows images as they are on disk, before normalisation, and names their files.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset


def _unwrap(ds: Dataset, i: int) -> tuple[Dataset, int]:
    """Follow subset wrappers down to the loaded data set and the index there."""
    for _ in range(8):  # wrappers nest at most a few levels
        inner = getattr(ds, "base", None)
        if inner is None:
            inner = getattr(ds, "dataset", None)
        if inner is None:
            break
        indices = getattr(ds, "indices", None)
        i = i if indices is None else int(indices[i])
        ds = inner
    return ds, i


def sample_path(ds: Dataset, i: int) -> str | None:
    """The file of sample ``i`` (torchvision ImageFolder's ``samples``), or None (in-memory data)."""
    base, j = _unwrap(ds, i)
    samples = getattr(base, "samples", None) or getattr(base, "imgs", None)
    return str(samples[j][0]) if samples is not None else None


def dataset_targets(ds: Dataset, indices) -> torch.Tensor | None:
    """Labels of ``indices`` read without loading images, or None when the data set cannot say."""
    out = []
    for i in indices:
        base, j = _unwrap(ds, int(i))
        labels = getattr(base, "labels", None)
        if labels is None:
            labels = getattr(base, "targets", None)
        if labels is None:
            return None
        out.append(int(labels[j]))
    return torch.tensor(out, dtype=torch.long)


def sample_image(ds: Dataset, i: int) -> np.ndarray | None:
    """Sample ``i`` as stored, before normalisation: uint8 (H, W, 3) or (H, W); None if unknown."""
    base, j = _unwrap(ds, i)
    images = getattr(base, "images", None)
    item = images[j] if isinstance(images, torch.Tensor) else base[j][0]
    if isinstance(item, Image.Image):
        return np.asarray(item.convert("RGB"))
    if isinstance(item, torch.Tensor) and item.dtype == torch.uint8 and item.ndim == 3:  # (C, H, W)
        arr = item.permute(1, 2, 0).numpy()
        return arr[..., 0] if arr.shape[-1] == 1 else arr[..., :3]
    return None  # e.g. already-normalised floats: nothing faithful to show
