"""Fashion-MNIST (Xiao et al. 2017) through torchvision's FashionMNIST class.

torchvision reads the decompressed idx files in ``<root>/FashionMNIST/raw/``. When they are
missing but the Debian package ``fashion-mnist`` is installed (gz files in
/usr/share/datasets/fashion-mnist), they are decompressed from there: offline and no download.
"""

import gzip
import os
import shutil
from pathlib import Path

import torch
from torchvision.datasets import FashionMNIST

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.errors import ConfigError
from vitpipe.run.files import atomic_write

# Pixel mean/std of the 60k training images.
FASHION_MNIST = DatasetInfo(
    name="fashion_mnist", num_classes=10, channels=1, native_size=(28, 28), mean=(0.2860,), std=(0.3530,),
    class_names=tuple(FashionMNIST.classes),
)  # fmt: skip
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"


class FashionMNISTDataModule(ClassificationDataModule):
    """Fashion-MNIST, 60k/10k 28x28 grayscale images, 10 classes.

    system_dir: where a system package keeps the gz idx files (Debian's by default; None: never
    look). crop_padding defaults to 2 (a 28-pixel image). Other keyword args: see
    ClassificationDataModule.
    """

    def __init__(self, *, crop_padding: int = 2, system_dir: str | None = DEBIAN_DIR, **kwargs):
        super().__init__(info=FASHION_MNIST, crop_padding=crop_padding, **kwargs)
        if self.root is None:
            raise ConfigError("data.root is required for fashion_mnist (the directory holding FashionMNIST/raw)")
        self.system_dir = system_dir
        self.raw_dir = os.path.join(self.root, "FashionMNIST", "raw")  # torchvision's raw_folder

    def _file_names(self) -> list[str]:
        """The decompressed idx file names torchvision expects, e.g. train-images-idx3-ubyte."""
        return [os.path.basename(url).removesuffix(".gz") for url, _ in FashionMNIST.resources]

    def _missing(self) -> list[str]:
        return [n for n in self._file_names() if not os.path.isfile(os.path.join(self.raw_dir, n))]

    def _system_files_present(self) -> bool:
        return self.system_dir is not None and all(
            os.path.isfile(os.path.join(self.system_dir, n + ".gz")) for n in self._file_names()
        )

    def check(self) -> None:
        if self.download or not self._missing() or self._system_files_present():
            return
        raise ConfigError(
            f"fashion_mnist not found: {self.raw_dir} lacks {', '.join(self._missing())}. Put the idx files "
            f"there (gz from {FashionMNIST.mirrors[0]}, decompressed), install Debian's dataset-fashion-mnist package "
            f"({DEBIAN_DIR}), or set data.download=true"
        )

    def prepare_data(self) -> None:
        self._copy_system_files()
        super().prepare_data()

    def _copy_system_files(self) -> None:
        """Decompress the system package's gz files into raw_dir (idempotent, atomic per file)."""
        missing = self._missing()
        if not missing or not self._system_files_present():
            return
        os.makedirs(self.raw_dir, exist_ok=True)
        for name in missing:
            with gzip.open(os.path.join(self.system_dir, name + ".gz"), "rb") as src:  # other ranks never see half a file
                atomic_write(Path(self.raw_dir) / name, lambda dst, src=src: shutil.copyfileobj(src, dst))

    def _download(self) -> None:
        missing = self._missing()
        if not missing:
            return  # present (or decompressed from the system package by prepare_data)
        try:
            FashionMNIST(self.root, train=True, download=True)
        except Exception as err:  # offline: every mirror fails with a RuntimeError
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            raise ConfigError(
                f"fashion_mnist is missing ({self.raw_dir} lacks {', '.join(missing)}) and downloading it failed "
                f"({reason}); either run once where {FashionMNIST.mirrors[0]} is reachable (data.download=true "
                f"fetches it), or put the idx files there by hand (or install Debian's dataset-fashion-mnist)"
            ) from err

    def _load(self, split: str):
        self._copy_system_files()  # setup() without prepare_data() (tests, benchmarks)
        return FashionMNIST(self.root, train=split == "train", download=False)

    def _as_tensors(self, ds: FashionMNIST):
        return ds.data[:, None].contiguous(), ds.targets.to(torch.int64)  # (N, 28, 28) -> (N, 1, 28, 28)
