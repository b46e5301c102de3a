"""The one list of task kinds, and the two places a run's kind is chosen: from a config (train, the
LightningModule) or from a checkpoint's stored config (eval, predict, serve, export). A fifth kind is
its own file and one line in ``KINDS``."""

from __future__ import annotations

from collections.abc import Mapping

from vitpipe.errors import ConfigError
from vitpipe.kinds.base import TaskKind
from vitpipe.kinds.captioning import Captioning
from vitpipe.kinds.mae import MaskedAutoencoding
from vitpipe.kinds.multiclass import MultiClass
from vitpipe.kinds.multilabel import MultiLabel

KINDS: dict[str, TaskKind] = {k.name: k for k in (MultiClass(), MultiLabel(), Captioning(), MaskedAutoencoding())}
TASKS = tuple(k.name for k in KINDS.values() if k.classifies)  # the values module.task takes


def kind_named(name: str) -> TaskKind:
    """The kind registered as ``name``; ConfigError listing the names otherwise."""
    if name not in KINDS:
        raise ConfigError(f"no task kind {name!r}; valid choices: {', '.join(KINDS)}")
    return KINDS[name]


def classifier_kind(task: str) -> TaskKind:
    """The kind ``module.task`` names (multiclass | multilabel); ConfigError listing the valid tasks."""
    if task not in TASKS:
        raise ConfigError(f"module.task={task!r}; valid choices: {', '.join(TASKS)}")
    return KINDS[task]


def _module(cfg) -> Mapping | None:
    module = cfg.get("module") if isinstance(cfg, Mapping) else None
    return module if isinstance(module, Mapping) else None


def kind_of(cfg) -> TaskKind:
    """The kind a run config (a composed DictConfig or a plain dict with a ``module`` section) trains;
    ConfigError when its module selects none."""
    module = _module(cfg)
    if module is None:
        raise ConfigError("the config has no module section: cannot tell the task (module=classifier | captioner | mae)")
    found = _select(module)
    if found is None:
        task = f" module.task={module.get('task')}" if "task" in module else ""
        raise ConfigError(f"module._target_={module.get('_target_')}{task} trains no known task; "
                          f"valid kinds: {', '.join(KINDS)}")
    return found


def kind_of_checkpoint(checkpoint_or_config) -> TaskKind | None:
    """The kind a checkpoint (a dict holding ``vitpipe_config``) or its stored config trained; None when it
    stores no config or one that selects no kind (a file not written by vitpipe's train). The key is
    ``vitpipe.run.stored.CONFIG``, spelled here because kinds sit below ``run`` in the layers."""
    stored = checkpoint_or_config
    if isinstance(stored, Mapping) and "vitpipe_config" in stored:
        stored = stored["vitpipe_config"]
    module = _module(stored)
    return None if module is None else _select(module)


def _select(module: Mapping) -> TaskKind | None:
    plain = {k: module.get(k) for k in ("_target_", "task") if k in module}  # only the keys that choose: nothing else resolved
    found = [k for k in KINDS.values() if k.selected_by(plain)]
    return found[0] if len(found) == 1 else None
