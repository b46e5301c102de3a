"""Check a composed config against what it will build, before anything is built or loaded.

A mistake such as ``data.batch_size=abc`` or ``module.optimizer.lr=-1`` used to surface after
the data had loaded, as a traceback that never named the key. Every check here raises a
``ConfigError`` of one line naming the key and the bad value:

- **arguments**: each node with a ``_target_`` is compared with the signature of what it builds:
  a value must fit the argument's annotation (``batch_size: int``), and a key the target does not
  take is refused (the partial optimizer would otherwise fail only once training starts);
- **ranges** that an annotation cannot say (``RANGES``: a learning rate > 0, batch sizes >= 1, a seed
  numpy takes, at least one epoch, ...), and ``module.mixup``'s settings (``check_mixup``: timm's
  ``Mixup`` asserts on them only at the first training batch);
- **finite numbers**: a NaN or an infinity anywhere in the model, data, module, trainer or lr_scaling
  groups (``weight_decay=inf`` passes torch's own ``>= 0`` check and stops the run at step 1);
- **the optimizer and scheduler** are built once on a dummy parameter, so their own checks
  (betas, eps, ...) run now;
- **a wandb logger** can start: online it needs an API key (wandb.init would stop at fit's start).

Only targets inside the libraries vitpipe builds from (``TRUSTED``) are looked up here; anything
else is left to the loaders' own checks and to ``hydra.utils.instantiate``: a config, possibly read
from a checkpoint, never makes this module import a package.
"""

from __future__ import annotations

import collections.abc
import difflib
import importlib
import inspect
import math
import os
import types
import typing
from typing import Any, Callable

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from vitpipe.errors import ConfigError

TRUSTED = ("vitpipe.", "torch.", "timm.", "lightning.")
HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    return _number(v) and math.isfinite(v)


def _between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: _finite(v) and (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)


SEED_MAX = 2**32 - 1  # numpy's bound: Lightning's seed_everything and the data splits seed numpy with it
_SEED = f"must be an integer in [0, {SEED_MAX}]"
_EPOCHS = "must be an integer >= 1, or -1 (no limit: trainer.max_steps ends the run)"

