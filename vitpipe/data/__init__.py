"""Classification LightningDataModules: one shared base, one small file per data set."""

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.data.cifar import CIFAR10DataModule, CIFAR100DataModule
from vitpipe.data.digits import DigitsDataModule
from vitpipe.data.fashion_mnist import FashionMNISTDataModule
from vitpipe.data.imagefolder import ImageFolderDataModule
from vitpipe.data.shards import ShardsDataModule
from vitpipe.data.synthetic import SyntheticDataModule

__all__ = ["ClassificationDataModule", "DatasetInfo", "CIFAR10DataModule", "CIFAR100DataModule", "DigitsDataModule",
           "FashionMNISTDataModule", "ImageFolderDataModule", "ShardsDataModule", "SyntheticDataModule"]  # fmt: skip
