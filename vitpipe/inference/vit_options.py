"""Inference-time options of a trained run's ViT, set on every vitpipe ``ViT`` inside a module (its net, an
EMA copy, a captioner's encoder) without retraining:

- ``model_patch_size=<p>`` (eval): the patch size (FlexiViT: the kernel PI-resized, positions resampled);
- ``model_tome_r=<r>`` (eval, predict): token merging (ToMe, Bolya et al. 2023; ``vitpipe.nn.tome``), r tokens
  merged per block; ``null`` keeps the run's own ``model.tome_r``.

Each option's value is checked before anything loads (``vitpipe.config.options``); what only the model can
judge (a patch size that does not divide the image, more merges than a block has tokens) is a one-line
ConfigError here.
"""

from __future__ import annotations

from torch import nn

from vitpipe.errors import ConfigError


def set_on_vits(module: nn.Module, key: str, value: int) -> None:
    """``ViT.set_<name>(value)`` on every vitpipe ViT in ``module``, for the option ``key`` (``model_<name>``)."""
    from vitpipe.models.vit import ViT

    vits = [m for m in module.modules() if isinstance(m, ViT)]
    if not vits:
        raise ConfigError(f"{key}={value} needs a vitpipe ViT; this checkpoint's network is "
                          f"{type(getattr(module, 'net', module)).__name__}")
    setter = "set_" + key.removeprefix("model_")
    for vit in vits:
        try:
            getattr(vit, setter)(value)
        except ValueError as e:
            raise ConfigError(f"{key}={value}: {e}") from None


def set_patch_size(module: nn.Module, patch_size: int) -> None:
    set_on_vits(module, "model_patch_size", patch_size)


def set_tome_r(module: nn.Module, r: int) -> None:
    set_on_vits(module, "model_tome_r", r)
