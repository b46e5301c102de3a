"""Say which ``conf/recipe/<model>_<data>.yaml`` a run picked up, and what it set.

``train.yaml`` selects ``optional recipe: ${model}_${data}``, so ``model=vit_b16 data=cifar10``
fine-tunes for 10k steps instead of the default schedule. Each recipe file sets the top-level
``recipe`` key to its own name (train.yaml: ``recipe: null``), so the printed config, the run's
config.yaml and the config stored in its checkpoints say which one applied. The line printed at start
names the file and the values it set as they finally are (command-line overrides win over a recipe).
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from vitpipe.config.shipped import CONF_DIR, CONFIG_MODULE


def applied_recipe() -> tuple[str, Path] | None:
    """(choice, file) of the recipe this run merged, e.g. ("vit_b16_cifar10", conf/recipe/vit_b16_cifar10.yaml);
    None when the pair has no file (Hydra still records the choice of an optional group) or Hydra
    is not initialised (``train(cfg)`` called on a hand-made config)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    runtime = HydraConfig.get().runtime
    choice = runtime.choices.get("recipe")
    if not choice:
        return None
    for source in runtime.config_sources:
        if source.schema == "file":
            path = Path(source.path) / "recipe" / f"{choice}.yaml"
        elif source.schema == "pkg" and source.path == CONFIG_MODULE:  # the shipped configs (any install)
            path = CONF_DIR / "recipe" / f"{choice}.yaml"
        else:
            continue
        if path.is_file():
            return choice, path
    return None


def recipe_keys(path: Path) -> list[str]:
    """The dotted keys a recipe file sets (its defaults list and its own name excluded)."""
    node = OmegaConf.load(path)
    node.pop("defaults", None)
    node.pop("recipe", None)
    return _leaves(node)


def _leaves(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, DictConfig) and "_target_" not in v and len(v):
            keys += _leaves(v, key + ".")
        else:
            keys.append(key)
    return keys


@rank_zero_only
def announce_recipe(cfg: DictConfig) -> None:
    """Print ``vitpipe: recipe recipe/<choice>.yaml applied (key=value, ...)`` when one was."""
    applied = applied_recipe()
    if applied is None:
        return
    choice, path = applied
    values = []
    for key in recipe_keys(path):
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, DictConfig) and "_target_" in value:  # SGD(lr=0.03, momentum=0.9, ...)
            args = ", ".join(f"{k}={v}" for k, v in value.items() if not k.startswith("_"))
            value = f"{value._target_.rpartition('.')[2]}({args})"
        values.append(f"{key}={value}")
    print(f"vitpipe: recipe recipe/{choice}.yaml applied ({', '.join(values)}); command-line overrides win")
