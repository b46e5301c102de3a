"""The standard path: per-image torchvision.transforms.v2 pipelines (PIL or uint8 in, float out).

Order matches the fast path (``vitpipe.data.fast``) so both give the same eval tensors:
crop/flip/RandAugment on uint8 pixels, then ToDtype -> Resize -> Normalize -> grayscale to RGB.
Resizing after the float conversion (with ``antialias`` as the caller sets) is what makes the two
paths agree to float precision even when the model size differs from the data's.
"""

from collections.abc import Sequence

import torch
from timm.data.auto_augment import rand_augment_transform
from timm.data.constants import DEFAULT_CROP_PCT
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

from vitpipe.data.erasing import timm_random_erasing

# ``augment="mae"``: MAE pre-training's augmentation (He et al. 2022, main_pretrain.py): RandomResizedCrop
# at area scale 0.2-1 and a horizontal flip, nothing else; masking is the real regulariser
MAE_AUGMENT = "mae"
MAE_CROP_SCALE = (0.2, 1.0)


class TransformedSubset(Dataset):
    """``base[indices[i]]`` through a per-image transform: one loaded data set serves train and val."""

    def __init__(self, base: Dataset, indices: Tensor | None, transform):
        self.base, self.indices, self.transform = base, indices, transform

    def __len__(self) -> int:
        return len(self.base) if self.indices is None else len(self.indices)

    def __getitem__(self, i: int):
        image, label = self.base[i if self.indices is None else int(self.indices[i])]
        return self.transform(image), int(label)


def standard_transform(
    *,
    train: bool,
    native_size: tuple[int, int] | None,
    img_size: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    channels: int,
    in_chans: int,
    augment: bool | str = True,
    crop_padding: int = 4,
    hflip: bool = True,
    auto_augment: str | None = None,
    antialias: bool = False,
    random_erasing: float = 0.0,
) -> v2.Compose:
    """Build the per-image pipeline for one split.

    native_size None means images of varying size (an image folder): then the ImageNet recipe
    replaces crop-with-padding, RandomResizedCrop for training (Szegedy et al. 2015, "Going
    deeper with convolutions") and resize-then-centre-crop at timm's crop_pct for eval.
    auto_augment is a timm RandAugment string such as ``"rand-m9-n2-mstd0.5"`` (Cubuk et al. 2020).
    random_erasing: the probability of timm's RandomErasing (mode pixel), last, on the model input.
    augment ``"mae"`` (training): RandomResizedCrop(scale 0.2-1) to ``img_size`` + the flip of ``hflip``,
    the fast path's op (bilinear, on float pixels) and nothing else; evaluation as for ``augment=True``.
    """
    if train and augment == MAE_AUGMENT:
        ops = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
               v2.RandomResizedCrop(list(img_size), scale=MAE_CROP_SCALE, antialias=False)]
        if hflip:
            ops.append(v2.RandomHorizontalFlip())
        ops.append(v2.Normalize(list(mean), list(std)))
        if in_chans != channels:
            ops.append(v2.RGB())
        return v2.Compose(ops)
    ops: list = []
    if native_size is None:
        if train and augment:
            ops.append(v2.RandomResizedCrop(list(img_size)))
        else:
            # Resize the shorter side so the centre crop keeps crop_pct of it (timm convention).
            ops += [v2.Resize(int(min(img_size) / DEFAULT_CROP_PCT)), v2.CenterCrop(list(img_size))]
    elif train and augment and crop_padding > 0:
        ops.append(v2.RandomCrop(list(native_size), padding=crop_padding))
    if train and augment:
        if hflip:
            ops.append(v2.RandomHorizontalFlip())
        if auto_augment:
            size = native_size or img_size
            hparams = dict(
                translate_const=int(min(size) * 0.45),  # timm's create_transform default
                img_mean=tuple(round(255 * m) for m in mean),  # fill for rotate/shear/translate
            )
            ops += [v2.ToPILImage(), rand_augment_transform(auto_augment, hparams)]
    ops += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    if native_size is not None and tuple(native_size) != tuple(img_size):
        ops.append(v2.Resize(list(img_size), interpolation=v2.InterpolationMode.BILINEAR, antialias=antialias))
    ops.append(v2.Normalize(list(mean), list(std)))
    if in_chans != channels:  # only 1 -> 3 gets here (checked by the DataModule)
        ops.append(v2.RGB())
    if train and augment and random_erasing > 0:
        ops.append(timm_random_erasing(random_erasing))  # on the model input, as the fast path does
    return v2.Compose(ops)
