"""Repeated augmentation (data.repeated_aug, DeiT's RASampler): r copies of each image per epoch,
spread over ranks, the epoch keeping the data set's length; independent views; exact resume."""

from collections import Counter

import pytest
import torch

from vitpipe.data import SyntheticDataModule
from vitpipe.data.repeated import RepeatedAugSampler
from vitpipe.data.shards import ShardsDataModule
from vitpipe.errors import ConfigError


def ranks(n, r, world=2, epoch=0, **kwargs):
    samplers = [RepeatedAugSampler(n, repeats=r, num_replicas=world, rank=k, seed=5, **kwargs) for k in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers


@pytest.mark.parametrize("n", [30, 31])
def test_each_index_r_times_before_truncation_copies_on_different_ranks(n):
    r, world = 3, 2
    samplers = ranks(n, r, world)
    whole = samplers[0].repeated_order().tolist()
    assert all(samplers[k].repeated_order().tolist() == whole for k in range(world))  # one order, every rank
    counts = Counter(whole[: r * n])  # before padding and truncation
    assert sorted(counts) == list(range(n)) and set(counts.values()) == {r}
    assert len(whole) - r * n == (-(r * n)) % world  # padding only to a multiple of the ranks
    untruncated = [whole[k::world] for k in range(world)]
    for i in range(n):  # r = 3 copies on 2 ranks: each image on both
        assert all(i in share for share in untruncated)
    epoch = [list(s) for s in samplers]
    assert [len(e) for e in epoch] == [-(-n // world)] * world  # the data set's length per epoch
    seen = Counter(i for e in epoch for i in e)
    assert abs(len(seen) - n / r) <= 2  # ~N/r distinct images...
    assert max(seen.values()) <= r and sum(v == r for v in seen.values()) >= len(seen) - 2  # ...r views each
    for i in seen:  # the copies an epoch trains on sit on different ranks (up to the wrap at the end)
        where = [k for k in range(world) for j in epoch[k] if j == i]
        assert len(set(where)) == min(len(where), world)
    assert epoch != [list(s) for s in ranks(n, r, world, epoch=1)]  # each epoch its own order


def test_one_rank_and_r_1_is_the_plain_order():
    (plain,) = ranks(10, 1, world=1)
    assert sorted(plain) == list(range(10))
    (rep,) = ranks(12, 3, world=1)
    out = list(rep)
    assert len(out) == 12 and all(out[3 * j] == out[3 * j + 1] == out[3 * j + 2] for j in range(4))


def test_resume_skips_what_was_trained():
    full = [list(s) for s in ranks(40, 3)]
    resumed = ranks(40, 3)
    for s in resumed:
        s.skip = 7
    assert [list(s) for s in resumed] == [f[7:] for f in full]
    assert [list(s) for s in resumed] == full  # the skip applies once


def test_views_of_one_image_differ_and_eval_is_unaffected():
    dm = SyntheticDataModule(img_size=32, in_chans=3, num_classes=4, channels=3, length=64, test_length=16,
                             batch_size=12, repeated_aug=3, seed=1)  # fmt: skip
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, RepeatedAugSampler) and len(loader.sampler) == len(dm.data_train)
    assert type(dm.val_dataloader().sampler).__name__ == "ShardedSampler"
    idx = list(loader.sampler)[:12]
    assert all(idx[3 * j] == idx[3 * j + 1] == idx[3 * j + 2] for j in range(4))
    x, _ = next(iter(loader))
    torch.manual_seed(0)
    views = dm.augment_batch(x, train=True).view(4, 3, -1)  # (image, copy, pixels)
    for v in views:  # three crops/flips of one image: pairwise different
        assert not torch.equal(v[0], v[1]) and not torch.equal(v[0], v[2]) and not torch.equal(v[1], v[2])


def test_combinations_it_cannot_honour_are_refused_in_one_line():
    from omegaconf import OmegaConf

    from vitpipe.config.preflight import check_data_arguments  # the config check, before the module is built

    args = dict(img_size=8, in_chans=1, num_classes=10, channels=1)
    digits = {"_target_": "vitpipe.data.digits.DigitsDataModule", **args}
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match=f"data.repeated_aug={bad!r}"):
            check_data_arguments(OmegaConf.create({**digits, "repeated_aug": bad}))
    with pytest.raises(ConfigError, match="data.sampler=balanced") as err:
        check_data_arguments(OmegaConf.create({**digits, "repeated_aug": 3, "sampler": "balanced"}))
    assert "\n" not in str(err.value)
    check_data_arguments(OmegaConf.create({**digits, "repeated_aug": 3}))  # alone it is fine
    with pytest.raises(ConfigError, match="not supported with data=shards"):
        ShardsDataModule(root="anywhere", repeated_aug=3, **args)
