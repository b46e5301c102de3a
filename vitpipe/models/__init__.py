from vitpipe.models.captioner import Captioner
from vitpipe.models.mae import MaskedAutoencoderViT, load_official
from vitpipe.models.registry import MAE_VARIANTS, VARIANTS, create_mae, create_model, list_mae_models, list_models
from vitpipe.models.vit import ViT

__all__ = ["MAE_VARIANTS", "VARIANTS", "Captioner", "MaskedAutoencoderViT", "ViT", "create_mae", "create_model",
           "list_mae_models", "list_models", "load_official"]
