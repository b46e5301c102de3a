"""ShardedSampler, the sampler every classification loader uses: sharding over ranks (evaluation
unpadded, training padded to equal lengths), one permutation per (seed, epoch), and the resume offset."""

import math

import pytest

from vitpipe.data.sampler import ShardedSampler

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
