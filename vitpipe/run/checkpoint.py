"""Checkpoints: reading one as data, checking its stored config, rebuilding its run safely.

A checkpoint written by ``scripts/train.py`` holds

    state_dict       the LightningModule's weights: ``net.*``, and ``ema.module.*`` when the run kept an EMA
    vitpipe_config   the run's resolved config, equal to its config.yaml
    class_names      label index -> name (None when the data has no names)
    tokenizer        captioners: the vocabulary the decoder was trained with

A checkpoint is a file someone may hand us, so it is data, never code: it is read with
``vitpipe.run.safeload.safe_torch_load`` (``weights_only=True``: no pickled object is rebuilt; the
archive's declared sizes bounded before anything inflates), and of its stored config only the
``model``, ``data`` and ``module`` sections are used, after every ``_target_`` in them has been
found in ``ALLOWED_TARGETS``. Where output goes, where data lives and how the Trainer, loggers and
callbacks run always come from the current command line and its defaults, never from the file.

Which checkpoint ``ckpt_path`` means is ``vitpipe.run.paths.resolve_ckpt_path``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from vitpipe.config.build import instantiate_checked
from vitpipe.errors import ConfigError
from vitpipe.run.paths import Usable, a_kind, default_paths, resolve_ckpt_path, run_config, run_kind, why_unreadable
from vitpipe.run.safeload import safe_torch_load
from vitpipe.run.stored import data_path, portable_data

log = logging.getLogger(__name__)

# The only callables a stored config may name, per section: exact dotted names, derived from what
# conf/model, conf/data and conf/module use (tests/test_checkpoint.py keeps them in step), plus the
# plain torch optimizers a user may pick on the command line. Never a generic importer
# (hydra.utils.get_class / get_method, lightning's instantiate_class): they call whatever path they get.
_OPTIMIZERS = {"torch.optim.AdamW", "torch.optim.Adam", "torch.optim.SGD", "timm.scheduler.CosineLRScheduler"} | {
    f"torch.optim.lr_scheduler.{name}"  # build_scheduler accepts torch's own schedulers too
    for name in ("CosineAnnealingLR", "OneCycleLR", "LinearLR", "StepLR", "MultiStepLR", "ExponentialLR")
}
ALLOWED_TARGETS: dict[str, frozenset[str]] = {
    "model": frozenset({"vitpipe.create_model", "vitpipe.models.captioner.Captioner",
                        "vitpipe.models.timm_model.create_timm_model", "vitpipe.models.registry.create_mae"}),
    "data": frozenset({
        "vitpipe.data.CIFAR10DataModule", "vitpipe.data.CIFAR100DataModule", "vitpipe.data.DigitsDataModule",
        "vitpipe.data.FashionMNISTDataModule", "vitpipe.data.ImageFolderDataModule",
        "vitpipe.data.SyntheticDataModule", "vitpipe.data.captions.COCOCaptionDataModule",
        "vitpipe.data.captions.ShapesCaptionDataModule", "vitpipe.data.shards.ShardsDataModule",
    }),
    "module": frozenset({"vitpipe.lit.ImageClassifier", "vitpipe.lit.captioner.CaptionModule", "vitpipe.lit.mae.MAEModule",
                         *_OPTIMIZERS}),
}
# Hydra keys a stored config may carry; _args_, _recursive_, _convert_ (and any other _x_) are refused
_SPECIAL_KEYS_ALLOWED = {"_target_", "_partial_"}
# model keys that would read weights from elsewhere at build time; the checkpoint holds every weight
_INIT_WEIGHT_KEYS = ("pretrained", "encoder_ckpt")


# --------------------------------------------------------------------------- reading


def load_checkpoint(path) -> dict:
    """The checkpoint at ``path`` as a dict, read without rebuilding any pickled object
    (``weights_only=True``); ConfigError, one sentence, for anything that is not a Lightning checkpoint."""
    path = Path(path)
    try:
        ckpt = safe_torch_load(path)  # the archive's declared sizes are bounded before anything inflates
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes one sentence naming the file
        raise ConfigError(f"cannot read checkpoint {path}: {why_unreadable(path, e)}") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise ConfigError(f"{path} is not a Lightning checkpoint: it holds no state_dict; "
                          "pass a .ckpt written by scripts/train.py.")
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in ckpt["state_dict"].items()):
        raise ConfigError(f"{path} is not a Lightning checkpoint: its state_dict holds values that are not tensors.")
    return ckpt


def check_fits(state_dict: dict, net: nn.Module, path) -> None:
    """ConfigError when the checkpoint's ``net.*`` weights do not fit ``net`` exactly (checked before data
    loads; Lightning's strict load would otherwise fail after it): shapes, missing and unexpected keys."""
    from vitpipe.models.timm_compat import mismatch_summary

    own = {k: v.shape for k, v in net.state_dict().items()}
    theirs = {k[len("net."):]: v.shape for k, v in state_dict.items() if k.startswith("net.")}
    wrong = {k: (theirs[k], s) for k, s in own.items() if k in theirs and theirs[k] != s}
    missing = [k for k in own if k not in theirs]
    unexpected = [k for k in theirs if k not in own]
    if wrong or missing or unexpected:
        raise ConfigError(f"checkpoint {path} does not fit the configured model: "
                          f"{mismatch_summary(wrong, missing, unexpected, 'checkpoint', shapes=1)}; "
                          "use the model config the checkpoint was trained with")


