"""Lightning's own reload, ``<Module>.load_from_checkpoint(path)``, for the checkpoints vitpipe runs write.

Lightning rebuilds a module as ``cls(**checkpoint["hyper_parameters"])``. A vitpipe module is handed a
built network and a partial optimizer (STYLE 3), which are not hyper-parameters, so that call could
not work (``missing 2 required positional arguments: 'net' and 'optimizer'``), and Lightning's loader
would rebuild whatever a file names. Here the file is read as data and its stored config checked
against the allow-list (``vitpipe.run.stored``), and the module is rebuilt by vitpipe's own builders: the
rebuild that eval, predict and export use (``vitpipe.run.checkpoint.rebuild``). So the checkpoints
written before this existed load too: every checkpoint scripts/train.py writes stores its config.

For a stored run's module *and* data module (``Trainer.test``), ``vitpipe.load_run(path)``.
"""

from __future__ import annotations

import os

import torch

from vitpipe.errors import ConfigError

# what the stored config builds; a keyword argument may override the module's plain settings only
_BUILT = ("net", "optimizer", "scheduler", "tokenizer")


class LoadsStoredRun:
    """Mixed into ImageClassifier, MAEModule and CaptionModule (before ``L.LightningModule``)."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None,
                             weights_only=None, **kwargs):
        """The module of a ``.ckpt`` written by ``scripts/train.py``, every weight loaded, in eval mode.

        Lightning's signature. ``kwargs`` override the module's stored settings (plain values, e.g.
        ``threshold=0.3``); ``map_location``: a device to move the module to. The network comes from the
        checkpoint's stored model config (``net=`` is refused), which is checked like every stored config
        (``vitpipe.run.stored.ALLOWED_TARGETS``) before anything is built. Every problem is one
        ``ConfigError`` line. ``module.eval_net`` is the network the run validated (its EMA copy when it
        kept one).
        """
        from vitpipe.run.checkpoint import rebuild
        from vitpipe.run.stored import ALLOWED_TARGETS, config_of, load_checkpoint, with_config

        what = f"{cls.__name__}.load_from_checkpoint"
        if not isinstance(checkpoint_path, (str, os.PathLike)):
            raise ConfigError(f"{what}: pass the path of a .ckpt file, not a {type(checkpoint_path).__name__}")
        if weights_only is False:
            raise ConfigError(f"{what}: weights_only=False is refused; a checkpoint is data, read with "
                              "weights_only=True (no pickled object is rebuilt)")
        if hparams_file is not None:
            raise ConfigError(f"{what}: hparams_file={hparams_file!r} is not read; the module's settings come from "
                              "the checkpoint's stored config: pass changes as keyword arguments")
        if strict is False:
            raise ConfigError(f"{what}: strict=False is not supported; every weight of the run is loaded and must fit")
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise ConfigError(f"{what}: map_location={map_location!r}; pass a device such as 'cpu' or 'cuda:0'")
        built = [k for k in _BUILT if k in kwargs]
        if built:
            raise ConfigError(f"{what}: {built[0]}= is built from the checkpoint's stored config; drop it, or build "
                              f"the module yourself ({cls.__name__}(net, optimizer, ...)) and load_state_dict its "
                              "state_dict")
        path = checkpoint_path
        checkpoint = load_checkpoint(path)
        stored = config_of(checkpoint)
        module_cfg = stored.get("module") if isinstance(stored, dict) else None
        if not isinstance(module_cfg, dict):
            raise ConfigError(f"{path} stores no vitpipe config (scripts/train.py writes one), so {what} cannot "
                              f"rebuild its network; build the module yourself ({cls.__name__}(net, optimizer, ...)) "
                              "and load_state_dict the checkpoint's state_dict")
        target = module_cfg.get("_target_")  # not yet checked: named only if it is one of vitpipe's modules
        if target in ALLOWED_TARGETS["module"] and target.rsplit(".", 1)[-1] != cls.__name__:
            raise ConfigError(f"{path} holds a module of class {target.rsplit('.', 1)[-1]}, not {cls.__name__}; load "
                              f"it with {target}.load_from_checkpoint, or vitpipe.load_run")
        if kwargs:  # checked with the rest of the stored config: plain values, no Hydra keys
            checkpoint = with_config(checkpoint, {**stored, "module": {**module_cfg, **kwargs}})
        module = rebuild(checkpoint, path).module
        if not isinstance(module, cls):
            raise ConfigError(f"{path} rebuilds a {type(module).__name__}, not a {cls.__name__}")
        return module if map_location is None else module.to(map_location)
