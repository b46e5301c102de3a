"""vitpipe: a Vision Transformer training pipeline."""

from vitpipe.models import ViT, create_model, list_models
from vitpipe.rundir import register_resolvers

register_resolvers()  # ${cwd:} and ${unique_dir:...} of conf/paths and conf/hydra, for every script

__all__ = ["ViT", "create_model", "list_models"]
__version__ = "0.1.0"
