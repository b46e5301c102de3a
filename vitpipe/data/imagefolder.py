"""The user's own images: ``root/train/<class>/*.jpg`` and optional ``root/val/``, ``root/test/``.

torchvision's ImageFolder lists them; ``vitpipe.data.images`` reads them (16-bit PNGs scaled to
8 bits, not clipped). Every image is fully decoded before training (cached, so only new files cost
time on the next run): a broken one stops the run in setup() naming the file, or is left out with
a counted warning (``on_bad_image``). Files without an image extension are left out with a count.
Without val/, the validation split comes from train/ (``val_split``); without test/, testing
falls back to the validation split (with a warning).
"""

import os

from lightning.pytorch.utilities import rank_zero_warn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.data.images import find_bad_images, open_image
from vitpipe.errors import ConfigError

ON_BAD_IMAGE = ("error", "skip")


def _class_dirs(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


class _Folder(ImageFolder):
    """ImageFolder whose classes are the visible subfolders (``.ipynb_checkpoints`` is no class)."""

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        classes = _class_dirs(directory)
        return classes, {c: i for i, c in enumerate(classes)}


def _load_image(path: str):
    """The training-time loader, naming the file if it fails (e.g. changed since the check)."""
    try:
        return open_image(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read image {path}: {err}") from err


class ImageFolderDataModule(ClassificationDataModule):
    """Images of any size, resized to the model's ``img_size`` (standard path only).

    on_bad_image: what to do with a file that does not decode (zero bytes, truncated, not an
    image): ``error`` stops in setup() naming the first ones, ``skip`` leaves them out with a
    counted warning. Other keyword args: see ClassificationDataModule; ``num_classes`` must
    equal the number of class folders. ImageNet statistics by default.
    """

    has_val_split = True  # root/val/, when present

    def __init__(self, *, num_classes: int, fast_path: bool = False, on_bad_image: str = "error", **kwargs):
        info = DatasetInfo(
            name="imagefolder", num_classes=None, channels=3, native_size=None,
            mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
        )  # fmt: skip
        super().__init__(info=info, num_classes=num_classes, fast_path=fast_path, **kwargs)
        if self.root is None:
            raise ConfigError("data.root is required for imagefolder (a directory with train/<class>/ folders)")
        if on_bad_image not in ON_BAD_IMAGE:
            raise ConfigError(f"data.on_bad_image={on_bad_image!r}: expected one of {', '.join(ON_BAD_IMAGE)}")
        self.on_bad_image = on_bad_image

    def check(self) -> None:
        train = os.path.join(self.root, "train")
        if not os.path.isdir(train):
            raise ConfigError(f"imagefolder: {train} does not exist; put one folder of images per class there")
        classes = _class_dirs(train)
        if len(classes) != self.num_classes:
            raise ConfigError(
                f"data.num_classes={self.num_classes} but {train} has {len(classes)} class folders; "
                f"set data.num_classes={len(classes)}"
            )
        self.class_names = classes  # ImageFolder's order: sorted folder names
        for split in ("val", "test"):
            path = os.path.join(self.root, split)
            if os.path.isdir(path) and _class_dirs(path) != classes:
                raise ConfigError(f"imagefolder: the class folders of {path} differ from those of {train}")

    def prepare_data(self) -> None:
        """Under DDP this runs once before every rank's setup(): they then find the files decoded."""
        super().prepare_data()
        for split in ("train", "val", "test"):
            self._load(split)

    def _load(self, split: str) -> ImageFolder | None:
        path = os.path.join(self.root, split)
        if not os.path.isdir(path):
            return None
        others = []  # files ImageFolder leaves out for their extension: counted, not silent

        def is_image(file: str) -> bool:
            if has_file_allowed_extension(file, IMG_EXTENSIONS):
                return True
            others.append(file)
            return False

        try:
            ds = _Folder(path, loader=_load_image, is_valid_file=is_image)
        except FileNotFoundError as err:  # a class folder without any image
            raise ConfigError(f"imagefolder: {err}") from err
        if others:
            rank_zero_warn(f"skipped {len(others)} non-image files in {path}, e.g. {os.path.relpath(others[0], path)}")
        bad = find_bad_images([file for file, _ in ds.samples], folder=path)
        if not bad:
            return ds
        named = [f"{os.path.relpath(file, path)} ({why})" for file, why in list(bad.items())[:3]]
        if self.on_bad_image == "error":
            raise ConfigError(
                f"{len(bad)} unreadable images in {path}: {', '.join(named)}{', ...' if len(bad) > 3 else ''}; "
                "remove or replace them, or set data.on_bad_image=skip"
            )
        ds.samples = ds.imgs = [s for s in ds.samples if s[0] not in bad]
        ds.targets = [label for _, label in ds.samples]
        rank_zero_warn(f"skipped {len(bad)} unreadable images in {path}, e.g. {named[0]}")
        return ds
