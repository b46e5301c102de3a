"""Repeated augmentation (Hoffer et al. 2020; Berman et al. 2019), as DeiT trains with it.

DeiT's ``RASampler`` / timm's ``RepeatAugSampler``: the epoch's permutation has every image ``r``
times in a row, ``[a, a, a, b, b, b, ...]``, dealt round-robin over the ranks, so the copies of one
image land on different ranks (all different when ranks >= r) and each copy gets its own
augmentation. Each rank then keeps only the first ``ceil(N / ranks)`` of its share: the epoch has
the data set's length, i.e. about N / r distinct images, r views each.

Departure from timm: it rounds the kept count down to a multiple of 256 images (``selected_round``);
here the epoch keeps exactly the length the plain sampler has, so step counts, schedules and
``val_check_interval`` do not change when ``data.repeated_aug`` is switched on.
"""

from __future__ import annotations

import torch

from vitpipe.data.sampler import ShardedSampler


class RepeatedAugSampler(ShardedSampler):
    """``repeats`` copies of each image per epoch, spread over ranks; exact resume as ShardedSampler
    (the order is a pure function of (seed, epoch), ``skip`` drops what was already trained)."""

    def __init__(self, n: int, *, repeats: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0) -> None:
        super().__init__(n, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, pad=True)
        self.repeats = repeats

    def repeated_order(self) -> torch.Tensor:
        """All ranks' positions before the per-rank truncation: (ceil(r * n / ranks) * ranks,)."""
        order = self._order().repeat_interleave(self.repeats)  # (r * n,): copies adjacent
        total = -(-len(order) // self.num_replicas) * self.num_replicas
        return order.repeat(-(-total // len(order)))[:total]  # padded with the head, as timm

    def _indices(self) -> list[int]:
        share = self.repeated_order()[self.rank :: self.num_replicas]  # copies of one image: consecutive ranks
        return share[: len(self)].tolist()  # the data set's length per epoch
