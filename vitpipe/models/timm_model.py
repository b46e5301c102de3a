"""Any timm model as a vitpipe network (``model=timm model.name=resnet18``), e.g. a CNN teacher.

The model is built by ``timm.create_model`` from its registry name (a name, never an import
path: a stored config stays data). Its class count and input channels come from the data, like
the ViT's; ``img_size`` is the size the data resizes images to (a CNN takes any size).
"""

from __future__ import annotations

import timm
from omegaconf import DictConfig, OmegaConf
from torch import nn

from vitpipe.errors import ConfigError, to_hw


def create_timm_model(name: str, *, num_classes: int, in_chans: int, img_size: int | list[int] = 32,
                      pretrained: bool | str | None = None, drop_rate: float = 0.0,
                      drop_path_rate: float = 0.0, kwargs: dict | None = None) -> nn.Module:
    """``timm.create_model(name, num_classes=..., in_chans=...)``; ``pretrained``: True (timm's
    weights, from the HF cache) or a ``.safetensors``/``.pth`` file; a head of another class count is
    re-initialised by timm. ``img_size`` (what the data resizes to) is kept as ``model.img_size`` for predict/export.
    ``kwargs``: more constructor arguments for timm, plain values only (e.g. ``channels: [32, 64, 128, 224]``
    for a narrower resnet10t)."""
    if not timm.is_model(name):
        raise ConfigError(f"model.name={name!r} is not a timm model; see timm.list_models(), e.g. resnet18")
    kwargs = {"drop_rate": drop_rate, **plain_kwargs(kwargs, "model.kwargs")}
    if drop_path_rate:  # only models with stochastic depth accept it
        kwargs["drop_path_rate"] = drop_path_rate
    overlay = {"file": str(pretrained)} if isinstance(pretrained, str) else None
    model = timm.create_model(name, pretrained=bool(pretrained), pretrained_cfg_overlay=overlay,
                              num_classes=num_classes, in_chans=in_chans, **kwargs)  # fmt: skip
    model.in_chans = in_chans  # timm ViTs have none; vitpipe's tools (predict, export) read both
    model.img_size = to_hw(img_size, "model.img_size")
    return model


RESERVED = {"pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "num_classes", "in_chans", "drop_rate",
            "drop_path_rate", "checkpoint_path"}


def plain_kwargs(kwargs: dict | None, where: str) -> dict:
    """Extra ``timm.create_model`` arguments from a config, checked to be plain data (numbers, strings,
    lists of them): a stored config may not hand timm a class or a callable, nor set what vitpipe sets."""
    if isinstance(kwargs, DictConfig):  # a config node handed over unconverted
        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    kwargs = dict(kwargs or {})
    if bad := sorted(set(kwargs) & RESERVED):
        raise ConfigError(f"{where} sets {bad}: vitpipe sets these itself (num_classes, in_chans from the data; "
                          "pretrained, drop_rate, drop_path_rate from model.*)")

    def plain(v) -> bool:
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (bool, int, float, str))

    for key, value in kwargs.items():
        if not plain(value):
            raise ConfigError(f"{where}.{key}={value!r}: only numbers, strings, booleans and lists of them")
        if isinstance(value, list):
            kwargs[key] = tuple(value)
    return kwargs
