"""vitpipe: a Vision Transformer training pipeline."""

from vitpipe.config import build, launcher  # noqa: F401  (build registers ${auto_precision:} at import)
from vitpipe.models import ViT, create_model, list_models, registry
from vitpipe.run import dirs
from vitpipe.run.checkpoint import load_run  # a stored run's module and data module (Trainer.test)

dirs.register_resolvers()  # ${cwd:} and ${unique_dir:...} of conf/paths and conf/hydra, for every script
launcher.register_resolvers()  # ${slurm_tasks:...} etc. of conf/hydra/launcher/slurm.yaml
registry.register_resolvers()  # ${variant:<name>,<key>} of conf/model/vit.yaml (the variant table)

__all__ = ["ViT", "create_model", "list_models", "load_run"]
__version__ = "0.1.0"