def resumable_by(net: nn.Module, cfg: DictConfig) -> Usable:
    """A ``usable`` for train's ``ckpt_path=last``: runs of the same kind as ``cfg`` (``run_kind``: its module and
    task, from the run's config.yaml) whose newest checkpoint has ``net``'s weights, key for key and shape for
    shape (read memory-mapped: no weights are loaded), as ``check_fits`` then requires of the one chosen."""
    want = run_kind(OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg)
    own = {k: tuple(v.shape) for k, v in net.state_dict().items()}

    def usable(folder: Path) -> str | None:
        kind = run_kind(run_config(folder))
        if kind != want:
            return f"is {a_kind(kind)} run, and this one trains {a_kind(want)}"
        last = folder / "last.ckpt"
        ckpts = [last] if last.is_file() else sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)[-1:]
        try:
            state = safe_torch_load(ckpts[-1], mmap=True)["state_dict"]
            theirs = {k[len("net."):]: tuple(v.shape) for k, v in state.items() if k.startswith("net.")}
        except Exception:  # noqa: BLE001 - an unreadable checkpoint fits nothing
            return f"has a checkpoint {ckpts[-1].name} that cannot be read"
        if theirs != own:
            return "holds weights of another model than the configured one"
        return None

    return usable


# --------------------------------------------------------------------------- the stored config


def check_stored_config(checkpoint: dict, path) -> dict[str, dict | None]:
    """The stored ``model``, ``data`` and ``module`` sections, after checking that they name only
    ``ALLOWED_TARGETS``, use no other Hydra key and hold plain values without interpolations."""
    stored = checkpoint.get("vitpipe_config")
    if not isinstance(stored, dict):
        raise ConfigError(f"{path} has no vitpipe config inside; it was not written by scripts/train.py")
    sections = {}
    for key in ("model", "data", "module"):
        node = stored.get(key)
        if node is None and key == "data":
            sections[key] = None
            continue
        if not isinstance(node, dict) or not isinstance(node.get("_target_"), str) or node.get("_partial_"):
            raise ConfigError(f"refused checkpoint {path}: its stored {key} config is not a buildable {key} section")
        try:
            _check_node(node, key, ALLOWED_TARGETS[key], path)
        except RecursionError:
            raise ConfigError(f"refused checkpoint {path}: its stored {key} config is nested too deeply") from None
        sections[key] = node
    return sections


def _check_node(node, where: str, allowed: frozenset[str], path) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            here = f"{where}.{k}"
            if not isinstance(k, str):
                raise ConfigError(f"refused checkpoint {path}: its stored config has a key {k!r} under {where}")
            if k == "_target_" and (not isinstance(v, str) or v not in allowed):
                raise ConfigError(f"refused checkpoint {path}: its stored config names {here}={v!r}, which is not one "
                                  f"of vitpipe's builders (vitpipe.run.checkpoint.ALLOWED_TARGETS); nothing was called")
            if k.startswith("_") and k.endswith("_") and k not in _SPECIAL_KEYS_ALLOWED:
                raise ConfigError(f"refused checkpoint {path}: its stored config uses the Hydra key {here}, "
                                  "which vitpipe's configs never write")
            _check_node(v, here, allowed, path)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _check_node(v, f"{where}[{i}]", allowed, path)
    elif isinstance(node, str):
        if "${" in node:  # resolved at save time: an interpolation here could build a node past this check
            raise ConfigError(f"refused checkpoint {path}: its stored config has an interpolation at {where}")
    elif node is not None and not isinstance(node, (bool, int, float)):
        raise ConfigError(f"refused checkpoint {path}: its stored config holds a {type(node).__name__} at {where}")


