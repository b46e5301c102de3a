"""How many DataLoader worker processes: the user's number, or one chosen from this machine's CPUs.

``num_workers: null`` (the default of the data sets read from files) asks Lightning's
``suggested_max_num_workers``: the CPUs this process may use, divided among the processes of this node
(DDP: one per device), minus one for each main process, at least 1. On 2 cores that is 1 worker, below
PyTorch's "this DataLoader will create N worker processes ... greater than the suggested max" warning,
and at Lightning's own suggestion, so neither warns.
"""

from __future__ import annotations

from lightning.fabric.utilities.data import suggested_max_num_workers


def resolve_num_workers(num_workers: int | None, local_world_size: int = 1) -> int:
    """``num_workers`` if set, else the suggestion for ``local_world_size`` processes on this node."""
    if num_workers is not None:
        return int(num_workers)
    return suggested_max_num_workers(max(1, int(local_world_size)))


def local_world_size(trainer) -> int:
    """Processes sharing this node's CPUs: the trainer's devices per node (1 without a trainer)."""
    return int(getattr(trainer, "num_devices", 1) or 1) if trainer is not None else 1
