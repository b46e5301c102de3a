"""``build_from_config``: a run's data module, network and LightningModule from its config, the one way.

Training builds from the composed config (``vitpipe.tasks.train``); every command that rebuilds a
stored run (eval, predict, export, serve, demo, visualize, ``load_run``, ``<Module>.load_from_checkpoint``)
builds from the checkpoint's stored config through ``vitpipe.run.checkpoint.rebuild``, which calls
this with the data module it could build and the tokenizer the checkpoint stores. Both therefore
hand the network the same data-derived arguments (``dm.model_kwargs()``: class count, channels, a
captioner's vocabulary) and the module the same ones (``dm.module_kwargs()``), so a stored run
rebuilds the network it trained. Only Hydra ``_target_`` instantiation happens here (vitpipe.config).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, open_dict
from torch import nn

from vitpipe.config.build import instantiate_checked
from vitpipe.config.preflight import check_config
from vitpipe.run.paths import resolve_ckpt_path

_FROM_CONFIG = object()  # build_from_config's default: build the data module from cfg.data


class Built(NamedTuple):
    """What ``build_from_config`` returns; unpacks as ``dm, net, module``."""

    datamodule: Any  # constructed, not set up; None only when a rebuild could not build it here
    net: nn.Module
    module: Any  # the LightningModule, holding ``net``


def build_data(cfg: DictConfig):
    """The data module of ``cfg``, its files checked (present, or download on; an image folder's links)."""
    dm = instantiate_checked(cfg.data, "data")
    if hasattr(dm, "check"):
        dm.check()  # the files exist (or download is on) before any model is built
    return dm


def build_from_config(cfg: DictConfig, *, dm=_FROM_CONFIG, tokenizer=None) -> Built:
    """Instantiate (datamodule, net, module) from a run config, validating on the way.

    Without ``dm`` (training, and code that builds a run by hand): ``cfg`` is a composed run config,
    checked first (``check_config``) and its data module built (``build_data``). With ``dm`` (the data
    module the caller built, or None when it could not): the caller has checked ``cfg`` (train:
    ``check_config`` before anything else; ``rebuild``: the stored-config rule, ``vitpipe.run.stored``).
    Either way ``model.pretrained=<run directory>`` becomes that run's best checkpoint (``pretrained_run``).

    ``tokenizer`` (a captioning checkpoint's): the data module decodes with the vocabulary the model was
    trained with rather than one rebuilt from the data, and without a data module the captioner is built
    from it alone.
    """
    if dm is _FROM_CONFIG:
        check_config(cfg)
        dm = build_data(cfg)
    if dm is not None and tokenizer is not None and hasattr(type(dm), "tokenizer"):  # the class: no getter call
        dm.tokenizer = tokenizer
    pretrained_run(cfg)  # a stored run's config never names one (rebuild clears it): nothing happens there
    if dm is not None and (hasattr(dm, "model_kwargs") or hasattr(dm, "module_kwargs")):
        model_kwargs = dm.model_kwargs() if hasattr(dm, "model_kwargs") else {}
        module_kwargs = dm.module_kwargs() if hasattr(dm, "module_kwargs") else {}
    elif tokenizer is not None:  # a captioner whose data module could not be built
        model_kwargs = {"vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id,
                        "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
        module_kwargs = {"tokenizer": tokenizer}
    else:
        model_kwargs, module_kwargs = {}, {}
    net = instantiate_checked(cfg.model, "model", **model_kwargs)
    module = instantiate_checked(cfg.module, "module", net=net, **module_kwargs)
    return Built(dm, net, module)


def pretrained_run(cfg: DictConfig) -> None:
    """``model.pretrained=<run directory>`` (an MAE pre-training run, a source classifier): that run's best
    checkpoint, the weights its own test used (``resolve_ckpt_path``), written into the config so the
    run's config.yaml and checkpoints name the file. Files, timm names and ``true`` pass unchanged."""
    value = cfg.model.get("pretrained") if isinstance(cfg.get("model"), DictConfig) else None
    if not isinstance(value, str) or not Path(value).expanduser().is_dir():
        return
    path = resolve_ckpt_path(value, which="best")
    with open_dict(cfg):
        cfg.model.pretrained = str(path)
    _say(f"vitpipe: model.pretrained={value} is a run directory: loading its best checkpoint {path}")


@rank_zero_only
def _say(line: str) -> None:
    print(line, flush=True)
