"""The user's own images: ``root/train/<class>/*.jpg`` and optional ``root/val/``, ``root/test/``.

torchvision's ImageFolder reads them (converted to RGB). Every file is opened and verified in
setup(), so a corrupt image stops the run there with its path instead of killing a loader
worker mid-epoch. Without val/, the validation split comes from train/ (``val_split``);
without test/, testing falls back to the validation split (with a warning).
"""

import os

from PIL import Image
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import default_loader

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.errors import ConfigError


def _class_dirs(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def _load_image(path: str) -> Image.Image:
    """ImageFolder's loader, naming the file if it fails (e.g. truncated past what verify() reads)."""
    try:
        return default_loader(path)
    except OSError as err:
        raise ConfigError(f"cannot read image {path}: {err}") from err


class ImageFolderDataModule(ClassificationDataModule):
    """Images of any size, resized to the model's ``img_size`` (standard path only).

    verify_images: open and verify every file in setup() (header and, for PNG, checksums; a
    full decode would cost a whole epoch). Other keyword args: see ClassificationDataModule;
    ``num_classes`` must equal the number of class folders. ImageNet statistics by default.
    """

    def __init__(self, *, num_classes: int, fast_path: bool = False, verify_images: bool = True, **kwargs):
        info = DatasetInfo(
            name="imagefolder", num_classes=None, channels=3, native_size=None,
            mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
        )  # fmt: skip
        super().__init__(info=info, num_classes=num_classes, fast_path=fast_path, **kwargs)
        if self.root is None:
            raise ConfigError("data.root is required for imagefolder (a directory with train/<class>/ folders)")
        self.verify_images = bool(verify_images)

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

    def _load(self, split: str) -> ImageFolder | None:
        path = os.path.join(self.root, split)
        if not os.path.isdir(path):
            return None
        ds = ImageFolder(path, loader=_load_image)
        if self.verify_images:
            for file, _ in ds.samples:
                try:
                    with Image.open(file) as im:
                        im.verify()
                except Exception as err:  # PIL raises several types for a broken file
                    raise ConfigError(f"corrupt or unreadable image {file}: {err}; remove or replace it") from err
        self.class_names = list(ds.classes)
        return ds
