"""ResumeState, the one object holding where a run's training data stream stands (epoch, position
in the epoch's order, augmentation RNG): round trip through a checkpoint and exact mid-epoch resume.
And the global generators' per-rank states a checkpoint keeps beside it."""

import json
import random
from types import SimpleNamespace

import numpy as np
import torch
from lightning.pytorch.utilities.seed import isolate_rng

from vitpipe.data import DigitsDataModule
from vitpipe.data.captions import ShapesCaptionDataModule
from vitpipe.data.resume import RNG_KEY, ResumeState, rank_rng_state, rng_state, set_rng_state


def fake_trainer(*, epoch=1, processed=2, ready=9, batches=5, rank=0, world=1):
    """The fit-loop counters Lightning checkpoints, as ResumeState reads them."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed), total=SimpleNamespace(ready=ready))
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
                           current_epoch=epoch, num_training_batches=batches, global_rank=rank,
                           world_size=world, training=True)  # fmt: skip


def test_state_dict_round_trip_is_plain_data():
    state = ResumeState(seed=4)
    assert state.observe(fake_trainer(epoch=3, processed=2, ready=17))
    saved = state.state_dict()
    assert saved == {"epoch": 3, "batches_done_in_epoch": 2, "step": 17}
    assert json.loads(json.dumps(saved)) == saved  # fits a weights-only checkpoint
    restored = ResumeState(seed=4)
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved
    assert not ResumeState().observe(None)  # no trainer: nothing to copy


def test_a_finished_epoch_resumes_at_the_start_of_the_next():
    state = ResumeState()
    state.observe(fake_trainer(processed=5, batches=5))
    assert state.batches_done == 0


def test_restored_position_is_skipped_once():
    state = ResumeState()
    state.load_state_dict({"epoch": 1, "batches_done_in_epoch": 3, "step": 8})
    assert state.take_offset(batch_size=16) == 48
    assert state.take_offset(batch_size=16) == 0


def test_augmentation_generator_depends_on_seed_rank_and_step_only():
    def draws(seed, rank, step):
        state = ResumeState(seed)
        state.observe(fake_trainer(ready=step))
        return torch.rand(8, generator=state.generator("cpu", rank))

    assert torch.equal(draws(0, 0, 5), draws(0, 0, 5))  # a resumed run draws the same
    assert not torch.equal(draws(0, 0, 5), draws(0, 0, 6))  # each batch its own
    assert not torch.equal(draws(0, 0, 5), draws(0, 1, 5))  # ranks differ
    assert not torch.equal(draws(0, 0, 5), draws(1, 0, 5))


def test_datamodule_resumed_mid_epoch_yields_exactly_the_remaining_batches():
    def module():
        dm = DigitsDataModule(img_size=8, in_chans=1, num_classes=10, channels=1, batch_size=100, seed=7)
        dm.setup("fit")
        return dm

    first = module()
    first.trainer = fake_trainer(epoch=1, processed=3, batches=13)
    loader = first.train_dataloader()
    loader.sampler.set_epoch(1)  # what Lightning does at each epoch start
    whole_epoch = [y for _, y in loader]
    saved = first.state_dict()  # written by a checkpoint after 3 batches of epoch 1
    assert saved["batches_done_in_epoch"] == 3

    resumed = module()
    resumed.trainer = fake_trainer(epoch=1)
    resumed.load_state_dict(saved)
    loader = resumed.train_dataloader()
    loader.sampler.set_epoch(1)
    rest = [y for _, y in loader]
    assert len(rest) == len(whole_epoch) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, whole_epoch[3:]))
    assert len([y for _, y in loader]) == len(whole_epoch)  # the next epoch is whole again


# ---- the global random streams: per-rank states in the checkpoint --------------------------------


def _draws() -> tuple:
    """One draw from every global generator a training step uses (torch: drop path; numpy: mixup)."""
    return torch.rand(4).tolist(), np.random.rand(3).tolist(), np.random.beta(0.8, 0.8), random.random()


@isolate_rng()  # this test reseeds the global generators; others keep theirs
def test_per_rank_generator_states_round_trip_through_a_weights_only_load(tmp_path):
    states, expected = [], []
    for rank in range(2):  # two "ranks": each its own streams, as after seeding per rank and drawing
        torch.manual_seed(rank), np.random.seed(100 + rank), random.seed(200 + rank)
        _draws()
        states.append(rng_state())
        expected.append(_draws())  # what this rank draws next in the run that never stopped
    assert expected[0] != expected[1]
    torch.save({RNG_KEY: states, "global_step": 8}, tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)[RNG_KEY]  # plain data only

    for rank in (1, 0):
        torch.manual_seed(7), np.random.seed(7), random.seed(7)  # a resumed process, seeded anew
        state, why = rank_rng_state(saved, rank, world_size=2)
        assert why is None
        set_rng_state(state)
        assert _draws() == expected[rank]  # each rank continues its own streams


def test_missing_or_foreign_generator_states_start_fresh_with_a_reason():
    one = [rng_state()]
    assert rank_rng_state(None, 0, 1) == (None, "the checkpoint holds no random-generator state")
    state, why = rank_rng_state(one, 0, world_size=2)
    assert state is None and why == "the checkpoint holds the random generators of 1 process(es), this run has 2"
    assert rank_rng_state(one, 0, world_size=1) == (one[0], None)


def test_loaders_make_iterators_without_drawing_from_torchs_global_generator():
    digits = DigitsDataModule(img_size=8, in_chans=1, num_classes=10, channels=1, batch_size=100, seed=7)
    shapes = ShapesCaptionDataModule(num_train=8, num_val=2, num_test=2, batch_size=4)
    loaders = []
    for dm in (digits, shapes):
        dm.setup("fit")
        loaders += [dm.train_dataloader(), dm.val_dataloader()]
    before = torch.get_rng_state()
    for loader in loaders:
        iter(loader)  # a DataLoader without its own generator draws its workers' base seed here
    assert torch.equal(torch.get_rng_state(), before)


def test_resumed_loader_with_workers_reads_the_resumed_epochs_order():
    """Lightning makes a resumed run's first iterator before its first ``set_epoch``, and a loader with
    workers draws its indices right then: the training sampler must already stand at the resumed epoch."""
    def module():
        dm = DigitsDataModule(img_size=8, in_chans=1, num_classes=10, channels=1, batch_size=100, seed=7,
                              fast_path=False, num_workers=1, augment=False)
        dm.setup("fit")
        return dm

    first = module()
    first.trainer = fake_trainer(epoch=1, processed=3, batches=13)
    loader = first.train_dataloader()
    loader.sampler.set_epoch(1)
    whole_epoch = [x for x, _ in loader]

    resumed = module()
    resumed.trainer = fake_trainer(epoch=1)
    resumed.load_state_dict(first.state_dict())
    loader = resumed.train_dataloader()
    batches = iter(loader)  # as Lightning's fit loop: the iterator first, then set_epoch
    loader.sampler.set_epoch(1)
    rest = [x for x, _ in batches]
    assert len(rest) == len(whole_epoch) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, whole_epoch[3:]))
