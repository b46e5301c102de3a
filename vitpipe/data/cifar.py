"""CIFAR-10 and CIFAR-100 (Krizhevsky 2009) through torchvision's own data set classes.

One file for both: they share the on-disk format and differ only in the torchvision class
and the statistics below. Files live in ``<root>/cifar-10-batches-py`` / ``<root>/cifar-100-python``.
"""

import os

import torch
from torchvision.datasets import CIFAR10, CIFAR100

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.errors import ConfigError

# Per-channel pixel mean/std of the 50k training images.
CIFAR10_INFO = DatasetInfo(
    name="cifar10", num_classes=10, channels=3, native_size=(32, 32),
    mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
)  # fmt: skip
CIFAR100_INFO = DatasetInfo(
    name="cifar100", num_classes=100, channels=3, native_size=(32, 32),
    mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762),
)  # fmt: skip


class _CIFARDataModule(ClassificationDataModule):
    dataset_class: type[CIFAR10]  # CIFAR100 subclasses CIFAR10

    def __init__(self, *, info: DatasetInfo, **kwargs):
        super().__init__(info=info, **kwargs)
        folder = self.dataset_class.base_folder
        if self.root is None:
            raise ConfigError(f"data.root is required for {info.name} (the directory holding {folder})")
        self.folder = os.path.join(self.root, folder)

    def _missing(self) -> list[str]:
        cls = self.dataset_class
        names = [name for name, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
        return [n for n in names if not os.path.isfile(os.path.join(self.folder, n))]

    def check(self) -> None:
        if self.download:
            return
        missing = self._missing()
        if missing:
            raise ConfigError(
                f"{self.info.name} not found: {self.folder} lacks {', '.join(missing)}. Put the extracted python "
                f"version there ({self.dataset_class.url}) or set data.download=true"
            )

    def _download(self) -> None:
        missing = self._missing()
        if not missing:
            return  # present: no network, and no md5 pass over 170 MB on every start
        try:
            self.dataset_class(self.root, train=True, download=True)
        except Exception as err:  # offline: URLError, timeouts; a bad archive: RuntimeError
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            raise ConfigError(
                f"{self.info.name} is missing ({self.folder} lacks {', '.join(missing)}) and downloading it failed "
                f"({reason}); either run once where {self.dataset_class.url} is reachable (data.download=true "
                f"fetches it), or extract that archive into {self.root} by hand"
            ) from err

    def _load(self, split: str):
        try:
            ds = self.dataset_class(self.root, train=split == "train", download=False)
        except RuntimeError as err:  # torchvision's md5 check: present but corrupted or partial
            raise ConfigError(
                f"{self.info.name} files under {self.folder} are corrupted ({err}); "
                "delete them and set data.download=true, or replace them by hand"
            ) from err
        self.class_names = list(ds.classes)
        return ds

    def _as_tensors(self, ds: CIFAR10):
        images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # (N, 32, 32, 3) -> (N, 3, 32, 32)
        return images, torch.as_tensor(ds.targets, dtype=torch.int64)


class CIFAR10DataModule(_CIFARDataModule):
    """CIFAR-10: 50k/10k 32x32 RGB images, 10 classes. Keyword args: see ClassificationDataModule."""

    dataset_class = CIFAR10

    def __init__(self, **kwargs):
        super().__init__(info=CIFAR10_INFO, **kwargs)


class CIFAR100DataModule(_CIFARDataModule):
    """CIFAR-100 (fine labels): 50k/10k 32x32 RGB images, 100 classes. Keyword args: see
    ClassificationDataModule."""

    dataset_class = CIFAR100

    def __init__(self, **kwargs):
        super().__init__(info=CIFAR100_INFO, **kwargs)
