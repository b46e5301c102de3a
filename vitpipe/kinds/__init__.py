"""Task kinds: multi-class, multi-label, captioning and MAE pre-training, each a small object behind one
interface (``vitpipe.kinds.base.TaskKind``), chosen once from a config or a checkpoint's stored config
(``vitpipe.kinds.registry``) and carried from there, instead of a flag re-read in every module."""

from vitpipe.kinds.base import TaskKind
from vitpipe.kinds.registry import KINDS, kind_named, kind_of, kind_of_checkpoint

__all__ = ["KINDS", "TaskKind", "kind_named", "kind_of", "kind_of_checkpoint"]
