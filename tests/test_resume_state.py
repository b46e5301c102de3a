"""ResumeState, the one object holding where a run's training data stream stands (epoch, position
in the epoch's order, augmentation RNG): round trip through a checkpoint and exact mid-epoch resume."""

import json
from types import SimpleNamespace

import torch

from vitpipe.data import DigitsDataModule
from vitpipe.data.resume import ResumeState


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
