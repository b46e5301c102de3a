"""Say which ``conf/recipe/<model>_<data>.yaml`` a run picked up, and what it set.

``train.yaml`` selects ``optional recipe: ${model}_${data}`` silently, so ``model=vit_b16
data=cifar10`` fine-tunes for 10k steps instead of the default schedule. The line printed at start
names the file and the values it set as they finally are (command-line overrides win over a recipe).
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf


def applied_recipe() -> str | None:
    """The recipe option Hydra chose for this run (``vit_b16_cifar10``), or None (no file for the
    pair, or Hydra not initialised: ``train(cfg)`` called on a hand-made config)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get("recipe")


def recipe_keys(choice: str) -> list[str]:
    """The dotted keys a recipe file sets (its defaults list excluded), read from the primary config dir."""
    from hydra.core.hydra_config import HydraConfig

    for source in HydraConfig.get().runtime.config_sources:
        if source.provider == "main" and source.schema == "file":
            path = Path(source.path) / "recipe" / f"{choice}.yaml"
            if path.is_file():
                node = OmegaConf.load(path)
                node.pop("defaults", None)
                return _leaves(node)
    return []


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
    choice = applied_recipe()
    if not choice:
        return
    values = []
    for key in recipe_keys(choice):
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, DictConfig) and "_target_" in value:  # SGD(lr=0.03, momentum=0.9, ...)
            args = ", ".join(f"{k}={v}" for k, v in value.items() if not k.startswith("_"))
            value = f"{value._target_.rpartition('.')[2]}({args})"
        values.append(f"{key}={value}")
    print(f"vitpipe: recipe recipe/{choice}.yaml applied ({', '.join(values)}); command-line overrides win")
