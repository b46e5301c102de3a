"""Rebuild a trained network (and its data module) from a vitpipe checkpoint alone.

Checkpoints written by ``vitpipe.train.train`` carry the resolved run config under
``checkpoint["vitpipe_config"]`` and the network's weights as ``net.*`` state_dict keys
(``ema.module.*`` too when the run kept an EMA). Captioning checkpoints also carry their
tokenizer (``checkpoint["tokenizer"]``), so the vocabulary never has to be rebuilt from the data.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from vitpipe.config import check_fits, instantiate_checked, load_checkpoint
from vitpipe.errors import ConfigError

log = logging.getLogger(__name__)

# model config keys that would fetch weights at build time; the checkpoint's own weights replace them
_INIT_WEIGHT_KEYS = ("pretrained", "encoder_ckpt")


def load_from_checkpoint(path, *, use_ema: bool = True) -> tuple[nn.Module, DictConfig, object | None]:
    """``(net, train_cfg, datamodule or None)`` from a checkpoint written by ``scripts/train.py``.

    The network is built from ``train_cfg.model`` (with the data module's ``model_kwargs()``,
    e.g. a captioner's vocabulary, taken from the tokenizer saved in the checkpoint), loaded with
    the checkpoint's weights (``torch.load(weights_only=True)``: no pickled code runs) and put in
    eval mode. ``use_ema``: load the EMA weights when the run kept them, since validation and
    checkpoint selection used those. The data module is only constructed, not set up (no files are
    read); it is None when its config cannot be built here (a warning says why).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"ckpt_path={path}: no such file; pass a .ckpt written by scripts/train.py")
    ckpt = load_checkpoint(path)
    if "vitpipe_config" not in ckpt:
        raise ConfigError(f"{path} has no vitpipe config inside; it was not written by scripts/train.py")
    train_cfg = OmegaConf.create(ckpt["vitpipe_config"])

    dm = _build_datamodule(train_cfg, path)
    tokenizer = _tokenizer(ckpt)
    if dm is not None and tokenizer is not None and hasattr(type(dm), "tokenizer"):  # the class: no getter call
        dm.tokenizer = tokenizer  # the vocabulary the model was trained with, not rebuilt from the data
    if dm is not None and hasattr(dm, "model_kwargs"):
        model_kwargs = dm.model_kwargs()
    elif tokenizer is not None:  # a captioner whose data module could not be built
        model_kwargs = {"vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id,
                        "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    else:
        model_kwargs = {}

    model_cfg = train_cfg.model.copy()
    with open_dict(model_cfg):
        for key in _INIT_WEIGHT_KEYS:
            if model_cfg.get(key):
                model_cfg[key] = None  # no download / second file: the checkpoint holds every weight
    net = instantiate_checked(model_cfg, "model", **model_kwargs)

    state = ckpt["state_dict"]
    check_fits(state, net, path)
    prefix = "ema.module." if use_ema and any(k.startswith("ema.module.") for k in state) else "net."
    net.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
    return net.eval(), train_cfg, dm


def _build_datamodule(train_cfg: DictConfig, path: Path):
    if train_cfg.get("data") is None:
        return None
    try:
        return instantiate_checked(train_cfg.data, "data")
    except (ConfigError, InstantiationException, ImportError) as e:
        log.warning("checkpoint %s: its data module cannot be built here (%s); continuing without it", path,
                    str(e).splitlines()[0])
        return None


def _tokenizer(ckpt: dict):
    if "tokenizer" not in ckpt:
        return None
    from vitpipe.text.tokenizer import WordTokenizer

    return WordTokenizer.from_state_dict(ckpt["tokenizer"])
