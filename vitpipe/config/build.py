"""Config helpers: resolvers, early validation, instantiation with one-line errors."""

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
    several times slower than fp16."""
    if not torch.cuda.is_available():
        return "32-true"
    return "bf16-mixed" if torch.cuda.get_device_capability() >= (8, 0) else "16-mixed"


if not OmegaConf.has_resolver("auto_precision"):
    OmegaConf.register_new_resolver("auto_precision", auto_precision)


def check_config(cfg: DictConfig) -> None:
    """Checks that need no data (a mistake here would otherwise surface mid-run): every value
    against what it builds (``vitpipe.config.checks``), then the cross-group ones. A null data.num_classes
    is first filled in from the data's files where they say it (``vitpipe.data.num_classes``)."""
    from vitpipe.config.checks import check_values
    from vitpipe.data.num_classes import resolve_num_classes

    resolve_num_classes(cfg.get("data"))
    check_values(cfg)
    check_labels_used(cfg)
    check_naflex_module(cfg)
    check_multilabel(cfg)
    try:
        model_n, data_n = cfg.model.get("num_classes"), cfg.data.get("num_classes")
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} must be set on the command line, e.g. {e.full_key}=10") from None
    if model_n is not None and data_n is not None and model_n != data_n:
        raise ConfigError(
            f"model.num_classes={model_n} does not match data.num_classes={data_n}; "
            f"drop the model.num_classes override (it follows the data) or fix data.num_classes"
        )


def check_labels_used(cfg: DictConfig) -> None:
    """``data.labels=none`` (images without labels: one class) trains only a module that needs no labels
    (module=mae); a classifier on it would fit a constant and report 100% accuracy."""
    data, module = cfg.get("data"), cfg.get("module")
    if not isinstance(data, DictConfig) or data.get("labels") != "none" or not isinstance(module, DictConfig):
        return
    target = str(module.get("_target_", ""))
    if not target.endswith("MAEModule"):
        raise ConfigError(f"data.labels=none reads the images without labels (one class), which module "
                          f"{target.rsplit('.', 1)[-1] or '?'} cannot learn from; pre-train on them with module=mae, "
                          f"or put the images in class folders and use data.labels=folders")


def check_naflex_module(cfg: DictConfig) -> None:
    """``data.naflex.enabled=true`` feeds patch dicts: mixup and a distillation teacher need whole images.
    Refused here, before data loads (the module repeats the check for code that builds it by hand)."""
    data, module = cfg.get("data"), cfg.get("module")
    naflex = data.get("naflex") if isinstance(data, DictConfig) else None
    if not isinstance(naflex, DictConfig) or not naflex.get("enabled") or not isinstance(module, DictConfig):
        return
    distill = module.get("distill")
    for key, on in (("module.mixup", bool(module.get("mixup"))),
                    ("module.distill.teacher", isinstance(distill, DictConfig) and distill.get("teacher") is not None)):
        if on:
            raise ConfigError(f"data.naflex.enabled=true feeds patch dicts: {key} needs whole images; "
                              f"set {key}=null or data.naflex.enabled=false")


def check_multilabel(cfg: DictConfig) -> None:
    """``module.task=multilabel`` trains on label sets, which an image folder with a labels file gives
    (``data.labels=<file>.csv``) and shards written from one (their index says so), and neither with a
    distillation teacher (its softmax targets), the class-balanced sampler (one class per image) nor NaFlex;
    a labels file or multi-label shards need ``module.task=multilabel``."""
    data, module = cfg.get("data"), cfg.get("module")
    if not isinstance(data, DictConfig) or not isinstance(module, DictConfig):
        return
    labels = data.get("labels") if "labels" in data else None
    labels_file = isinstance(labels, str) and labels.lower().endswith(".csv")
    classifier = str(module.get("_target_", "")).endswith("ImageClassifier")
    multilabel = module.get("task", "multiclass") == "multilabel"
    if labels_file and classifier and not multilabel:
        raise ConfigError(f"data.labels={labels} gives each image a set of labels; set module.task=multilabel")
    shards = str(data.get("_target_", "")).endswith("ShardsDataModule")
    label_sets = labels_file or (shards and classifier and _check_shards_task(data, multilabel))
    if not multilabel:
        return
    if not label_sets:
        name = str(data.get("_target_", "?")).rsplit(".", 1)[-1]
        raise ConfigError(f"module.task=multilabel needs label sets: data=imagefolder data.labels=<labels file>.csv "
                          f"(vitpipe/data/multilabel.py); {name} with data.labels={labels} gives one class per image")
    distill, naflex = module.get("distill"), data.get("naflex")
    for key, on in (("module.distill.teacher", isinstance(distill, DictConfig) and distill.get("teacher") is not None),
                    ("data.sampler", data.get("sampler", "default") != "default"),
                    ("data.naflex.enabled", isinstance(naflex, DictConfig) and bool(naflex.get("enabled")))):
        if on:
            default = {"module.distill.teacher": "null", "data.sampler": "default"}.get(key, "false")
            raise ConfigError(f"module.task=multilabel cannot take {key}={OmegaConf.select(cfg, key)} "
                              f"(it needs one class per image); set {key}={default}")


def _check_shards_task(data: DictConfig, multilabel: bool) -> bool:
    """Whether ``data=shards`` holds label sets (its index, one small file), refusing a task that does not
    match them. A root that cannot be read is left to the data module's own error, except under
    ``module.task=multilabel``, where it says what the task needs."""
    from vitpipe.data.shards import _plain, is_multilabel_index, read_index

    need = ("module.task=multilabel needs label sets: data=imagefolder data.labels=<labels file>.csv, or data=shards "
            "written from one by scripts/make_shards.py")
    if OmegaConf.is_missing(data, "root") or data.get("root") is None:
        if multilabel:
            raise ConfigError(f"{need}; set data.root to such shards")
        return False
    root, cache_dir = str(data.root), data.get("cache_dir")
    try:
        index = read_index(root, None if cache_dir is None else str(cache_dir), _plain(data.get("storage_options")))
    except ConfigError as err:
        if multilabel:
            raise ConfigError(f"{need}; {err}") from None
        return False
    found = is_multilabel_index(index)
    if multilabel and not found:
        raise ConfigError(f"{need}; data.root={root} holds single-label shards (one class per image): set "
                          "module.task=multiclass, or write multi-label shards with scripts/make_shards.py "
                          "data=imagefolder data.labels=<labels file>.csv out=DIR")
    if found and not multilabel:
        raise ConfigError(f"data.root={root} holds multi-label shards (a set of labels per image); "
                          "set module.task=multilabel")
    return found


def check_device(cfg: DictConfig) -> None:
    """A GPU trainer on a machine without one: one line before anything is built (Lightning's own
    message, "No supported gpu backend found!", names neither the setting nor the way out). Not part
    of ``check_config``: a config for GPU nodes may be composed and checked on a CPU-only login node."""
    accelerator = str((cfg.get("trainer") or {}).get("accelerator", ""))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator} needs a CUDA GPU and torch sees none here; "
                          f"use trainer=cpu (or trainer=default, which picks the device)")


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
