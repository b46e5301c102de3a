"""The models: the ViT, the MAE, the captioner, and the variant table that names them.

The names below are imported on first use (PEP 562), so a reader of the plain-data table
(``vitpipe.models.variants``: the configs' resolver, while a command line is checked) loads no torch."""

import importlib

__all__ = ["MAE_VARIANTS", "VARIANTS", "Captioner", "MaskedAutoencoderViT", "ViT", "create_mae", "create_model",
           "list_mae_models", "list_models", "load_official"]

_HOMES = {"Captioner": "vitpipe.models.captioner", "MaskedAutoencoderViT": "vitpipe.models.mae",
          "load_official": "vitpipe.models.mae", "ViT": "vitpipe.models.vit",
          **dict.fromkeys(("MAE_VARIANTS", "VARIANTS", "list_mae_models", "list_models"), "vitpipe.models.variants"),
          **dict.fromkeys(("create_mae", "create_model"), "vitpipe.models.registry")}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'vitpipe.models' has no attribute {name!r}")
