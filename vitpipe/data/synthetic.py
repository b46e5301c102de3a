"""Random uint8 images with random labels, of any size and count: for throughput benchmarks.

Nothing to learn here (labels are independent of pixels); deterministic from ``seed``.
"""

import numpy as np
import torch

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.data.fast import TensorImageDataset
from vitpipe.errors import ConfigError, check_int, to_hw

# Pixels uniform on {0..255}: mean 0.5, std sqrt((256^2 - 1) / 12) / 255.
UNIFORM_STD = 0.2898


class SyntheticDataModule(ClassificationDataModule):
    """``length`` training and ``test_length`` test images of ``native_size`` with ``channels``
    channels and labels in [0, num_classes). Other keyword args: see ClassificationDataModule."""

    def __init__(
        self,
        *,
        num_classes: int = 10,
        channels: int = 3,
        native_size: int | list[int] = 32,
        length: int = 1024,
        test_length: int = 256,
        **kwargs,
    ):
        if channels not in (1, 3):
            raise ConfigError(f"data.channels={channels!r}: synthetic images have 1 or 3 channels")
        check_int(length, "data.length"), check_int(test_length, "data.test_length")
        info = DatasetInfo(
            name="synthetic",
            num_classes=num_classes,
            channels=channels,
            native_size=to_hw(native_size, "data.native_size"),
            mean=(0.5,) * channels,
            std=(UNIFORM_STD,) * channels,
            class_names=tuple(f"class_{c}" for c in range(num_classes)) if isinstance(num_classes, int) else None,
        )
        super().__init__(info=info, num_classes=num_classes, channels=channels, **kwargs)
        self.length, self.test_length = length, test_length

    def _load(self, split: str) -> TensorImageDataset | None:
        n = self.length if split == "train" else self.test_length
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1])  # independent train/test streams
        images = rng.integers(0, 256, size=(n, self.channels, *self.native_size), dtype=np.uint8)
        labels = rng.integers(0, self.num_classes, size=n, dtype=np.int64)
        return TensorImageDataset(torch.from_numpy(images), torch.from_numpy(labels))
