"""A split carved out of a training set (validation; an image folder's test split when it has no test/):
a fraction or a count, fixed by a seed."""

import torch
from torch import Tensor

from vitpipe.errors import ConfigError


def check_val_split(value, key: str = "data.val_split") -> float | int:
    """A fraction in [0, 1) or a count >= 0, else ConfigError naming ``key``."""
    fraction = isinstance(value, float) and 0.0 <= value < 1.0
    count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if not (fraction or count):
        raise ConfigError(f"{key}={value!r}: expected a fraction in [0, 1) or a count >= 0")
    return value


def split_indices(n: int, val_split: float | int, seed: int, key: str = "data.val_split") -> tuple[Tensor, Tensor]:
    """(kept, carved) sorted indices into a training set of n, from a permutation seeded by ``seed``."""
    n_val = val_split if isinstance(val_split, int) else round(val_split * n)
    if n_val >= n:
        raise ConfigError(f"{key}={val_split} leaves no training images out of {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[n_val:].sort().values, perm[:n_val].sort().values
