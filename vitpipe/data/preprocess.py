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
* NaFlex models (the stored config's ``data.naflex.enabled`` true, ``naflex_settings``): the file is
  converted to the data's mode, scaled to [0, 1] and normalised with the data's statistics (grayscale
  repeated to RGB), then ``vitpipe.nn.naflex.patchify_image`` resizes it at its own aspect (bicubic,
  antialiased) to the largest grid of at most ``max_seq_len`` patches: no squash, no crop. The result
  is a patch dict of one image; ``Preprocess.collate`` (``pad_batch``) pads a list of them.
* captioning data: the data module's own transform (COCO: bicubic squash), or for procedural shapes a
  bilinear squash to ``img_size``; ImageNet statistics.

Files are opened with ``vitpipe.data.images.open_image`` (any PIL mode; 16-bit grayscale scaled to 8 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image
from timm.data.constants import DEFAULT_CROP_PCT, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor
from torchvision.transforms.v2 import functional as TF

from vitpipe.data.fast import to_model_input
from vitpipe.errors import ConfigError
from vitpipe.nn.naflex import grid_sizes, pad_batch, patchify_image


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
    max_seq_len: int | None = None  # NaFlex: patches per image (own aspect), else None (fixed img_size)

    def timm_data_config(self) -> dict:
        """The same rule as timm ``pretrained_cfg`` fields (``resolve_data_config`` reads them back)."""
        cfg = dict(input_size=(self.in_chans, *self.img_size), mean=self.mean, std=self.std,
                   interpolation=self.interpolation, crop_pct=self.crop_pct, crop_mode=self.crop_mode)
        if self.max_seq_len is not None:  # timm's create_transform(naflex=True, max_seq_len=...) resizes to a
            cfg.update(crop_pct=1.0, crop_mode="squash")  # sequence; max_seq_len is not a pretrained_cfg field
        return cfg


def naflex_settings(stored_config) -> dict | None:
    """The ``data.naflex`` block of a checkpoint's stored config when it is enabled, else None.

    A checkpoint trained with ``data.naflex.enabled=true`` saw images at native aspect as patch dicts
    of at most ``max_seq_len`` patches; predict, visualize and export feed it the same way."""
    data = (stored_config or {}).get("data") if isinstance(stored_config, dict) else None
    block = data.get("naflex") if isinstance(data, dict) else None
    if not isinstance(block, dict) or not block.get("enabled"):
        return None
    n = block.get("max_seq_len")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"the checkpoint's data.naflex.max_seq_len={n!r} is not valid; it must be an int >= 1")
    return dict(block)


def hflip_patches(batch: dict, patch_size) -> dict:
    """The patch dict of the mirrored images: each image flipped on its own grid (column c -> w_i - 1 - c)
    and every patch flipped along its width (timm's (p, q, C) order). Padding stays as it is."""
    p, q = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
    patches, coord, valid = batch["patches"], batch["patch_coord"], batch["patch_valid"]
    B, N, D = patches.shape
    flipped = patches.reshape(B, N, p, q, D // (p * q)).flip(3).reshape(B, N, D)  # (B, N, p*q*C)
    width = grid_sizes(coord, valid)[:, 1:2]  # (B, 1)
    cols = torch.where(valid, width - 1 - coord[..., 1], coord[..., 1])
    return {"patches": flipped, "patch_coord": torch.stack([coord[..., 0], cols], dim=-1), "patch_valid": valid}


class Preprocess:
    """``Preprocess(dm, encoder)(PIL image of any mode and size) -> (in_chans, H, W) float`` tensor,
    or with ``naflex`` (``naflex_settings`` of the checkpoint) a patch dict of the image at its own aspect.

    dm: the checkpoint's data module (constructed, not set up: no data file is read);
    encoder: the network's ViT (``net`` or a captioner's ``net.encoder``), for img_size/in_chans.
    """

    def __init__(self, dm, encoder, naflex: dict | None = None) -> None:
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
        self.max_seq_len, self.patch_size = None, tuple(int(p) for p in getattr(encoder, "patch_size", (1, 1)))
        if naflex is not None:
            if not isinstance(dm, ClassificationDataModule):
                raise ConfigError(f"data.naflex is set for {type(dm).__name__}; NaFlex prediction supports the "
                                  "classification data sets")
            stored = naflex.get("patch_size")
            stored = (stored, stored) if isinstance(stored, int) else tuple(stored) if stored else self.patch_size
            if tuple(stored) != self.patch_size:
                raise ConfigError(f"the checkpoint's data.naflex.patch_size={list(stored)} differs from its model's "
                                  f"patch_size={list(self.patch_size)}; they must be equal")
            self.max_seq_len = int(naflex["max_seq_len"])
            crop_mode, crop_pct, interpolation = "naflex", 1.0, "bicubic"
        self.spec = InputSpec(mode="L" if channels == 1 else "RGB", img_size=img_size, in_chans=in_chans,
                              mean=tuple(float(m) for m in mean) * repeat, std=tuple(float(s) for s in std) * repeat,
                              crop_mode=crop_mode, crop_pct=float(crop_pct), interpolation=interpolation,
                              max_seq_len=self.max_seq_len)
        self._mean, self._std = tuple(mean), tuple(std)

    @property
    def collate(self):
        """The batching of this rule's outputs: ``pad_batch`` (padded to the longest) for patch dicts, else ``torch.stack``."""
        return pad_batch if self.max_seq_len is not None else torch.stack

    def __call__(self, image: Image.Image) -> Tensor | dict:
        image = image.convert(self.spec.mode)
        if self.max_seq_len is not None:  # native aspect: normalised at the file's size, then patchified
            x = TF.pil_to_tensor(image)[None]  # (1, channels, H, W) uint8
            x = to_model_input(x, img_size=tuple(x.shape[-2:]), mean=self._mean, std=self._std,
                               out_chans=self.spec.in_chans)[0]  # (in_chans, H, W), no resize
            return patchify_image(x, self.patch_size, self.max_seq_len)
        if self._transform is not None:
            x = self._transform(image)  # (channels, H, W) float, normalised
            return x.expand(self.spec.in_chans, -1, -1).contiguous() if x.shape[0] != self.spec.in_chans else x
        h, w = self.native_size
        if image.size != (w, h):
            image = image.resize((w, h), Image.Resampling.BILINEAR)  # PIL: antialiased when shrinking
        x = TF.pil_to_tensor(image)  # (channels, h, w) uint8
        return to_model_input(x[None], img_size=self.spec.img_size, mean=self._mean, std=self._std,
                              out_chans=self.spec.in_chans, antialias=self.antialias)[0]
