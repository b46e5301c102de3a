from vitpipe.models.captioner import Captioner
from vitpipe.models.registry import VARIANTS, create_model, list_models
from vitpipe.models.vit import ViT

__all__ = ["VARIANTS", "Captioner", "ViT", "create_model", "list_models"]
