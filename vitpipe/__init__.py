"""vitpipe: a Vision Transformer training pipeline.

Importing it registers the shipped configs' resolvers and nothing heavier: torch, Lightning and timm load
with the first name that needs them (``vitpipe.ViT`` below, or a command's body), so a command line is
checked in a second (``vitpipe.tasks.cli``)."""

import importlib

from vitpipe.config import launcher, resolvers
from vitpipe.run import dirs

dirs.register_resolvers()  # ${cwd:} and ${unique_dir:...} of conf/paths and conf/hydra, for every script
launcher.register_resolvers()  # ${slurm_tasks:...} etc. of conf/hydra/launcher/slurm.yaml
resolvers.register_resolvers()  # ${auto_precision:} of conf/trainer, ${variant:<name>,<key>} of conf/model (the variant table)

__all__ = ["ViT", "create_model", "list_models", "load_run"]
__version__ = "0.1.0"

_HOMES = {"ViT": "vitpipe.models", "create_model": "vitpipe.models", "list_models": "vitpipe.models",
          "load_run": "vitpipe.run.checkpoint"}  # load_run: a stored run's module and data module (Trainer.test)


def __getattr__(name: str):
    """The public names, imported on first use (PEP 562)."""
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'vitpipe' has no attribute {name!r}")
