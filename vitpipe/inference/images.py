"""The image files a prediction reads: ``images=`` -> files -> decoded, transformed items -> batches on a device.

A file that does not decode never raises here: it comes back with the reason, so predict can name it
and go on (the count is printed at the end).
"""

from __future__ import annotations

import glob
from pathlib import Path

import torch
from torch.utils.data import Dataset

from vitpipe.data.images import is_image_file, open_image
from vitpipe.data.preprocess import Preprocess
from vitpipe.errors import ConfigError


def find_images(spec: str) -> tuple[list[Path], int]:
    """The files ``images=`` names: a folder (its image files, recursively), one file, or a glob pattern.

    Returns (files sorted by path, how many files in the folder/glob were passed over as not images
    by their extension). A file named on its own is always tried.
    """
    spec = str(spec)
    path = Path(spec)
    if path.is_file():
        return [path], 0
    if path.is_dir():
        candidates = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    elif glob.has_magic(spec):
        candidates = [Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file()]
    else:
        raise ConfigError(f"images={spec}: no such file or folder; pass a folder, an image file or a glob like 'dir/*.jpg'")
    files = sorted(p for p in candidates if is_image_file(p))  # the image folders' rule (vitpipe.data.images)
    if not files:
        raise ConfigError(f"images={spec} holds no image files (of {len(candidates)} file(s)); "
                          "pass a folder, an image file or a glob of images")
    return files, len(candidates) - len(files)


class ImageFiles(Dataset):
    """``(index, tensor (C, H, W) or None, why it failed or None)`` per file: a bad file never raises."""

    def __init__(self, files: list[Path], preprocess: Preprocess) -> None:
        self.files, self.preprocess = files, preprocess

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        try:
            return i, self.preprocess(open_image(self.files[i], self.preprocess.spec.mode)), None
        except Exception as err:  # PIL raises many types for broken files
            return i, None, (str(err).splitlines() or [type(err).__name__])[0]


class Collate:
    """Good items stacked with ``stack`` (``torch.stack`` for images, ``pad_batch`` for NaFlex patch dicts);
    bad ones listed. A class, not a closure, so DataLoader workers can pickle it."""

    def __init__(self, stack=torch.stack) -> None:
        self.stack = stack

    def __call__(self, items):
        ok = [(i, x) for i, x, _ in items if x is not None]
        bad = [(i, why) for i, x, why in items if x is None]
        x = self.stack([x for _, x in ok]) if ok else None  # (B, C, H, W) or a padded patch dict
        return [i for i, _ in ok], x, bad


def to_device(x, device):
    """A tensor or a patch dict of tensors on ``device``."""
    return {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)


def batch_len(x) -> int:
    return len(x["patches"]) if isinstance(x, dict) else x.shape[0]
