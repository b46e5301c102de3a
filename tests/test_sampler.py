"""ShardedSampler, the sampler every vitpipe loader uses: sharding over ranks (evaluation unpadded,
training padded to equal lengths), one permutation per (seed, epoch), the resume offset, and a DDP
trainer built from the shipped config leaving it in place."""

import math
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from vitpipe.config.build import build_trainer
from vitpipe.data.sampler import ShardedSampler
from vitpipe.errors import ConfigError

SIZES = [(n, world) for n in (1, 2, 5, 7, 10, 11) for world in (1, 2, 3, 4)]


def shards(n, world, **kwargs) -> list[list[int]]:
    return [list(ShardedSampler(n, num_replicas=world, rank=r, **kwargs)) for r in range(world)]


@pytest.mark.parametrize("n, world", SIZES)
def test_evaluation_shards_hold_every_index_exactly_once(n, world):
    parts = shards(n, world, shuffle=True, seed=3, pad=False)
    assert sorted(i for part in parts for i in part) == list(range(n))  # no padding, no repeats
    for r, part in enumerate(parts):
        assert len(ShardedSampler(n, num_replicas=world, rank=r, pad=False)) == len(part)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("n, world", SIZES)
def test_training_shards_are_equal_length_and_pad_from_the_head_of_the_order(n, world):
    sampler = ShardedSampler(n, num_replicas=1, rank=0, shuffle=True, seed=3)
    order = list(sampler)  # the epoch's permutation (one rank: nothing padded)
    parts = shards(n, world, shuffle=True, seed=3, pad=True)
    per_rank = math.ceil(n / world)
    assert [len(p) for p in parts] == [per_rank] * world  # DDP needs equal step counts
    assert all(len(ShardedSampler(n, num_replicas=world, rank=r)) == per_rank for r in range(world))
    seen = sorted(i for part in parts for i in part)
    assert set(seen) == set(range(n))  # every index at least once
    padded = (order * world)[: per_rank * world]  # the order, then its head again (wrapping if n < world)
    assert seen == sorted(padded)


def test_every_index_once_per_epoch_and_epochs_reshuffle():
    sampler = ShardedSampler(50, shuffle=True, seed=0)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
        assert sorted(orders[-1]) == list(range(50))
    assert orders[0] != orders[1] != orders[2] != orders[0]
    again = ShardedSampler(50, shuffle=True, seed=0)
    again.set_epoch(1)
    assert list(again) == orders[1]  # a pure function of (seed, epoch): a resumed run reads the same
    other_seed = ShardedSampler(50, shuffle=True, seed=1)
    other_seed.set_epoch(1)
    assert list(other_seed) != orders[1]
    assert list(ShardedSampler(6, shuffle=False)) == list(range(6))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_skip_resumes_mid_epoch_with_exactly_the_remaining_indices_once(world):
    for rank in range(world):
        sampler = ShardedSampler(23, num_replicas=world, rank=rank, shuffle=True, seed=5)
        sampler.set_epoch(2)
        full = list(sampler)
        sampler.skip = 4
        assert list(sampler) == full[4:]  # the samples this rank had not trained yet
        assert list(sampler) == full  # the offset applies once: the next pass is whole


# ---- under DDP the loaders keep vitpipe's sampler: Lightning's injection is off in every trainer config --


TRAINERS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "trainer").glob("*.yaml"))


def test_the_sampler_is_a_plain_sampler_and_every_trainer_config_turns_lightnings_injection_off(cfg_factory):
    # not a DistributedSampler: Lightning leaves it alone because it is told to, not because of its type
    assert not isinstance(ShardedSampler(4), DistributedSampler)
    assert len(TRAINERS) >= 6
    for name in TRAINERS:
        assert cfg_factory(f"trainer={name}").trainer.use_distributed_sampler is False, name


def test_a_ddp_trainer_from_the_shipped_config_keeps_each_loaders_sampler(cfg_factory):
    from hydra.utils import instantiate
    from lightning.pytorch.trainer.states import RunningStage

    for data in (["debug=fast"], ["experiment=caption_shapes", "data.num_train=16", "data.num_val=4"]):
        cfg = cfg_factory(*data, "trainer=ddp_cpu", "trainer.devices=2", "logger=none")
        trainer = build_trainer(cfg.trainer, logger=False)  # built, not launched: no processes yet
        assert trainer.world_size == 2 and trainer.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
        dm = instantiate(cfg.data)
        dm.setup("fit")
        dm.trainer = trainer  # rank 0 of 2
        for loader, stage in ((dm.train_dataloader(), RunningStage.TRAINING),
                              (dm.val_dataloader(), RunningStage.VALIDATING)):
            assert type(loader.sampler) is ShardedSampler and loader.sampler.num_replicas == 2, data
            # what Lightning's fit loop does with each loader before iterating it: here, nothing
            assert trainer._data_connector._prepare_dataloader(loader, shuffle=True, mode=stage) is loader
        train = dm.train_dataloader()
        assert len(train.sampler) == -(-len(train.dataset) // 2)  # this rank's half, not the whole split

    # with Lightning's injection on, it would wrap and shard the shard again: refused in one line
    cfg = cfg_factory("debug=fast", "trainer=ddp_cpu", "trainer.devices=2", "trainer.use_distributed_sampler=true")
    dm.trainer = build_trainer(cfg.trainer, logger=False)
    with pytest.raises(ConfigError, match=r"use_distributed_sampler=true: .*set trainer.use_distributed_sampler=false"):
        dm.train_dataloader()
