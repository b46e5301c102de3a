"""Check a composed config's values against what they build, before anything is built or loaded.

A mistake such as ``data.batch_size=abc`` used to surface after the data had loaded, as a traceback that
never named the key. Each check here raises a ``ConfigError`` of one line naming the key and the value:

- **arguments** (``check_arguments``): each node with a ``_target_`` is compared with the signature of
  what it builds: a value must fit the argument's annotation (``batch_size: int``), and a key the target
  does not take is refused (the partial optimizer would otherwise fail only once training starts);
- **the optimizer and scheduler** (``dry_build_optimizer``) are built once on a dummy parameter, so their
  own checks (betas, eps, ...) run now;
- **a wandb logger** can start (``check_wandb_login``): online it needs an API key.

Ranges a signature cannot state are the schema's (``vitpipe.config.schema``); the rules across keys and the
one entry every script runs are ``vitpipe.tasks.preflight``'s. Only targets inside the libraries vitpipe
builds from (``TRUSTED``) are looked up here; anything else is left to the loaders' own checks and to
``hydra.utils.instantiate``: a config, possibly read from a checkpoint, never makes this module import a package.
"""

from __future__ import annotations

import collections.abc
import difflib
import importlib
import inspect
import os
import types
import typing
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from vitpipe.errors import ConfigError

TRUSTED = ("vitpipe.", "torch.", "timm.", "lightning.")
HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_arguments(cfg: DictConfig) -> None:
    """Every node with a trusted ``_target_`` against the signature of what it builds (the ``hydra`` node
    left out): ConfigError naming the key for a key the target does not take or a value its annotation
    refuses. OmegaConf's own errors (a missing value, a bad interpolation) pass to the caller."""
    for key in cfg:
        if key != "hydra":
            _walk(cfg[key], str(key))


def _walk(node, key: str) -> None:
    if isinstance(node, DictConfig):
        target = trusted_target(node)
        if target is not None:
            _check_arguments(node, key, target)
        for k in node:
            if k not in HYDRA_KEYS:
                _walk(node[k], f"{key}.{k}")
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            _walk(node[i], f"{key}.{i}")


def trusted_target(node: DictConfig):
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
    from vitpipe.config.build import VITPIPE_TRAINER_KEYS

    hints, takes_any = _parameters(target)
    owner = getattr(target, "__name__", str(target))
    ours = VITPIPE_TRAINER_KEYS if key == "trainer" else ()  # read by vitpipe, not passed to Lightning
    for k in node:
        if k in HYDRA_KEYS or k in ours:
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


def dry_build_optimizer(cfg: DictConfig) -> None:
    """Build the configured partial optimizer (and scheduler) on one dummy parameter."""
    import torch  # here, not at import: the command-line check (vitpipe.tasks.cli) reads this module before torch loads

    module = cfg.get("module")
    node = module.get("optimizer") if isinstance(module, DictConfig) else None
    target = trusted_target(node) if isinstance(node, DictConfig) else None
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


def check_class_counts(model_n, data_n) -> None:
    """``model.num_classes`` follows ``data.num_classes`` unless overridden; an override that differs is one line
    (the preflight's rule, and the command line's where both are written plainly)."""
    if model_n is not None and data_n is not None and model_n != data_n:
        raise ConfigError(f"model.num_classes={model_n} does not match data.num_classes={data_n}; "
                          f"drop the model.num_classes override (it follows the data) or fix data.num_classes")


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


TEACHER_WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")  # module.distill.teacher as a weights file


def check_teacher_file(spec) -> None:
    """A ``module.distill.teacher`` named as a weights file must exist (a recipe's teacher lives in a checkout's
    ``assets/``, not in the wheel); other specs (run dirs, exports, timm names) are resolved when loaded."""
    if isinstance(spec, str) and spec.endswith(TEACHER_WEIGHT_SUFFIXES) and not os.path.isfile(spec):
        raise ConfigError(f"module.distill.teacher={spec}: no such file; give the teacher's path, or "
                          "module.distill=null to train without one")


def check_precompute(data: dict, mixup) -> None:
    """Precomputed targets fit a training view only if it is the image or its mirror: a setting that makes
    other views (``data``'s crop padding, random erasing, RandAugment, the MAE crops; ``mixup``) is refused."""
    if mixup:
        raise ConfigError("module.distill.precompute=true stores the teacher's logits of unmixed images; "
                          "set module.mixup=null or module.distill.precompute=false")
    if not data.get("augment", True):
        return  # no augmentation: every view is the image itself
    others = {"crop_padding": 0, "random_erasing": 0.0, "auto_augment": None}
    for key, off in others.items():
        value = data.get(key, off)
        if value not in (off, None, "none", 0):
            raise ConfigError(f"module.distill.precompute=true stores the teacher's logits of each image and its mirror, "
                              f"but data.{key}={value} makes other views; set data.{key}={off if off is not None else 'null'} "
                              "or module.distill.precompute=false")
    if data.get("augment") == "mae":
        raise ConfigError("module.distill.precompute=true cannot follow data.augment=mae's random crops; "
                          "set module.distill.precompute=false")
