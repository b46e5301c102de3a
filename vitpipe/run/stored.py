"""A stored run: the one owner of the checkpoint format (its keys, its one safe read, and the rule for
what its stored config may hold, which the writer and every reader share).

A checkpoint written by ``scripts/train.py`` holds, besides Lightning's own entries (``epoch``,
``global_step``, ``optimizer_states``, ``callbacks``, ...):

    STATE_DICT   "state_dict"      the LightningModule's weights: ``net.*``, and ``ema.module.*`` when the run kept an EMA
    CONFIG       "vitpipe_config"  the run's resolved config, through ``stored_config``: equal to its config.yaml
    CLASS_NAMES  "class_names"     label index -> name (None when the data has no names)
    TOKENIZER    "tokenizer"       captioners: the vocabulary the decoder was trained with
    (``vitpipe.data.resume.RNG_KEY``, "rng_states": every rank's random generators, for an exact resume)

A checkpoint is a file someone may hand us, so it is data, never code. Every read of one goes
through here (``load_checkpoint``, and ``peek`` for a few small values of a large file) on top of
``vitpipe.run.safeload.safe_torch_load``: ``weights_only=True`` (no pickled object is rebuilt) and
the archive's declared sizes bounded before anything inflates.

The stored config, written by ``ConfigInCheckpoint`` (and config.yaml by ``vitpipe.run.info``):

- Paths. A checkpoint may be read on another machine, so where data lives is never taken from it:
  its ``data.root`` moves under the current ``paths.data_dir`` (``stored_data``). The other paths of
  the data section (``data.labels``, ``data.splits.<split>.<key>``, any other string) are classified
  by ``data_path`` against the stored root:

    inside the root   stored, and read back, relative to it: ``data.labels=$D/labels.csv`` with
                      ``data.root=$D`` is ``labels.csv`` (``a/../b.csv``: ``b.csv``), and it moves
                      with the root
    outside the root  kept as given by the writer (config.yaml and the checkpoint say where the run
                      read it); the reader does not follow it: the file's name alone, under the
                      current root, as for the root itself

  ``LOCAL_KEYS`` say where this machine keeps things (a download cache, storage credentials and
  endpoints): the writer keeps them, the reader drops them to their defaults (None).
  ``portable_data(data, reading=...)`` applies that rule to a data section on both sides, so whatever
  training accepts loads in eval, predict, export, serve and demo.
- What a reader builds from it (``check_stored_config``): only the ``model``, ``data`` and ``module``
  sections, after every ``_target_`` in them was found in ``ALLOWED_TARGETS``, no other Hydra key is
  used and every value is plain (no interpolation). Where output goes, where data lives and how the
  Trainer, loggers and callbacks run always come from the current command line, never from the file;
  model paths (``model.pretrained``, ``model.encoder.encoder_ckpt``) are never followed
  (``INIT_WEIGHT_KEYS``: the checkpoint holds every weight).

Rebuilding a run from all this is ``vitpipe.run.checkpoint.rebuild``; which file ``ckpt_path`` means
is ``vitpipe.run.paths.resolve_ckpt_path``.
"""

from __future__ import annotations

import copy
import pickle
import posixpath
import re
from pathlib import Path, PurePosixPath

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from vitpipe.errors import ConfigError
from vitpipe.run.safeload import not_a_checkpoint, safe_torch_load

STATE_DICT = "state_dict"
CONFIG = "vitpipe_config"
CLASS_NAMES = "class_names"
TOKENIZER = "tokenizer"
NET = "net."  # the network's weights in STATE_DICT
EMA = "ema.module."  # the EMA copy's, when the run kept one: what it validated and tested


# --------------------------------------------------------------------------- the one read


def load_checkpoint(path) -> dict:
    """The checkpoint at ``path`` as a dict, read as data; ConfigError, one sentence, for anything that is
    not a Lightning checkpoint of tensors."""
    path = Path(path)
    try:
        ckpt = safe_torch_load(path)  # the archive's declared sizes are bounded before anything inflates
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes one sentence naming the file
        raise ConfigError(f"cannot read checkpoint {path}: {why_unreadable(path, e)}") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get(STATE_DICT), dict):
        raise ConfigError(f"{path} is not a Lightning checkpoint: it holds no state_dict; "
                          "pass a .ckpt written by scripts/train.py.")
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in ckpt[STATE_DICT].items()):
        raise ConfigError(f"{path} is not a Lightning checkpoint: its state_dict holds values that are not tensors.")
    return ckpt


def peek(path):
    """The checkpoint at ``path`` memory-mapped (tensors stay on disk: reading a few small values of a large
    file), unchecked; exceptions propagate (the size refusal is a ConfigError)."""
    return safe_torch_load(path, mmap=True)