# key -> (holds, what a valid value is); a key a config does not have is not checked
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (lambda v: v is None or (_int(v) and 0 <= v <= SEED_MAX), f"{_SEED}, or null (PL_GLOBAL_SEED, else 0)"),
    "data.seed": (lambda v: _int(v) and 0 <= v <= SEED_MAX, _SEED),
    "module.optimizer.lr": (lambda v: _finite(v) and v > 0, "must be a number > 0 (finite)"),
    "module.optimizer.weight_decay": (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0 (0: none)"),
    "module.optimizer.eps": (lambda v: _finite(v) and v > 0, "must be a finite number > 0"),
    "module.optimizer.momentum": (_between(0, 1, hi_open=True), "must be in [0, 1)"),
    "module.scheduler.lr_min": (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0"),
    "module.scheduler.warmup_lr_init": (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0"),
    "data.batch_size": (lambda v: _int(v) and v >= 1, "must be a positive integer"),
    "data.eval_batch_size": (lambda v: v is None or (_int(v) and v >= 1), "must be a positive integer or null"),
    "data.num_workers": (lambda v: v is None or (_int(v) and v >= 0), "must be an integer >= 0, or null (auto)"),
    # 0 trains nothing: fit ends at once and there is no checkpoint to test
    "trainer.max_epochs": (lambda v: v is None or (_int(v) and (v >= 1 or v == -1)), f"{_EPOCHS}, or null"),
    "trainer.max_steps": (lambda v: _int(v) and (v >= 1 or v == -1), "must be an integer >= 1, or -1 (no limit)"),
    "trainer.limit_train_batches": (lambda v: v is None or (_int(v) and v >= 1) or
                                    (isinstance(v, float) and 0 < v <= 1),
                                    "must be an integer >= 1 (batches), a fraction in (0, 1], or null (all)"),
    "trainer.accumulate_grad_batches": (lambda v: _int(v) and v >= 1, "must be a positive integer"),
    "trainer.gradient_clip_val": (lambda v: v is None or (_finite(v) and v >= 0),
                                  "must be a finite number >= 0 (0 or null: no clipping)"),
    "lr_scaling.base_batch_size": (lambda v: _int(v) and v >= 1, "must be a positive integer"),
    "module.warmup_fraction": (_between(0, 1, hi_open=True), "must be in [0, 1)"),
    "module.label_smoothing": (_between(0, 1, hi_open=True), "must be in [0, 1)"),
    "module.ema_decay": (lambda v: v is None or _between(0, 1, lo_open=True, hi_open=True)(v),
                         "must be in (0, 1), or null for no EMA"),
    "module.threshold": (_between(0, 1, lo_open=True, hi_open=True), "must be a probability in (0, 1)"),
    # these two keep the words their modules' own checks have always used (tests and docs quote them)
    "module.layer_decay": (lambda v: v is None or _between(0, 1, lo_open=True)(v),
                           ": expected a number in (0, 1], or null (no layer decay)"),
    "module.mask_ratio": (_between(0, 1, hi_open=True), ": expected a fraction in [0, 1) (the paper's 0.75)"),
    "module.eval_seed": (lambda v: _int(v) and 0 <= v <= SEED_MAX, _SEED),
    "module.beam_size": (lambda v: _int(v) and v >= 1, "must be a positive integer (1: greedy)"),
    "module.max_gen_len": (lambda v: v is None or (_int(v) and v >= 1), "must be a positive integer, or null"),
    "model.drop_path_rate": (_between(0, 1, hi_open=True), "must be in [0, 1)"),
    "model.drop_rate": (_between(0, 1, hi_open=True), "must be in [0, 1)"),
    "model.attn_drop_rate": (_between(0, 1, hi_open=True), "must be in [0, 1)"),
}

# groups whose numbers are never meant to be NaN or infinite (a callback's threshold may be)
FINITE_GROUPS = ("model", "data", "module", "trainer", "lr_scaling")


def check_values(cfg: DictConfig) -> None:
    """All checks of this module; ``ConfigError`` (one line, naming the key) on the first failure."""
    try:
        for key in cfg:
            if key != "hydra":
                _walk(cfg[key], str(key))
        check_ranges(cfg)
        _dry_build_optimizer(cfg)
        check_wandb_login(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} must be set on the command line, e.g. {e.full_key}=<value>") from None
    except OmegaConfBaseException as e:  # a bad interpolation or a type OmegaConf refuses
        msg = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"{e.full_key}: {msg}" if getattr(e, "full_key", None) else msg) from None


_ABSENT = object()


def check_ranges(cfg: DictConfig) -> None:
    """``RANGES``, then ``module.mixup``, then no NaN or infinity in ``FINITE_GROUPS``: checks of values
    alone, which need nothing imported or read (part of ``check_values``)."""
    for key, (holds, valid) in RANGES.items():
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is not _ABSENT and not holds(value):
            raise ConfigError(f"{key}={_show(value)}{'' if valid.startswith(':') else ' '}{valid}")
    module = cfg.get("module")
    if isinstance(module, DictConfig) and "mixup" in module:
        check_mixup(module.mixup)
    for group in FINITE_GROUPS:
        node = cfg.get(group)
        if isinstance(node, (DictConfig, ListConfig)):
            _check_finite(OmegaConf.to_container(node, resolve=True), group)


def check_seed(cfg: DictConfig) -> None:
    """``cfg.seed`` as ``RANGES`` says, for an entry point that seeds before its other checks (evaluate)."""
    holds, valid = RANGES["seed"]
    if "seed" in cfg and not holds(cfg.seed):
        raise ConfigError(f"seed={_show(cfg.seed)} {valid}")


def _show(value) -> str:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else repr(value)


def _check_finite(value, key: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{key}.{i}")


MIXUP_MODES = ("batch", "pair", "elem")


def check_mixup(node) -> None:
    """``module.mixup``: null, or the keyword arguments of timm's ``Mixup`` (the module adds ``num_classes``
    and ``multi_label``), with timm's defaults for the keys left out (``mixup_alpha`` 1.0). timm checks none of
    them when built: a negative alpha, a probability above 1 or a mode it does not know stop the run at the
    first training batch, or are taken as "off" without a word."""
    if node is None or node is False:
        return
    if not isinstance(node, DictConfig):
        raise ConfigError(f"module.mixup={node!r} must be null or a group of timm Mixup settings, e.g. "
                          "module.mixup={mixup_alpha:0.8,cutmix_alpha:1.0}")
    from timm.data import Mixup

    valid = [k for k in inspect.signature(Mixup).parameters if k not in ("num_classes", "multi_label")]
    mixup = OmegaConf.to_container(node, resolve=True)
    for k, v in mixup.items():
        key = f"module.mixup.{k}"
        if k not in valid:
            raise ConfigError(f"{key} is not a setting of timm's Mixup{did_you_mean(k, valid, 'module.mixup.')}")
        if k in ("mixup_alpha", "cutmix_alpha") and not (_finite(v) and v >= 0):
            raise ConfigError(f"{key}={_show(v)} must be a finite number >= 0 (0: off)")
        if k in ("prob", "switch_prob") and not _between(0, 1)(v):
            raise ConfigError(f"{key}={_show(v)} must be a probability in [0, 1]")
        if k == "label_smoothing" and not _between(0, 1, hi_open=True)(v):
            raise ConfigError(f"{key}={_show(v)} must be in [0, 1)")
        if k == "mode" and v not in MIXUP_MODES:
            raise ConfigError(f"{key}={v!r}; valid choices: {', '.join(MIXUP_MODES)}")
        if k == "correct_lam" and not isinstance(v, bool):
            raise ConfigError(f"{key}={v!r} must be true or false")
        if k == "cutmix_minmax" and v is not None and not (
                isinstance(v, list) and len(v) == 2 and all(_between(0, 1, lo_open=True)(x) for x in v) and v[0] <= v[1]):
            raise ConfigError(f"{key}={v!r} must be null or [min, max] box ratios with 0 < min <= max <= 1")
    mixup_alpha, cutmix_alpha = mixup.get("mixup_alpha", 1.0), mixup.get("cutmix_alpha", 0.0)
    if mixup_alpha == 0 and cutmix_alpha == 0 and mixup.get("cutmix_minmax") is None:
        raise ConfigError("module.mixup turns neither on (mixup_alpha=0, cutmix_alpha=0): set one of them > 0, "
                          "or module.mixup=null for no mixup")


def _walk(node, key: str) -> None:
    if isinstance(node, DictConfig):
        target = _trusted_target(node)
        if target is not None:
            _check_arguments(node, key, target)
        for k in node:
            if k not in HYDRA_KEYS:
                _walk(node[k], f"{key}.{k}")
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            _walk(node[i], f"{key}.{i}")


def _trusted_target(node: DictConfig):
    path = node.get("_target_")
    if not isinstance(path, str) or not path.startswith(TRUSTED):
        return None
    module, _, name = path.rpartition(".")
    try:
        obj = importlib.import_module(module)
    except ImportError:  # a class path (a.b.Class.method) or a typo: instantiate reports it
        return None
    return getattr(obj, name, None)


def _check_arguments(node: DictConfig, key: str, target) -> None:
    hints, takes_any = _parameters(target)
    owner = getattr(target, "__name__", str(target))
    for k in node:
        if k in HYDRA_KEYS:
            continue
        if k not in hints:
            if not takes_any:
                raise ConfigError(f"{key}.{k} is not an argument of {owner}{did_you_mean(k, list(hints), f'{key}.')}")
            continue
        value = node[k]
        if isinstance(value, DictConfig) and "_target_" in value:
            continue  # built by instantiate; its own arguments are checked when walked
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        if not _fits(value, hints[k]):
            raise ConfigError(f"{key}.{k}={value!r}: {owner} expects {k}: {_name(hints[k])}")


def did_you_mean(name: str, valid: list[str], prefix: str = "", *, shown: int = 10) -> str:
    """``"; did you mean <prefix><closest>? (valid: a, b, ... and N more)"``: the tail of an unknown-key
    message, the closest valid name (difflib) first, then at most ``shown`` of them."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.7)  # 0.6 offers vit_s4 for vit_x99
    listed = ", ".join(valid[:shown]) + (f" and {len(valid) - shown} more" if len(valid) > shown else "")
    return (f"; did you mean {prefix}{close[0]}?" if close else "") + f" (valid: {listed})"


def _parameters(target) -> tuple[dict[str, Any], bool]:
    """(argument name -> annotation, whether it also takes arguments we cannot see).

    A class is read along its ``__init__`` chain while each takes ``**kwargs``. Only vitpipe's
    own classes are known to pass them to their base (a data module subclass to its base); another
    library's may hand them elsewhere (``DDPStrategy`` to ``DistributedDataParallel``), so its
    unknown keys are not refused. ``create_model`` passes its overrides to ``ViT``.
    """
    from vitpipe.models.registry import create_model
    from vitpipe.models.vit import ViT

    if target is create_model:
        funcs = [create_model, ViT.__init__]
    elif isinstance(target, type):
        funcs = [c.__dict__["__init__"] for c in target.__mro__ if "__init__" in c.__dict__ and c is not object]
    else:
        funcs = [target]
    passes_on = target is create_model or getattr(target, "__module__", "").startswith("vitpipe.")
    hints: dict[str, Any] = {}
    for f in funcs:
        try:
            params = inspect.signature(f).parameters.values()
            annotations = typing.get_type_hints(f)
        except Exception:  # noqa: BLE001 - no readable signature: judge nothing
            return hints, True
        for p in params:
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                hints.setdefault(p.name, annotations.get(p.name, Any))
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return hints, False  # this one takes nothing more: the whole chain is known
        if not passes_on:
            return hints, True
    return hints, True


def _fits(value, hint) -> bool:
    """Whether a config value (plain Python after resolution) can be this annotation. Anything the
    config cannot express (a Tensor, a Strategy object) is not judged."""
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _int(value)
    if hint is float:
        return _number(value)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence):
        return isinstance(value, (list, tuple))
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, dict)
    return True


def _name(hint) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")


def _dry_build_optimizer(cfg: DictConfig) -> None:
    """Build the configured partial optimizer (and scheduler) on one dummy parameter."""
    module = cfg.get("module")
    node = module.get("optimizer") if isinstance(module, DictConfig) else None
    target = _trusted_target(node) if isinstance(node, DictConfig) else None
    if not (isinstance(target, type) and issubclass(target, torch.optim.Optimizer)):
        return
    import hydra

    try:
        optimizer = hydra.utils.instantiate(node)([torch.nn.Parameter(torch.zeros(1))])
    except Exception as e:  # noqa: BLE001 - the optimizer's own message, with the key in front
        raise ConfigError(f"module.optimizer: {_first_line(e)}") from None
    sched = module.get("scheduler")
    if isinstance(sched, DictConfig) and str(sched.get("_target_", "")).startswith(("timm.scheduler.",
                                                                                    "torch.optim.lr_scheduler.")):
        # timm's get the step counts from the module; a torch LRScheduler takes the optimizer alone
        steps = {"t_initial": 10, "warmup_t": 1} if str(sched._target_).startswith("timm.") else {}
        try:
            hydra.utils.instantiate(sched)(optimizer, **steps)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"module.scheduler: {_first_line(e)}") from None


def check_wandb_login(cfg: DictConfig) -> None:
    """ConfigError when a wandb logger would run online without credentials: wandb.init would fail
    only once fit starts, in a 40-line traceback. Credentials are looked up as wandb.init does
    (WANDB_API_KEY, ~/.netrc, wandb's settings files), without the network; offline and disabled
    modes (``WANDB_MODE``, ``logger.wandb.offline=true``) need none."""
    loggers = cfg.get("logger") or {}
    online = [k for k, node in loggers.items() if isinstance(node, DictConfig)
              and str(node.get("_target_")).endswith(".WandbLogger") and not node.get("offline")
              and node.get("mode") not in ("offline", "dryrun", "disabled")]
    if not online:
        return
    from wandb.sdk import wandb_setup  # what wandb.init reads: the environment and the settings files

    # A look that leaves no trace: wandb.setup's singleton would freeze the environment of this moment
    # (WANDB_MODE included) for every later wandb.init of the process. Private names kept on purpose: wandb
    # has no public call that reads its settings without creating that singleton (wandb.setup(), and at
    # 0.31 wandb_setup.singleton(), create it); pyproject.toml's wandb floor and test_dependency_floors probe them
    current = wandb_setup._singleton
    look = current if current is not None and current._pid == os.getpid() else wandb_setup._WandbSetup(pid=os.getpid())
    settings = look.settings
    if settings.mode in ("offline", "dryrun", "disabled") or _wandb_credentials(settings):
        return
    raise ConfigError(f"logger.{online[0]}: no W&B API key found (WANDB_API_KEY, ~/.netrc); run `wandb login`, "
                      "or set WANDB_MODE=offline to log offline (`wandb sync` uploads the run later)")


def _wandb_credentials(settings) -> bool:
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk.lib.wbauth import authenticate
    except ImportError:  # an older wandb: its own lookup
        from wandb.sdk.lib import apikey

        return bool(apikey.api_key(settings=settings))
    try:
        return authenticate.authenticate_session(host=settings.base_url, source="vitpipe", prompt=False,
                                                 update_session=False) is not None
    except AuthenticationError as e:  # a key is there but malformed
        raise ConfigError(f"logger=wandb: {e}") from None


def _first_line(e: BaseException) -> str:
    while e.__cause__ is not None and type(e).__name__ == "InstantiationException":
        e = e.__cause__
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
