"""MAE pre-training (``module=mae``): the encoder learns to reconstruct masked patches (He et al. 2022);
labels are ignored, nothing is classified, and the run's product is an encoder to fine-tune."""

from vitpipe.kinds.base import TaskKind


class MaskedAutoencoding(TaskKind):
    name = "mae"
    words = "MAE pre-training"
    module_target = "vitpipe.lit.mae.MAEModule"
