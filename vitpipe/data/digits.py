"""scikit-learn's 8x8 handwritten digits: the embedded default data set (ships with sklearn, offline).

1797 images of 10 classes (UCI optdigits test set). There is no official test split, so a
stratified 20% is held out with a FIXED seed (not ``data.seed``): every run tests on the same
360 images, whatever seed it trains with.
"""

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.data.fast import TensorImageDataset

# mean/std of all 1797 images after the uint8 mapping below (tests/test_data.py recomputes them).
DIGITS = DatasetInfo(
    name="digits", num_classes=10, channels=1, native_size=(8, 8), mean=(0.3053,), std=(0.3759,),
    class_names=tuple(str(d) for d in range(10)),
)  # fmt: skip
TEST_FRACTION = 0.2
TEST_SPLIT_SEED = 0


class DigitsDataModule(ClassificationDataModule):
    """sklearn digits. Defaults differ from the base: no horizontal flip (a flipped digit is
    another glyph), crop padding 1 (4 would shift an 8-pixel digit half out of view).
    Other keyword args: see ClassificationDataModule."""

    def __init__(self, *, hflip: bool = False, crop_padding: int = 1, **kwargs):
        super().__init__(info=DIGITS, hflip=hflip, crop_padding=crop_padding, **kwargs)
        self._splits: dict[str, TensorImageDataset] | None = None

    def _load(self, split: str) -> TensorImageDataset | None:
        if self._splits is None:
            digits = load_digits()
            # Pixel values 0..16 -> 0..255 so every data set enters the pipeline as uint8.
            images = torch.from_numpy(np.rint(digits.images * (255 / 16)).astype(np.uint8))[:, None]  # (N, 1, 8, 8)
            labels = torch.from_numpy(digits.target.astype(np.int64))
            train_idx, test_idx = train_test_split(
                np.arange(len(labels)), test_size=TEST_FRACTION, stratify=digits.target, random_state=TEST_SPLIT_SEED
            )
            self._splits = {
                name: TensorImageDataset(images[idx], labels[idx])
                for name, idx in (("train", torch.from_numpy(train_idx)), ("test", torch.from_numpy(test_idx)))
            }
        return self._splits[split]
