"""Imbalanced classes: per-class counts of a split, balanced loss weights, a class-balanced sampler.

Two remedies, each on its own switch:
- ``module.class_weights=balanced``: weight the cross-entropy by inverse class frequency
  (``n / (C * n_c)``, scikit-learn's "balanced": the mean weight per training image is 1);
- ``data.sampler=balanced``: draw training images with probability inverse to their class
  frequency, so every class is seen equally often per epoch on average (with replacement).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vitpipe.data.sampler import ShardedSampler
from vitpipe.errors import ConfigError


def dataset_labels(ds: Dataset) -> Tensor:
    """(N,) int64 labels of a prepared split without loading images: a tensor-held split's
    ``labels``, or the ``targets`` of the data set under a subset wrapper (torchvision sets)."""
    labels = getattr(ds, "labels", None)
    if isinstance(labels, Tensor):
        return labels.long()
    base = getattr(ds, "base", None)
    targets = getattr(base, "targets", None) if base is not None else getattr(ds, "targets", None)
    if targets is None:
        raise ConfigError(f"{type(ds).__name__} does not expose its labels; class balancing needs them")
    targets = torch.as_tensor(targets, dtype=torch.long)
    indices = getattr(ds, "indices", None)
    return targets if indices is None else targets[torch.as_tensor(indices, dtype=torch.long)]


def class_counts(labels: Tensor, num_classes: int) -> Tensor:
    """(num_classes,) int64 images per class."""
    return torch.bincount(labels, minlength=num_classes)[:num_classes]


def balanced_class_weights(counts: Tensor) -> Tensor:
    """(C,) float: ``n / (C_present * n_c)`` for present classes, 0 for classes with no images."""
    counts = counts.double()
    present = counts > 0
    weights = torch.zeros_like(counts)
    weights[present] = counts.sum() / (present.sum() * counts[present])
    return weights.float()


class BalancedSampler(ShardedSampler):
    """A class-balanced epoch of ``len(labels)`` draws (with replacement, probability ~ 1 / n_class),
    sharded over ranks like ShardedSampler: a pure function of (seed, epoch), so a resumed run
    draws the same epoch and ``skip`` drops what was already trained on."""

    def __init__(self, labels: Tensor, *, num_replicas: int = 1, rank: int = 0, seed: int = 0) -> None:
        super().__init__(len(labels), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, pad=True)
        counts = torch.bincount(labels).double()
        self.weights = (1.0 / counts)[labels]  # (N,) per image

    def _order(self) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.multinomial(self.weights, self.n, replacement=True, generator=gen)