def config_in(path) -> dict | None:
    """The stored config of the checkpoint at ``path``, read cheaply; None when it has none. Raises as ``peek``."""
    stored = peek(path).get(CONFIG)
    return stored if isinstance(stored, dict) else None


def net_shapes(state_dict: dict) -> dict[str, tuple]:
    """The network's weight shapes in a checkpoint's state dict, by the network's own key names."""
    return {k[len(NET):]: tuple(v.shape) for k, v in state_dict.items() if k.startswith(NET)}


def recorded_best(path: Path) -> tuple[str | None, str | None]:
    """(the best_model_path that ``path``'s ModelCheckpoint state records, or None; why the file could
    not be read, or None). Read with mmap: no weights are loaded."""
    try:
        ckpt = peek(path)
    except Exception as e:  # noqa: BLE001 - said in the caller's one line
        if isinstance(e, ConfigError):  # refused by its declared sizes: that sentence is the reason
            return None, str(e).split(": ", 1)[-1]
        return None, why_unreadable(path, e).split(";")[0].rstrip(".")  # the reason, without its advice
    callbacks = ckpt.get("callbacks") if isinstance(ckpt, dict) else None
    states = callbacks.values() if isinstance(callbacks, dict) else ()
    # ModelCheckpoint (or a subclass) keeps best_model_path; "" until its first top-k save
    return next((str(s["best_model_path"]) for s in states
                 if isinstance(s, dict) and s.get("best_model_path")), None), None


def why_unreadable(path: Path, err: Exception) -> str:
    """Why a checkpoint file could not be read, in one sentence with what to do."""
    if isinstance(err, OSError):
        return f"{err.strerror or err}."
    if isinstance(err, pickle.UnpicklingError) and "weights only load failed" in str(err).lower():
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        return (f"it holds a pickled Python object{what} that loading would have to run as code, and vitpipe "
                "only loads tensors and plain values from files; use a checkpoint written by scripts/train.py.")
    return not_a_checkpoint(path) or ("the file is truncated or corrupt (it was probably cut short while being "
                                      "written or copied); use another checkpoint of the run.")


# --------------------------------------------------------------------------- what a loaded checkpoint holds


def config_of(checkpoint: dict) -> dict | None:
    """The stored run config of a loaded checkpoint (not yet checked: see ``check_stored_config``), or None."""
    return checkpoint.get(CONFIG)


def with_config(checkpoint: dict, config: dict) -> dict:
    """A shallow copy of ``checkpoint`` storing ``config`` instead (checked like any stored config when rebuilt)."""
    return {**checkpoint, CONFIG: config}


def class_names_of(checkpoint: dict, dm=None) -> list[str] | None:
    names = checkpoint.get(CLASS_NAMES)
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        return list(names)
    names = getattr(dm, "class_names", None)  # checkpoints written before class names were stored
    return [str(n) for n in names] if names else None


def tokenizer_of(checkpoint: dict, path):
    """The captioner's stored tokenizer, or None when the checkpoint stores none."""
    if TOKENIZER not in checkpoint:
        return None
    from vitpipe.text.tokenizer import WordTokenizer

    try:
        return WordTokenizer.from_state_dict(checkpoint[TOKENIZER])
    except Exception:  # noqa: BLE001 - whatever is wrong with it, the file is at fault
        raise ConfigError(f"checkpoint {path} holds a tokenizer that cannot be read; "
                          "use a checkpoint written by scripts/train.py") from None


def check_fits(state_dict: dict, net: torch.nn.Module, path) -> None:
    """ConfigError when the checkpoint's ``net.*`` weights do not fit ``net`` exactly (checked before data
    loads; Lightning's strict load would otherwise fail after it): shapes, missing and unexpected keys."""
    from vitpipe.models.weights import mismatch_summary

    own = {k: v.shape for k, v in net.state_dict().items()}
    theirs = {k[len(NET):]: v.shape for k, v in state_dict.items() if k.startswith(NET)}
    wrong = {k: (theirs[k], s) for k, s in own.items() if k in theirs and theirs[k] != s}
    missing = [k for k in own if k not in theirs]
    unexpected = [k for k in theirs if k not in own]
    if wrong or missing or unexpected:
        raise ConfigError(f"checkpoint {path} does not fit the configured model: "
                          f"{mismatch_summary(wrong, missing, unexpected, 'checkpoint', shapes=1)}; "
                          "use the model config the checkpoint was trained with")


# --------------------------------------------------------------------------- the writer