def _stored_data(data: dict, stored_paths, data_dir: str, path) -> dict:
    """The stored data section as this machine reads it: its paths through the rule the writer used
    (``vitpipe.run.stored.portable_data``), its root moved under the current ``paths.data_dir`` (kept
    relative to the old data_dir when it was under it, e.g. coco/)."""
    data = portable_data(data, reading=True)
    if data.get("root") is not None:
        old_dir = stored_paths.get("data_dir") if isinstance(stored_paths, dict) else None
        rel = None
        if isinstance(old_dir, str):
            try:
                rel = PurePosixPath(str(data["root"])).relative_to(old_dir)
            except ValueError:
                rel = None
        keep = rel is not None and len(rel.parts) > 0 and data_path(str(rel), data_dir) is not None
        data["root"] = str(PurePosixPath(data_dir) / rel) if keep else data_dir
    return data


# --------------------------------------------------------------------------- rebuilding


@dataclass
class Rebuilt:
    """A trained run rebuilt from its checkpoint (``rebuild``)."""

    cfg: DictConfig  # the validated config used: model, data, module from the file; paths, task_name current
    datamodule: Any  # constructed, not set up; None when its config cannot be built here (and was not required)
    net: nn.Module  # weights loaded, eval mode; the EMA network when the run kept one (it validated and tested)
    module: Any  # the LightningModule with every weight of the checkpoint loaded, eval mode
    class_names: list[str] | None  # label index -> name, as the run's data named them


