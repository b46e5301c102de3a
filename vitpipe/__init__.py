"""vitpipe: a Vision Transformer training pipeline."""

from vitpipe.models import ViT, create_model, list_models

__all__ = ["ViT", "create_model", "list_models"]
__version__ = "0.1.0"