class ConfigInCheckpoint(L.Callback):
    """Store the resolved run config and the class names in each checkpoint, so a checkpoint
    rebuilds its model alone (``vitpipe.run.checkpoint.rebuild``) and names its predictions.

    The config is resolved at ``setup``, not at construction: train() rescales the lr
    (``apply_lr_scaling``) after the Trainer exists, and the stored config must equal config.yaml.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.config: dict | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.config = stored_config(OmegaConf.to_container(self.cfg, resolve=True))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.config is None:
            self.setup(trainer, pl_module, "fit")
        checkpoint[CONFIG] = self.config
        names = getattr(trainer.datamodule, "class_names", None)
        checkpoint[CLASS_NAMES] = None if names is None else [str(n) for n in names]


def stored_config(config: dict) -> dict:
    """The resolved run config ``config`` as the writer stores it (config.yaml and every checkpoint):
    its data section through ``portable_data(reading=False)``."""
    if isinstance(config.get("data"), dict):
        config = {**config, "data": portable_data(config["data"], reading=False)}
    return config


# --------------------------------------------------------------------------- the rule for a stored config

# The only callables a stored config may name, per section: exact dotted names, derived from what
# conf/model, conf/data and conf/module use (tests/test_checkpoint.py keeps them in step), plus the
# plain torch optimizers a user may pick on the command line. Never a generic importer
# (hydra.utils.get_class / get_method, lightning's instantiate_class): they call whatever path they get.
_OPTIMIZERS = {"torch.optim.AdamW", "torch.optim.Adam", "torch.optim.SGD",
               "timm.scheduler.CosineLRScheduler", "timm.scheduler.PolyLRScheduler"} | {  # the two a budget fits
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
        "vitpipe.data.hf.HFDataModule",
    }),
    "module": frozenset({"vitpipe.lit.ImageClassifier", "vitpipe.lit.captioner.CaptionModule", "vitpipe.lit.mae.MAEModule",
                         *_OPTIMIZERS}),
}
# Hydra keys a stored config may carry; _args_, _recursive_, _convert_ (and any other _x_) are refused
_SPECIAL_KEYS_ALLOWED = {"_target_", "_partial_"}
# model keys that would read weights from elsewhere at build time; the checkpoint holds every weight
INIT_WEIGHT_KEYS = ("pretrained", "encoder_ckpt")
LOCAL_KEYS = ("cache_dir", "storage_options")  # where this machine keeps things: never from a stored config
_NOT_PATHS = ("_target_", "root")


def check_stored_config(checkpoint: dict, path) -> dict[str, dict | None]:
    """The stored ``model``, ``data`` and ``module`` sections, after checking that they name only
    ``ALLOWED_TARGETS``, use no other Hydra key and hold plain values without interpolations."""
    stored = config_of(checkpoint)
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
                                  f"of vitpipe's builders (vitpipe.run.stored.ALLOWED_TARGETS); nothing was called")
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


def data_path(value: str, root) -> str | None:
    """``value`` (a path named in a data section whose root is ``root``) relative to the root, normalised,
    when it lies inside it; None when it lies outside (absolute elsewhere, ``~``, or escaping with ``..``)."""
    value = posixpath.expanduser(value) if value.startswith("~") else value
    if posixpath.isabs(value):
        if not isinstance(root, str) or not root:
            return None
        base = posixpath.normpath(posixpath.abspath(posixpath.expanduser(root)))
        rel = posixpath.relpath(posixpath.normpath(value), base)
    else:
        rel = posixpath.normpath(value)
    if rel == ".." or rel.startswith("../") or posixpath.isabs(rel) or rel.startswith("~"):
        return None
    return rel


def portable_data(data: dict, *, reading: bool) -> dict:
    """A copy of the data section ``data`` with the path rule of the module docstring applied to every string
    it names besides ``_target_`` and ``root``: top-level values and ``splits.<split>.<key>``."""
    data = copy.deepcopy(data)
    root = data.get("root")

    def one(value):
        if not isinstance(value, str) or "://" in value or ("/" not in value and not value.startswith("~")):
            return value  # a plain word (folders, none, labels.csv) or a URL: no local place to move
        rel = data_path(value, root)
        if rel is not None:
            return rel
        if not reading:
            return value
        return posixpath.basename(posixpath.normpath(value)) or None

    for key, value in data.items():
        if key in LOCAL_KEYS:
            data[key] = None if reading else value
        elif key not in _NOT_PATHS and isinstance(value, str):
            data[key] = one(value)
    splits = data.get("splits")
    if isinstance(splits, dict):
        for spec in splits.values():
            if isinstance(spec, dict):
                for key, value in spec.items():
                    spec[key] = one(value)
    return data


def stored_data(data: dict, stored_paths, data_dir: str) -> dict:
    """The stored data section as this machine reads it: its paths through ``portable_data(reading=True)``,
    its root moved under the current ``paths.data_dir`` (kept relative to the old data_dir when it was
    under it, e.g. coco/)."""
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
