"""A sampler that shards over ranks itself and resumes mid-epoch.

Every vitpipe loader brings its own sampler and Lightning's ``DistributedSampler`` injection is
off (``use_distributed_sampler: false`` in conf/trainer/default.yaml, which every trainer config
inherits), so this one decides three things the injected one gets wrong for us:
- evaluation shards are not padded, so validation accuracy counts every image exactly once;
- the order is a pure function of (seed, epoch), so a resumed run sees the same batches;
- ``skip`` drops the batches an interrupted epoch already trained on (exact resume after a kill).
"""

from __future__ import annotations

import torch
from torch.utils.data import Sampler

from vitpipe.errors import ConfigError


def rank_layout(trainer) -> tuple[int, int]:
    """(world size, global rank) a loader shards for: (1, 0) without a trainer.

    Under DDP with Lightning's ``use_distributed_sampler`` on, Lightning would wrap the sampler in a
    ``DistributedSamplerWrapper`` and shard its shard again (each rank would train on 1/world of
    its share): that is refused in one line.
    """
    if trainer is None:
        return 1, 0
    # Private on purpose: Lightning (2.6) has no public accessor for Trainer(use_distributed_sampler=); its own
    # data connector reads it from here too. Absent on the tests' stand-in trainers.
    connector = getattr(trainer, "_accelerator_connector", None)
    if trainer.world_size > 1 and getattr(connector, "use_distributed_sampler", False):
        raise ConfigError("trainer.use_distributed_sampler=true: Lightning would shard again what vitpipe's "
                          "sampler already shards per rank; set trainer.use_distributed_sampler=false "
                          "(conf/trainer/default.yaml)")  # fmt: skip
    return trainer.world_size, trainer.global_rank


class ShardedSampler(Sampler[int]):
    """Indices of one rank's shard: ``order[rank::num_replicas]``, from ``skip`` on.

    Training (``pad=True``) repeats the head of the order so every rank gets the same count,
    as DistributedSampler does (DDP needs equal step counts); evaluation (``pad=False``) does not.
    Lightning calls ``set_epoch`` at every epoch start, as for its own sampler.
    """

    def __init__(self, n: int, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
                 pad: bool = True) -> None:
        super().__init__()
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.pad, self.epoch = shuffle, seed, pad, 0
        self.skip = 0  # samples of this rank's shard to drop once, on the next __iter__

    def _order(self) -> torch.Tensor:
        """The epoch's order of all ``n`` positions, before sharding (subclasses draw others)."""
        if self.shuffle:
            return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return torch.arange(self.n)

    def _indices(self) -> list[int]:
        order = self._order()
        if self.pad and self.n % self.num_replicas:
            total = len(self) * self.num_replicas
            order = order.repeat(-(-total // self.n))[:total]  # the head again (wrapping if n < ranks)
        return order[self.rank :: self.num_replicas].tolist()

    def __iter__(self):
        indices, skip = self._indices(), self.skip
        self.skip = 0
        return iter(indices[skip:])

    def __len__(self) -> int:
        if self.pad:
            return -(-self.n // self.num_replicas)
        return len(range(self.rank, self.n, self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
