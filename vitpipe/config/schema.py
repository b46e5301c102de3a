"""The schema of a training config's plain values: each key's type and range, one dataclass per group.

Types are checked by OmegaConf's structured configs (``OmegaConf.merge`` of the group's dataclass with the
value: a string where an ``int`` belongs, a bool for a float, is refused there); ranges, which OmegaConf
cannot state, by the predicate each field carries. Why not a Hydra ``defaults:`` entry in the group yaml
files: a schema there is in struct mode and must declare every key of every option of the group (each
data module's arguments, Lightning's Trainer's), and its type errors stop Hydra's composition with Hydra's
own multi-line message and exit status 1, before vitpipe can name the key in one line. Here the schema is
merged open (keys it does not declare pass untouched) by ``check_schema``, which the one config check
(``vitpipe.config.preflight``) runs. A key a config does not have is not checked. It needs only OmegaConf,
so a command's command line is held to it too before the command's body (torch, Lightning) is imported
(``vitpipe.tasks.cli.command_line_mistake``): ``data.batch_size=abc`` is its line in a second.

Also here: ``module.mixup`` (timm's ``Mixup`` settings, checked nowhere by timm until the first batch) and
no NaN or infinity in the groups whose numbers are never meant to be (``FINITE_GROUPS``).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ValidationError

from vitpipe.config.checks import did_you_mean
from vitpipe.errors import ConfigError


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: _finite(v) and (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)


def _duration(v) -> bool:
    from vitpipe.config.duration import parse_duration

    try:
        return parse_duration(v) is not None
    except ValueError:
        return False


def _opt(holds: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or holds(v)


def key(holds: Callable[[Any], bool], valid: str):
    """A schema field: ``holds(value)`` is its range; ``valid`` follows ``key=value`` in the error
    (with its own separator: `` must be ...`` or ``: expected ...``)."""
    return field(default=MISSING, metadata={"holds": holds, "valid": valid})  # "???": only what a config sets


SEED_MAX = 2**32 - 1  # numpy's bound: Lightning's seed_everything and the data splits seed numpy with it
_SEED = f" must be an integer in [0, {SEED_MAX}]"
_SEEDED = lambda v: _int(v) and 0 <= v <= SEED_MAX  # noqa: E731
_POSITIVE = (lambda v: _int(v) and v >= 1, " must be a positive integer")
_FRACTION = (_between(0, 1, hi_open=True), " must be in [0, 1)")
_NONNEGATIVE = (lambda v: _finite(v) and v >= 0, " must be a finite number >= 0")
_STEPS = lambda v: _int(v) and (v >= 1 or v == -1)  # noqa: E731  (0 trains nothing: no checkpoint to test)
_EPOCHS = " must be an integer >= 1, or -1 (no limit: trainer.max_steps ends the run)"


@dataclass
class Top:
    seed: int | None = key(_opt(_SEEDED), f"{_SEED}, or null (PL_GLOBAL_SEED, else 0)")


@dataclass
class Data:
    seed: int = key(_SEEDED, _SEED)
    batch_size: int = key(*_POSITIVE)
    eval_batch_size: int | None = key(_opt(_POSITIVE[0]), " must be a positive integer or null")
    num_workers: int | None = key(_opt(lambda v: _int(v) and v >= 0), " must be an integer >= 0, or null (auto)")
    shuffle_buffer: int = key(*_POSITIVE)  # data=hf streaming
    num_samples: int | None = key(_opt(_POSITIVE[0]), " must be a positive integer (examples per epoch), or null")


@dataclass
class Optimizer:
    lr: float = key(lambda v: _finite(v) and v > 0, " must be a number > 0 (finite)")
    weight_decay: float = key(_NONNEGATIVE[0], f"{_NONNEGATIVE[1]} (0: none)")
    eps: float = key(lambda v: _finite(v) and v > 0, " must be a finite number > 0")
    momentum: float = key(*_FRACTION)


@dataclass
class Scheduler:
    lr_min: float = key(*_NONNEGATIVE)
    warmup_lr_init: float = key(*_NONNEGATIVE)


@dataclass
class Module:
    warmup_fraction: float = key(*_FRACTION)
    label_smoothing: float = key(*_FRACTION)
    ema_decay: float | None = key(_opt(_between(0, 1, lo_open=True, hi_open=True)), " must be in (0, 1), or null for no EMA")
    threshold: float = key(_between(0, 1, lo_open=True, hi_open=True), " must be a probability in (0, 1)")
    # these two keep the words their modules' own checks have always used (tests and docs quote them)
    layer_decay: float | None = key(_opt(_between(0, 1, lo_open=True)),
                                    ": expected a number in (0, 1], or null (no layer decay)")
    mask_ratio: float = key(_between(0, 1, hi_open=True), ": expected a fraction in [0, 1) (the paper's 0.75)")
    eval_seed: int = key(_SEEDED, _SEED)
    beam_size: int = key(_POSITIVE[0], " must be a positive integer (1: greedy)")
    max_gen_len: int | None = key(_opt(_POSITIVE[0]), " must be a positive integer, or null")


@dataclass
class Lora:
    r: int = key(_POSITIVE[0], " must be a positive integer (the adapters' rank), e.g. 16")
    alpha: float = key(lambda v: _finite(v) and v > 0, " must be a number > 0 (the adapters scale by alpha / r)")
    dropout: float = key(*_FRACTION)


@dataclass
class Trainer:
    max_epochs: int | None = key(_opt(_STEPS), f"{_EPOCHS}, or null")
    max_steps: int = key(_STEPS, " must be an integer >= 1, or -1 (no limit)")
    # an int (batches) or a float (a fraction): no OmegaConf type says that; Any
    limit_train_batches: Any = key(_opt(lambda v: (_int(v) and v >= 1) or (isinstance(v, float) and 0 < v <= 1)),
                                   " must be an integer >= 1 (batches), a fraction in (0, 1], or null (all)")
    accumulate_grad_batches: int = key(*_POSITIVE)
    time_budget: Any = key(_opt(_duration), ": expected a duration such as 30min, 2h, 1h30min, 90s, "
                           "a number of seconds, or null")
    gradient_clip_val: float | None = key(_opt(_NONNEGATIVE[0]), f"{_NONNEGATIVE[1]} (0 or null: no clipping)")


@dataclass
class LrScaling:
    base_batch_size: int = key(*_POSITIVE)


@dataclass
class Model:
    drop_path_rate: float = key(*_FRACTION)
    drop_rate: float = key(*_FRACTION)
    attn_drop_rate: float = key(*_FRACTION)
    norm_eps: float = key(_between(0, 1, lo_open=True, hi_open=True), " must be in (0, 1), e.g. 1e-6 (ViT) or 1e-5 (CLIP)")
    rope_base: float = key(lambda v: _finite(v) and v > 0, " must be a finite number > 0 (10000: RoFormer)")


# where each schema applies, in the order they are checked ("": the config's top level)
SCHEMAS: dict[str, type] = {"": Top, "data": Data, "module.optimizer": Optimizer, "module.scheduler": Scheduler,
                            "trainer": Trainer, "lr_scaling": LrScaling, "module": Module, "model": Model,
                            "module.lora": Lora}

# groups whose numbers are never meant to be NaN or infinite (a callback's threshold may be)
FINITE_GROUPS = ("model", "data", "module", "trainer", "lr_scaling")

# what each command's config holds of the schema (None: all of it), for ``check_schema``'s ``where``: its
# preflight (``vitpipe.config.preflight``) and, before the command's body is imported, its command line's
# check (``vitpipe.tasks.cli.command_line_mistake``); the other commands read a stored run's config
ENTRY_SCHEMAS: dict[str, tuple[str, ...] | None] = {"train": None, "eval": ("",), "doctor": ("", "model")}


def written_plainly(node: DictConfig, key: str) -> bool:
    """``node.key`` is set to a plain value, not missing and not an interpolation: reading it resolves
    nothing (``key in node`` would: it resolves the value)."""
    return (key in node.keys() and not OmegaConf.is_missing(node, key)  # noqa: SIM118
            and not OmegaConf.is_interpolation(node, key))


def check_schema(cfg: DictConfig, where: tuple[str, ...] | None = None, *, plain_only: bool = False) -> None:
    """Every ``SCHEMAS`` field the config has (only those at ``where``, e.g. ``("",)`` for the seed of an
    eval config), then ``module.mixup``, then no NaN or infinity in ``FINITE_GROUPS`` (all of them only when
    ``where`` is None). ConfigError (one line: ``key=value`` and what is valid) on the first failure.

    ``plain_only``: the fields set to a plain value, nothing resolved, and nothing after them: what a command
    line is held to before the command's body is imported (``vitpipe.tasks.cli.command_line_mistake``), since
    resolving ``${variant:...}`` imports the model code; the run's own check (``preflight``) does the rest."""
    for path, schema in SCHEMAS.items():
        if where is not None and path not in where:
            continue
        node = cfg if not path else OmegaConf.select(cfg, path, default=None)
        if not isinstance(node, DictConfig):
            continue
        for f in fields(schema):
            if plain_only and not written_plainly(node, f.name):
                continue
            if not plain_only and f.name not in node:
                continue
            value = node[f.name]
            if isinstance(value, (DictConfig, ListConfig)):
                if plain_only:  # it may hold interpolations
                    continue
                value = OmegaConf.to_container(value, resolve=True)
            if not (_typed(schema, f.name, value) and f.metadata["holds"](value)):
                raise ConfigError(f"{path + '.' if path else ''}{f.name}={_show(value)}{f.metadata['valid']}")
    if where is not None or plain_only:
        return
    module = cfg.get("module")
    if isinstance(module, DictConfig) and "mixup" in module:
        check_mixup(module.mixup)
    for group in FINITE_GROUPS:
        node = cfg.get(group)
        if isinstance(node, (DictConfig, ListConfig)):
            _check_finite(OmegaConf.to_container(node, resolve=True), group)


