"""The images visualize draws on, as the model sees them and as they are shown: a folder's files or the first
images of a data split (``Images``), the statistics the run normalised with, and a NaFlex item's picture."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor

from vitpipe.config.options import SPLITS
from vitpipe.data.fast import to_model_input
from vitpipe.data.images import open_image
from vitpipe.errors import ConfigError
from vitpipe.viz.overlay import unnormalize

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass
class Images:
    """What gets visualised: model inputs, their display form, names, and labels where known."""

    x: Tensor  # (B, in_chans, H, W) normalised model input
    display: Tensor  # (B, channels, H, W) in [0, 1]
    names: list[str]
    labels: list[str] | None = None


def data_stats(dm, encoder) -> tuple[tuple[float, ...], tuple[float, ...], int]:
    """(mean, std, channels) the checkpoint's data normalised with."""
    channels = int(getattr(dm, "channels", encoder.in_chans))
    mean, std = getattr(dm, "mean", None), getattr(dm, "std", None)
    if mean is None or std is None:  # caption data sets: ImageNet statistics (1 channel: their average)
        mean, std = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
        if channels == 1:
            mean, std = (sum(mean) / 3,), (sum(std) / 3,)
    return tuple(mean), tuple(std), channels


def folder_images(folder: Path, num_images: int | None, *, encoder, mean, std, channels: int) -> Images:
    """Images of a folder (sorted by name), resized whole to the model's img_size and normalised."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ConfigError(
            f"images={folder} holds no images ({', '.join(IMAGE_SUFFIXES)}); "
            f"pass a folder of images or a data split: {list(SPLITS)}"
        )
    files = files[:num_images]
    xs = []
    for f in files:
        try:
            # open_image: 16-bit files scaled to 8 bits (a plain convert() clips them to white)
            pixels = np.asarray(open_image(f, "L" if channels == 1 else "RGB"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read image {f}: {e}; remove it or pass another folder") from None
        x = torch.from_numpy(pixels.copy())
        x = x[None] if x.dim() == 2 else x.permute(2, 0, 1)  # (C, h, w) uint8
        # antialias: photos are usually larger than the model's input, and plain bilinear aliases when shrinking
        xs.append(to_model_input(x[None], img_size=tuple(encoder.img_size), mean=mean, std=std,
                                 out_chans=encoder.in_chans, antialias=True))
    x = torch.cat(xs)  # (B, in_chans, H, W)
    names = [f"{i:03d}_{f.stem}" for i, f in enumerate(files)]
    return Images(x, unnormalize(x[:, :channels], mean, std), names)


def split_images(dm, split: str, num_images: int | None, *, mean, std, channels: int) -> Images:
    """The first images of the data module's val or test split, as the model sees them in evaluation."""
    if dm is None:
        raise ConfigError(f"images={split}: the checkpoint's data module cannot be built here; pass a folder of images")
    if hasattr(dm, "check"):
        dm.check()  # files present (or a ConfigError saying how to get them)
    dm.setup({"val": "validate", "test": "test"}[split])
    loader = getattr(dm, f"{split}_dataloader")()
    xs, labels, seen = [], [], 0
    for batch in loader:
        if isinstance(batch, dict):  # captioning: images and reference captions
            x, batch_labels = batch["images"], [refs[0] for refs in batch["refs"]]
        else:
            x, y = batch
            if getattr(dm, "fast_path", False):  # uint8 on the fast path: the eval transform (no augmentation)
                x = dm.augment_batch(x, train=False)
            names = getattr(dm, "class_names", None)
            if y.ndim == 2:  # multi-label: the true label set
                batch_labels = [";".join(names[c] if names else str(c) for c in row.nonzero()[:, 0].tolist()) for row in y]
            else:
                batch_labels = [names[i] if names else str(i) for i in y.tolist()]
        xs.append(x)
        labels += batch_labels
        seen += len(x)
        if num_images is not None and seen >= num_images:
            break
    if not xs:
        raise ConfigError(f"images={split}: that split is empty for this data set; pass another split or a folder")
    x = torch.cat(xs)[:num_images]
    names = [f"{split}_{i:04d}" for i in range(len(x))]
    return Images(x, unnormalize(x[:, :channels], mean, std), names, labels[: len(x)])


def naflex_display(item: dict, patch_size, mean, std, channels: int) -> Tensor:
    """The image a patch dict holds, as the model saw it (its own grid, its own aspect): (channels, h*p, w*q) in [0, 1]."""
    p, q = patch_size
    h, w = (item["patch_coord"].amax(dim=0) + 1).tolist()
    C = item["patches"].shape[-1] // (p * q)
    x = item["patches"].reshape(h, w, p, q, C).permute(4, 0, 2, 1, 3).reshape(C, h * p, w * q)  # row-major patches
    return unnormalize(x[None, :channels], mean, std)[0]