def rebuild(checkpoint: dict, path, *, data: DictConfig | None = None, paths: DictConfig | None = None,
            task_name: str = "eval", need_data: bool = False) -> Rebuilt:
    """Rebuild data module, network and LightningModule from ``checkpoint`` (``load_checkpoint(path)``).

    The stored config is checked first (``check_stored_config``: nothing is imported or called
    before). ``data``: a data config from the command line, used instead of the stored one; without
    it, the stored data section is used with its root under ``paths.data_dir``. ``paths``: the
    current paths (default: conf/paths/default.yaml's layout under the working directory).
    ``need_data``: the data must build and its files be present (eval), else a data module that
    cannot be built here is None with a warning (a folder of images needs no data set).
    """
    path = Path(path)
    sections = check_stored_config(checkpoint, path)
    cfg = OmegaConf.create({"task_name": task_name, "model": sections["model"], "module": sections["module"]})
    with open_dict(cfg):
        cfg.paths = paths if paths is not None else default_paths()
        if data is not None:
            cfg.data = data  # its ${model.*} interpolations resolve against the stored model
        elif sections["data"] is not None:
            stored_paths = checkpoint["vitpipe_config"].get("paths")
            cfg.data = _stored_data(sections["data"], stored_paths, str(cfg.paths.data_dir), path)
        else:
            cfg.data = None
        for node in (cfg.model, cfg.model.get("encoder")):
            for key in _INIT_WEIGHT_KEYS:
                if isinstance(node, DictConfig) and node.get(key) is not None:
                    node[key] = None  # no download / second file: the checkpoint holds every weight
    _check_data_fits(cfg, path, given=data is not None)

    tokenizer = _tokenizer(checkpoint, path)
    dm = _datamodule(cfg, path, given=data is not None, need_data=need_data)
    if dm is not None and tokenizer is not None and hasattr(type(dm), "tokenizer"):  # the class: no getter call
        dm.tokenizer = tokenizer  # the vocabulary the model was trained with, not rebuilt from the data
    if dm is not None and hasattr(dm, "model_kwargs"):
        model_kwargs, module_kwargs = dm.model_kwargs(), dm.module_kwargs()
    elif tokenizer is not None:  # a captioner whose data module could not be built
        model_kwargs = {"vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id,
                        "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
        module_kwargs = {"tokenizer": tokenizer}
    else:
        model_kwargs, module_kwargs = {}, {}

    state = checkpoint["state_dict"]
    net = instantiate_checked(cfg.model, "model", **model_kwargs)
    module = instantiate_checked(cfg.module, "module", net=net, **module_kwargs)
    check_fits(state, module.net, path)  # after the module: it may add to net (module.probe_bn: net.head.bn)
    module.on_load_checkpoint(checkpoint)  # as Lightning's restore does (captioners: the saved tokenizer)
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConfigError(f"checkpoint {path} does not fit its own module config: missing {result.missing_keys[:3]}, "
                          f"unexpected {result.unexpected_keys[:3]}")
    ema = any(k.startswith("ema.module.") for k in state)
    evaluating = module.get_submodule("ema.module") if ema else net  # what the run validated and tested
    return Rebuilt(cfg=cfg, datamodule=dm, net=evaluating.eval(), module=module.eval(),
                   class_names=_class_names(checkpoint, dm if data is None else None))


def _check_data_fits(cfg: DictConfig, path: Path, *, given: bool) -> None:
    """Class and channel counts of the data against the checkpoint's model, in the terms of eval."""
    if cfg.data is None:
        return
    label = _data_label(cfg.data) if given else "(the checkpoint's own)"
    if given:
        from vitpipe.data.num_classes import resolve_num_classes

        resolve_num_classes(cfg.data)  # data=imagefolder data.root=...: the class folders' count, checked below
    model_n = cfg.model.get("num_classes")
    if isinstance(model_n, int) and OmegaConf.is_missing(cfg.data, "num_classes"):
        raise ConfigError(f"data.num_classes must be set: checkpoint {path} has {model_n} classes, so "
                          f"data.num_classes={model_n}")
    data_n = cfg.data.get("num_classes")
    if isinstance(model_n, int) and isinstance(data_n, int) and model_n != data_n:
        raise ConfigError(f"checkpoint {path} has {model_n} classes, data={label} has {data_n}; use data with "
                          f"the same {model_n} classes, or leave data out to use the checkpoint's own")
    in_chans = cfg.model.get("in_chans") or (cfg.model.get("encoder") or {}).get("in_chans")
    channels = cfg.data.get("channels")
    if isinstance(in_chans, int) and isinstance(channels, int) and channels != in_chans and \
            not (channels == 1 and in_chans == 3):
        raise ConfigError(f"checkpoint {path} takes {in_chans}-channel images, data={label} has {channels}; "
                          f"use data with {in_chans}-channel images")


def _data_label(data: DictConfig) -> str:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        choice = HydraConfig.get().runtime.choices.get("data")
        if choice:
            return str(choice)
    return str(data.get("_target_", "?")).rsplit(".", 1)[-1]


def _tokenizer(checkpoint: dict, path: Path):
    if "tokenizer" not in checkpoint:
        return None
    from vitpipe.text.tokenizer import WordTokenizer

    try:
        return WordTokenizer.from_state_dict(checkpoint["tokenizer"])
    except Exception:  # noqa: BLE001 - whatever is wrong with it, the file is at fault
        raise ConfigError(f"checkpoint {path} holds a tokenizer that cannot be read; "
                          "use a checkpoint written by scripts/train.py") from None


def _datamodule(cfg: DictConfig, path: Path, *, given: bool, need_data: bool):
    if cfg.data is None:
        if need_data:
            raise ConfigError(f"{path} stores no data config; pass data=<name>")
        return None
    try:
        dm = instantiate_checked(cfg.data, "data")
        if need_data and hasattr(dm, "check"):
            dm.check()  # the files exist (or download is on) before the model is built
        return dm
    except ConfigError as e:
        if given:
            raise
        if need_data:
            hint = "; data roots are never taken from a checkpoint: pass data=<name> (and data.root)" \
                if cfg.data.get("root") is not None else ""
            raise ConfigError(f"{e}{hint}") from None
        log.warning("checkpoint %s: its data module cannot be built here (%s); continuing without it", path,
                    str(e).splitlines()[0])
        return None


def _class_names(checkpoint: dict, dm) -> list[str] | None:
    names = checkpoint.get("class_names")
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        return list(names)
    names = getattr(dm, "class_names", None)  # checkpoints written before class names were stored
    return [str(n) for n in names] if names else None


def load_from_checkpoint(path) -> tuple[nn.Module, DictConfig, Any]:
    """``(net, cfg, datamodule or None)`` from a checkpoint file or run directory (its best checkpoint):
    the notebooks' one-liner over ``rebuild``."""
    path = resolve_ckpt_path(path, which="best")
    run = rebuild(load_checkpoint(path), path)
    return run.net, run.cfg, run.datamodule


def load_run(path, *, data: DictConfig | None = None, need_data: bool = False) -> Rebuilt:
    """A stored run, ready for Lightning: ``vitpipe.load_run(path)``, the documented Python entry point.

    ``path``: a checkpoint file or a run directory (its best checkpoint). Returns ``Rebuilt``: ``.module``
    (the LightningModule, every weight loaded), ``.datamodule`` (constructed from the stored data config,
    root under the current ``paths.data_dir``; None when it cannot be built here, unless ``need_data``),
    ``.net`` (the network the run evaluated), ``.cfg`` and ``.class_names``. ``Trainer().test(run.module,
    datamodule=run.datamodule)`` scores what the run's own test scored."""
    path = resolve_ckpt_path(path, which="best")
    return rebuild(load_checkpoint(path), path, data=data, need_data=need_data)