@functools.cache
def _structured(schema: type) -> DictConfig:
    return OmegaConf.structured(schema)


def _typed(schema: type, name: str, value) -> bool:
    """Whether OmegaConf takes ``value`` for the field's type (the merge is thrown away: the value is used
    as given, so a quoted "3" OmegaConf would convert still meets the field's own predicate as a string)."""
    try:
        OmegaConf.merge(_structured(schema), {name: value})
    except ValidationError:
        return False
    return True


def _show(value) -> str:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else repr(value)


def _check_finite(value, path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}={value} must be a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{path}.{i}")


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
        name = f"module.mixup.{k}"
        if k not in valid:
            raise ConfigError(f"{name} is not a setting of timm's Mixup{did_you_mean(k, valid, 'module.mixup.')}")
        if k in ("mixup_alpha", "cutmix_alpha") and not (_finite(v) and v >= 0):
            raise ConfigError(f"{name}={_show(v)} must be a finite number >= 0 (0: off)")
        if k in ("prob", "switch_prob") and not _between(0, 1)(v):
            raise ConfigError(f"{name}={_show(v)} must be a probability in [0, 1]")
        if k == "label_smoothing" and not _between(0, 1, hi_open=True)(v):
            raise ConfigError(f"{name}={_show(v)} must be in [0, 1)")
        if k == "mode" and v not in MIXUP_MODES:
            raise ConfigError(f"{name}={v!r}; valid choices: {', '.join(MIXUP_MODES)}")
        if k == "correct_lam" and not isinstance(v, bool):
            raise ConfigError(f"{name}={v!r} must be true or false")
        if k == "cutmix_minmax" and v is not None and not (
                isinstance(v, list) and len(v) == 2 and all(_between(0, 1, lo_open=True)(x) for x in v) and v[0] <= v[1]):
            raise ConfigError(f"{name}={v!r} must be null or [min, max] box ratios with 0 < min <= max <= 1")
    mixup_alpha, cutmix_alpha = mixup.get("mixup_alpha", 1.0), mixup.get("cutmix_alpha", 0.0)
    if mixup_alpha == 0 and cutmix_alpha == 0 and mixup.get("cutmix_minmax") is None:
        raise ConfigError("module.mixup turns neither on (mixup_alpha=0, cutmix_alpha=0): set one of them > 0, "
                          "or module.mixup=null for no mixup")
