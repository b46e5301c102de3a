"""Config helpers: resolvers, instantiation with one-line errors, the lr scaling rule, the inference device.

The checks of a config before anything is built are ``vitpipe.tasks.preflight``'s (one entry, run once)."""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import torch
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from vitpipe.errors import ConfigError

log = logging.getLogger(__name__)


def auto_precision() -> str:
    """32-bit on CPU (bf16 there is emulated and ~20x slower); bf16-mixed on GPUs with native bf16
    (compute capability 8.0 and up: Ampere and newer); 16-mixed with loss scaling on older GPUs.

    Decided by the compute capability, not ``torch.cuda.is_bf16_supported()``: with its default
    ``including_emulation=True`` that is also true on a V100 or T4, where bf16 is emulated and
    several times slower than fp16. The ``${auto_precision:}`` resolver (``vitpipe.config.resolvers``)."""
    if not torch.cuda.is_available():
        return "32-true"
    return "bf16-mixed" if torch.cuda.get_device_capability() >= (8, 0) else "16-mixed"


def instantiate_checked(node: DictConfig, key: str, **kwargs):
    """``hydra.utils.instantiate`` whose user errors come back as one ConfigError line."""
    try:
        return hydra.utils.instantiate(node, _convert_="all", **kwargs)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} must be set, e.g. {e.full_key}=<value>") from None
    except InstantiationException as e:
        cause = e.__cause__
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if str(e).startswith("Error locating target"):
            raise ConfigError(f"{key}._target_={node.get('_target_')!r} cannot be imported") from None
        if isinstance(cause, (ValueError, FileNotFoundError, TypeError, ImportError, MisconfigurationException)):
            lines = str(cause).strip().splitlines()
            raise ConfigError(f"{key}: {lines[0] if lines else type(cause).__name__}") from cause
        raise


VITPIPE_TRAINER_KEYS = ("time_budget",)  # trainer.* keys that are vitpipe's, not Lightning Trainer arguments


def build_trainer(node: DictConfig, **kwargs):
    """Lightning's ``Trainer`` from ``cfg.trainer``, without the keys vitpipe reads itself
    (``trainer.time_budget``: ``vitpipe.lit.time_budget``)."""
    from omegaconf import open_dict

    node = OmegaConf.create(OmegaConf.to_container(node, resolve=True)) if node is not None else node
    if node is not None:
        with open_dict(node):
            for k in VITPIPE_TRAINER_KEYS:
                node.pop(k, None)
    return instantiate_checked(node, "trainer", **kwargs)


def instantiate_loggers(node: DictConfig | None) -> list:
    return [instantiate_checked(c, f"logger.{k}") for k, c in (node or {}).items() if c and "_target_" in c]


def instantiate_callbacks(node: DictConfig | None) -> list:
    return [instantiate_checked(c, f"callbacks.{k}") for k, c in (node or {}).items() if c and "_target_" in c]


def apply_lr_scaling(cfg: DictConfig, trainer) -> None:
    """Print the effective batch size and rescale ``module.optimizer.lr`` by ``cfg.lr_scaling``."""
    per_device = cfg.data.get("batch_size")
    if per_device is None or "optimizer" not in cfg.module:
        return
    accumulate = trainer.accumulate_grad_batches
    effective = per_device * trainer.world_size * accumulate
    scaling = cfg.get("lr_scaling") or {}
    rule, base = scaling.get("rule", "none"), scaling.get("base_batch_size", 256)
    factors = {"none": 1.0, "linear": effective / base, "sqrt": (effective / base) ** 0.5}
    if rule not in factors:
        raise ConfigError(f"lr_scaling.rule={rule!r}; valid choices: {', '.join(factors)}")
    lr = cfg.module.optimizer.lr * factors[rule]
    with open_dict(cfg):
        cfg.module.optimizer.lr = lr
    if trainer.is_global_zero:
        print(f"vitpipe: effective batch {effective} = {per_device} per device x {trainer.num_devices} device(s) "
              f"x {trainer.num_nodes} node(s) x {accumulate} accumulation; lr {lr:.3g} (lr_scaling.rule={rule}"
              + (f", base batch {base})" if rule != "none" else ")"))


def set_sweep_group(cfg: DictConfig) -> None:
    """In a Hydra multirun, put every job's wandb run in one group named after the sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    wandb_cfg = (cfg.get("logger") or {}).get("wandb")
    if wandb_cfg is None or wandb_cfg.get("group") or not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        with open_dict(cfg):
            cfg.logger.wandb.group = f"{cfg.task_name}-{Path(hc.sweep.dir).name}"


def resolve_device(name: str) -> torch.device:
    """``device=auto | cpu | cuda | cuda:N`` of the inference commands (predict, visualize)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} is not available here; use auto, cpu" +
                          (", cuda or cuda:<index>" if torch.cuda.is_available() else ""))
    return device
