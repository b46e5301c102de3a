"""Image files -> model input: the checkpoint's own evaluation transform, for files of any size or mode.

One rule per data path, stated once here and again, in timm's terms, in the ``pretrained_cfg`` of an
exported model (``InputSpec.timm_data_config``):

* data of one native size (digits, Fashion-MNIST, CIFAR; its fast and torchvision paths give the same
  eval tensors): the file is converted to the data's mode (``L`` or ``RGB``) and, when it has another
  size, squashed to the native size with PIL's bilinear filter (antialiased, as timm's transform does);
  then the training run's eval ops follow unchanged: to float, bilinear resize native -> model size,
  normalise, grayscale repeated to RGB. A file at the native size gives exactly the eval tensor.
  timm: ``crop_mode: squash``, ``crop_pct: 1.0``.
* images of varying size (an image folder): converted to RGB, then the run's eval transform: the
  shorter side resized to ``img_size / 0.875``, centre crop (timm: ``crop_mode: center``, ``crop_pct: 0.875``).
* captioning data: the data module's own transform (COCO: bicubic squash), or for procedural shapes a
  bilinear squash to ``img_size``; ImageNet statistics.

Files are opened with ``vitpipe.data.images.open_image`` (any PIL mode; 16-bit grayscale scaled to 8 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image
from timm.data.constants import DEFAULT_CROP_PCT, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor
from torchvision.transforms.v2 import functional as TF

from vitpipe.data.fast import to_model_input
from vitpipe.errors import ConfigError


@dataclass(frozen=True)
class InputSpec:
    """How the checkpoint's data turned images into model input (see the module docstring)."""

    mode: str  # PIL mode files are converted to: "L" or "RGB"
    img_size: tuple[int, int]  # model input (H, W)
    in_chans: int
    mean: tuple[float, ...]  # per model input channel
    std: tuple[float, ...]
    crop_mode: str  # "squash" | "center"
    crop_pct: float
    interpolation: str  # "bilinear" | "bicubic"

    def timm_data_config(self) -> dict:
        """The same rule as timm ``pretrained_cfg`` fields (``resolve_data_config`` reads them back)."""
        return dict(input_size=(self.in_chans, *self.img_size), mean=self.mean, std=self.std,
                    interpolation=self.interpolation, crop_pct=self.crop_pct, crop_mode=self.crop_mode)


class Preprocess:
    """``Preprocess(dm, encoder)(PIL image of any mode and size) -> (in_chans, H, W) float`` tensor.

    dm: the checkpoint's data module (constructed, not set up: no data file is read);
    encoder: the network's ViT (``net`` or a captioner's ``net.encoder``), for img_size/in_chans.
    """

    def __init__(self, dm, encoder) -> None:
        from vitpipe.data.base import ClassificationDataModule
        from vitpipe.data.captions.base import CaptionDataModule

        if dm is None:
            raise ConfigError("the checkpoint's data module cannot be built here (the warning above says why), and "
                              "its eval transform depends on it; run where its data config builds")
        in_chans = int(encoder.in_chans)
        img_size = tuple(int(s) for s in encoder.img_size)
        self.native_size, self._transform = None, None
        if isinstance(dm, ClassificationDataModule):
            channels, mean, std = dm.channels, tuple(dm.mean), tuple(dm.std)
            self.antialias = bool(dm.antialias)
            if dm.native_size is None:  # an image folder: the run's eval transform takes any size
                self._transform = dm.transform(train=False)
                crop_mode, crop_pct = "center", DEFAULT_CROP_PCT
            else:
                self.native_size = tuple(dm.native_size)
                crop_mode, crop_pct = "squash", 1.0
            interpolation = "bilinear"
        elif isinstance(dm, CaptionDataModule):
            channels = in_chans
            mean, std = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
            if channels == 1:
                mean, std = (sum(mean) / 3,), (sum(std) / 3,)
            self._transform = getattr(dm, "transform", None)  # COCO's; shapes has none: squash below
            self.native_size, self.antialias = img_size, True
            crop_mode, crop_pct = "squash", 1.0
            interpolation = "bicubic" if self._transform is not None else "bilinear"
        else:
            raise ConfigError(f"the checkpoint's data module {type(dm).__name__} has no image transform predict "
                              "knows; supported: the classification data sets and captioning data")
        if channels not in (1, 3) or in_chans not in (channels, 3):
            raise ConfigError(f"cannot feed {channels}-channel data to a model with in_chans={in_chans}")
        self.channels = channels
        repeat = in_chans // channels  # grayscale data, RGB model: each channel normalised alike
        self.spec = InputSpec(mode="L" if channels == 1 else "RGB", img_size=img_size, in_chans=in_chans,
                              mean=tuple(float(m) for m in mean) * repeat, std=tuple(float(s) for s in std) * repeat,
                              crop_mode=crop_mode, crop_pct=float(crop_pct), interpolation=interpolation)
        self._mean, self._std = tuple(mean), tuple(std)

    def __call__(self, image: Image.Image) -> Tensor:
        image = image.convert(self.spec.mode)
        if self._transform is not None:
            x = self._transform(image)  # (channels, H, W) float, normalised
            return x.expand(self.spec.in_chans, -1, -1).contiguous() if x.shape[0] != self.spec.in_chans else x
        h, w = self.native_size
        if image.size != (w, h):
            image = image.resize((w, h), Image.Resampling.BILINEAR)  # PIL: antialiased when shrinking
        x = TF.pil_to_tensor(image)  # (channels, h, w) uint8
        return to_model_input(x[None], img_size=self.spec.img_size, mean=self._mean, std=self._std,
                              out_chans=self.spec.in_chans, antialias=self.antialias)[0]
