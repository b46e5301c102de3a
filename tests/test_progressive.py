"""Progressive resolution (vitpipe.lit.progressive): image and batch sizes per epoch range, loaders rebuilt
at a batch-size change, the data config's sizes back after fit, one-line errors."""

from __future__ import annotations

import lightning as L
import pytest
from conftest import make_cfg

from vitpipe.lit.progressive import ProgressiveResolution


class Probe(L.Callback):
    def __init__(self):
        self.train, self.val, self.test = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train.append((trainer.current_epoch, tuple(batch[0].shape)))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.val.append((trainer.current_epoch, tuple(batch[0].shape[-2:])))

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.test.append(tuple(batch[0].shape[-2:]))


def test_sizes_follow_the_schedule_and_return_after_fit(tmp_path):
    from vitpipe.run.build import build_from_config

    cfg = make_cfg(tmp_path, ["debug=fast", "logger=none"])  # vit_nano: 8x8 digits, patch 2
    dm, _, module = build_from_config(cfg)
    probe = Probe()
    schedule = ProgressiveResolution(img_sizes=[4, 6, 8], batch_sizes=[8, 4, 2], start_epochs=[0, 1, 3])
    trainer = L.Trainer(accelerator="cpu", max_epochs=4, limit_train_batches=2, limit_val_batches=1,
                        limit_test_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[schedule, probe])
    trainer.fit(module, datamodule=dm)
    want = {0: (8, 1, 4, 4), 1: (4, 1, 6, 6), 2: (4, 1, 6, 6), 3: (2, 1, 8, 8)}
    assert probe.train == [(e, want[e]) for e in range(4) for _ in range(2)]
    assert probe.val == [(e, want[e][2:]) for e in range(4)]
    assert dm.img_size == (8, 8) and dm.batch_size == cfg.data.batch_size  # the data config's, after fit
    trainer.test(module, datamodule=dm)
    assert probe.test == [(8, 8)]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"img_sizes": [4, 8], "start_epochs": [1, 2]},
     "callbacks.progressive.start_epochs=[1, 2]; use increasing epochs starting at 0, e.g. [0, 4, 8]"),
    ({"img_sizes": [4, 8], "start_epochs": [0, 2, 3]},
     "callbacks.progressive: img_sizes (2), start_epochs (3) need one entry per stage"),
    ({"img_sizes": [4, 0], "start_epochs": [0, 2]},
     "callbacks.progressive.img_sizes=[4, 0]; use a non-empty list of positive integers or null"),
    ({"img_sizes": [4, 8], "start_epochs": [0, 2], "batch_sizes": [8]},
     "callbacks.progressive: img_sizes (2), start_epochs (2) and batch_sizes (1) need one entry per stage"),
])
def test_bad_schedules_are_one_line(kwargs, message):
    with pytest.raises(ValueError) as err:
        ProgressiveResolution(**kwargs)
    assert str(err.value) == message


def test_a_size_the_patch_does_not_divide_is_refused_at_setup(tmp_path):
    from vitpipe.run.build import build_from_config

    dm, _, module = build_from_config(make_cfg(tmp_path, ["debug=fast", "logger=none"]))
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[ProgressiveResolution(img_sizes=[5, 8], start_epochs=[0, 1])])
    with pytest.raises(ValueError, match=r"^callbacks.progressive.img_sizes: 5 is not divisible by the model's patch "
                                         r"size 2; use multiples of 2$"):
        trainer.fit(module, datamodule=dm)


def test_the_config_group_composes_and_builds(tmp_path):
    from vitpipe.config.build import instantiate_callbacks

    cfg = make_cfg(tmp_path, ["debug=fast", "callbacks=progressive", "callbacks.progressive.img_sizes=[4,8]",
                              "callbacks.progressive.start_epochs=[0,1]"])
    built = [c for c in instantiate_callbacks(cfg.callbacks) if isinstance(c, ProgressiveResolution)]
    assert len(built) == 1 and built[0].img_sizes == [4, 8] and built[0].batch_sizes is None


def test_a_resumed_run_continues_in_the_stage_it_stopped_in(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from vitpipe.run.build import build_from_config

    def fit(max_epochs, ckpt_path=None):
        dm, _, module = build_from_config(make_cfg(tmp_path, ["debug=fast", "logger=none"]))
        probe = Probe()
        trainer = L.Trainer(accelerator="cpu", max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=1,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[ProgressiveResolution(img_sizes=[4, 8], batch_sizes=[8, 2], start_epochs=[0, 2]),
                                       probe, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return probe.train

    first = fit(1)  # stopped after epoch 0, in stage 0
    assert first == [(0, (8, 1, 4, 4))] * 2
    assert fit(3, ckpt_path=tmp_path / "ckpt" / "last.ckpt") == [(1, (8, 1, 4, 4))] * 2 + [(2, (2, 1, 8, 8))] * 2


@pytest.mark.parametrize(("img_size", "multiple", "stages", "want"), [
    (32, 4, 3, [16, 24, 32]), (28, 4, 3, [12, 20, 28]), (8, 4, 3, [4, 8]), (224, 16, 4, [112, 144, 176, 224])])
def test_derived_sizes_run_from_half_to_full_in_patch_multiples(img_size, multiple, stages, want):
    from vitpipe.lit.progressive import default_img_sizes

    assert default_img_sizes(img_size, multiple, stages) == want


def test_callbacks_progressive_alone_derives_its_schedule_from_the_run(tmp_path):
    from vitpipe.config.build import instantiate_callbacks
    from vitpipe.run.build import build_from_config

    cfg = make_cfg(tmp_path, ["debug=fast", "logger=none", "callbacks=progressive"])  # 8 px digits, patch 2
    (schedule,) = [c for c in instantiate_callbacks(cfg.callbacks) if isinstance(c, ProgressiveResolution)]
    dm, _, module = build_from_config(cfg)
    probe = Probe()
    trainer = L.Trainer(accelerator="cpu", max_epochs=6, limit_train_batches=1, limit_val_batches=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[schedule, probe])
    trainer.fit(module, datamodule=dm)
    assert schedule.img_sizes == [4, 6, 8] and schedule.start_epochs == [0, 2, 4]
    assert [shape[-1] for _, shape in probe.train] == [4, 4, 6, 6, 8, 8]


def test_a_derived_schedule_needs_an_epoch_per_stage(tmp_path):
    from vitpipe.run.build import build_from_config

    dm, _, module = build_from_config(make_cfg(tmp_path, ["debug=fast", "logger=none"]))
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[ProgressiveResolution()])
    with pytest.raises(ValueError, match=r"^callbacks.progressive.start_epochs=null needs trainer.max_epochs >= 3 "
                                         r"\(one epoch per stage\), got 2; set trainer.max_epochs or "
                                         r"callbacks.progressive.start_epochs$"):
        trainer.fit(module, datamodule=dm)
