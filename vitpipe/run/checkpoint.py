"""A stored run rebuilt: data module, network and LightningModule from a checkpoint (``rebuild``), and
the documented entry points over it (``vitpipe.load_run``, ``vitpipe.viz.load_from_checkpoint``).

What a checkpoint holds, how it is read and what its stored config may name is
``vitpipe.run.stored``; the build itself is training's (``vitpipe.run.build.build_from_config``).
Only the stored ``model``, ``data`` and ``module`` sections are used, after ``check_stored_config``;
where output goes, where data lives and how the Trainer runs come from the current command line.
Which checkpoint ``ckpt_path`` means is ``vitpipe.run.paths.resolve_ckpt_path``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from vitpipe.config.build import instantiate_checked
from vitpipe.errors import ConfigError
from vitpipe.models.lora import merge_lora
from vitpipe.run.build import build_from_config
from vitpipe.run.paths import default_paths, resolve_ckpt_path
from vitpipe.run.stored import (
    EMA,
    INIT_WEIGHT_KEYS,
    STATE_DICT,
    check_fits,
    check_stored_config,
    class_names_of,
    config_of,
    load_checkpoint,
    stored_data,
    tokenizer_of,
)

log = logging.getLogger(__name__)


@dataclass
class Rebuilt:
    """A trained run rebuilt from its checkpoint (``rebuild``)."""

    cfg: DictConfig  # the validated config used: model, data, module from the file; paths, task_name current
    datamodule: Any  # constructed, not set up; None when its config cannot be built here (and was not required)
    net: nn.Module  # weights loaded, eval mode; the EMA network when the run kept one (it validated and tested)
    module: Any  # the LightningModule with every weight of the checkpoint loaded, eval mode (LoRA adapters merged)
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
    A ``module.finetune=lora`` run's adapters are merged into plain weights (``vitpipe.models.lora``).
    """
    path = Path(path)
    sections = check_stored_config(checkpoint, path)
    cfg = OmegaConf.create({"task_name": task_name, "model": sections["model"], "module": sections["module"]})
    with open_dict(cfg):
        cfg.paths = paths if paths is not None else default_paths()
        if data is not None:
            cfg.data = data  # its ${model.*} interpolations resolve against the stored model
        elif sections["data"] is not None:
            stored_paths = config_of(checkpoint).get("paths")
            cfg.data = stored_data(sections["data"], stored_paths, str(cfg.paths.data_dir))
        else:
            cfg.data = None
        for node in (cfg.model, cfg.model.get("encoder")):
            for key in INIT_WEIGHT_KEYS:
                if isinstance(node, DictConfig) and node.get(key) is not None:
                    node[key] = None  # no download / second file: the checkpoint holds every weight
    _check_data_fits(cfg, path, given=data is not None)

    tokenizer = tokenizer_of(checkpoint, path)  # the vocabulary the model was trained with, not rebuilt from the data
    dm = _datamodule(cfg, path, given=data is not None, need_data=need_data)
    net, module = build_from_config(cfg, dm=dm, tokenizer=tokenizer)[1:]
    state = checkpoint[STATE_DICT]
    check_fits(state, module.net, path)  # after the module: it may add to net (module.probe_bn: net.head.bn)
    module.on_load_checkpoint(checkpoint)  # as Lightning's restore does (captioners: the saved tokenizer)
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConfigError(f"checkpoint {path} does not fit its own module config: missing {result.missing_keys[:3]}, "
                          f"unexpected {result.unexpected_keys[:3]}")
    ema = any(k.startswith(EMA) for k in state)
    # module.finetune=lora: loaded with its adapters (the stored keys), then merged into plain weights, so
    # every reader (eval, predict, serve, export, visualize, a teacher) sees the network a full run would be
    merge_lora(module.net)
    if ema:
        merge_lora(module.get_submodule(EMA.rstrip(".")))
    evaluating = module.get_submodule(EMA.rstrip(".")) if ema else net  # what the run validated and tested
    return Rebuilt(cfg=cfg, datamodule=dm, net=evaluating.eval(), module=module.eval(),
                   class_names=class_names_of(checkpoint, dm if data is None else None))


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
