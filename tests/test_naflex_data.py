"""NaFlex training data (vitpipe.data.naflex): token-budget batches, each image once per epoch across
ranks, a plan that is a function of (seed, epoch), exact resume after a kill, eval once per image."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_faults import _equal_weights, _finish, _held_at, _popen, _wait_for
from test_scale import _last, _train_cli
from test_shards import IDS, RecordIds, _id_folder, _rows

from vitpipe.data import DigitsDataModule
from vitpipe.data.naflex import (
    NaFlexConfig,
    NaFlexImageDataset,
    NaFlexInput,
    TokenBudgetBatchSampler,
    loss_scale,
    naflex_collate,
    patchify_batch,
)
from vitpipe.errors import ConfigError
from vitpipe.nn.naflex import grid_sizes, pad_batch, patchify_image, seq_grid
from vitpipe.tasks.train import train

NAFLEX = {"enabled": True, "seq_lens": [4, 9, 16], "max_seq_len": 16, "tokens_per_batch": None,
          "loss_scale": "linear", "patch_size": 2}
TESTS = Path(__file__).resolve().parent
TINY_NAFLEX = ["debug=fast", "logger=none", "data.naflex.enabled=true", "callbacks.progress_bar.refresh_rate=1000"]


def _sampler(n=103, world=1, rank=0, epoch=0, **kw):
    s = TokenBudgetBatchSampler(n, seq_lens=[4, 9, 16], tokens_per_batch=64, num_replicas=world, rank=rank,
                                seed=3, hflip=True, **kw)
    s.set_epoch(epoch)
    return s


def test_each_batch_spends_the_token_budget_to_within_one_sequence():
    batches = list(_sampler(n=1000))
    full = 0
    for b in batches:
        s = b[0][1]
        assert all(k[1] == s for k in b)  # one seq_len per batch
        if len(b) == 64 // s:  # all but the remainder step
            full += 1
            assert 64 - s < len(b) * s <= 64
    assert full >= len(batches) - 1 and {b[0][1] for b in batches} == {4, 9, 16}


@pytest.mark.parametrize("n", [103, 41, 9])  # 9: a remainder smaller than the ranks' count is folded in
def test_each_training_image_once_per_epoch_over_two_ranks_with_equal_batch_counts(n):
    for epoch in (0, 1):
        r0, r1 = list(_sampler(n, 2, 0, epoch)), list(_sampler(n, 2, 1, epoch))
        assert len(r0) == len(r1) == len(_sampler(n, 2, 0, epoch)) and all(r0) and all(r1)
        seen = sorted(k[0] for b in r0 + r1 for k in b)
        assert seen == list(range(n))
        assert [b[0][1] for b in r0] == [b[0][1] for b in r1]  # the ranks step at one seq_len
    assert len(list(_sampler(n, 2, 0, 0))) == len(list(_sampler(n, 2, 0, 1)))  # a fixed count per epoch


def test_the_plan_is_a_function_of_seed_and_epoch_and_skip_drops_batches_once():
    a, b = _sampler(epoch=1), _sampler(epoch=1)
    assert list(a) == list(b) != list(_sampler(epoch=2))
    b.skip = 3
    assert list(b) == list(a)[3:] and list(b) == list(a)  # skipped once, then the whole epoch again
    assert any(k[2] for batch in a.plan() for k in batch) and not all(k[2] for batch in a.plan() for k in batch)


def test_lightning_sets_the_epoch_of_the_batch_sampler():
    from lightning.fabric.utilities.data import _set_sampler_epoch

    dm = _digits()
    dm.setup("fit")
    loader = dm.train_dataloader()
    _set_sampler_epoch(loader, 5)
    assert loader.batch_sampler.epoch == 5


def test_config_values_are_checked_in_one_line():
    for bad, word in [({"seq_lens": [0, 4]}, "seq_lens"), ({"max_seq_len": 9}, "max_seq_len=9"),
                      ({"loss_scale": "cube"}, "linear, sqrt"), ({"tokens_per_batch": 2}, "tokens_per_batch=2")]:
        with pytest.raises(ConfigError, match=word) as e:
            NaFlexConfig.from_cfg({**NAFLEX, **bad}, 32)
        assert "\n" not in str(e.value)
    assert NaFlexConfig.from_cfg({**NAFLEX, "enabled": False}, 32) is None
    assert NaFlexConfig.from_cfg(NAFLEX, 32).tokens_per_batch == 32 * 16
    from omegaconf import OmegaConf

    from vitpipe.config.preflight import check_data_arguments  # the config check, before the module is built

    with pytest.raises(ConfigError, match="random_erasing=0.25"):
        check_data_arguments(OmegaConf.create({"_target_": "vitpipe.data.digits.DigitsDataModule", "img_size": 8,
                                               "in_chans": 1, "num_classes": 10, "channels": 1, "random_erasing": 0.25,
                                               "naflex": NAFLEX}))
    assert loss_scale(48, 12, "linear") == 4 and loss_scale(48, 12, "sqrt") == 2 and loss_scale(48, 12, "none") == 1


def test_batch_patchify_of_the_fast_path_equals_the_per_image_path():
    x = torch.rand(3, 1, 28, 20)
    for s in (9, 16, 35):
        a = patchify_batch(x, 4, s)
        b = pad_batch([patchify_image(im, 4, s) for im in x], s)
        assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)


def test_standard_path_patchifies_each_image_at_its_own_aspect():
    base = [(Image.new("RGB", (40, 20), (255, 0, 0)), 1), (Image.new("RGB", (12, 36), (0, 0, 255)), 2)]
    ds = NaFlexImageDataset(base, None, NaFlexInput(4, (0.5,) * 3, (0.5,) * 3, 3), eval_seq_len=16)
    batch, y = naflex_collate([ds[0], ds[1]])
    assert y.tolist() == [1, 2] and batch["patches"].shape == (2, 16, 48)
    grids = [seq_grid((20, 40), (4, 4), 16), seq_grid((36, 12), (4, 4), 16)]  # (H, W) of each image
    assert batch["patch_valid"].sum(1).tolist() == [h * w for h, w in grids]
    assert grids[0][1] > grids[0][0] and grids[1][0] > grids[1][1]  # wide stays wide, tall stays tall
    assert grid_sizes(batch["patch_coord"], batch["patch_valid"]).tolist() == [list(g) for g in grids]
    red = batch["patches"][0, 0].reshape(16, 3)  # (p*p, C): (1 - 0.5) / 0.5 = 1 in red, -1 elsewhere
    assert torch.allclose(red, torch.tensor([[1.0, -1.0, -1.0]]).expand(16, 3), atol=1e-5)  # bicubic resize


class _Rank:  # what the data module's loaders read of a trainer
    def __init__(self, world: int, rank: int) -> None:
        self.world_size, self.global_rank = world, rank


def _digits(**kw) -> DigitsDataModule:
    return DigitsDataModule(img_size=8, in_chans=1, num_classes=10, channels=1, batch_size=8, eval_batch_size=50,
                            naflex=NAFLEX, **kw)


def test_validation_scores_each_image_once_at_max_seq_len_over_two_ranks():
    seen = []
    for rank in (0, 1):
        dm = _digits()
        dm.trainer = _Rank(2, rank)
        dm.setup("fit")
        for batch in dm.val_dataloader():
            x, y = dm.on_after_batch_transfer(batch, 0)
            assert x["patches"].shape[1] == 16 and bool(x["patch_valid"].all())  # 8x8 digits at 4x4 patches of 2
            assert len(y) == len(x["patches"])
            seen += [tuple(im) for im in batch[0].flatten(1).tolist()]
    whole = sorted(tuple(im) for im in dm.data_val.images.flatten(1).tolist())
    assert sorted(seen) == whole and len(whole) > 100  # the same multiset: each image once, none repeated


def test_training_batches_of_the_data_module_hold_the_token_budget_and_every_image():
    dm = _digits(hflip=True)
    dm.setup("fit")
    loader, n, short = dm.train_dataloader(), 0, 0
    for batch in loader:
        x, y = dm.on_after_batch_transfer(batch, 0)
        s = x["patches"].shape[1]
        assert len(y) * s <= 8 * 16 + s  # the budget (+ one image when a tiny remainder was folded in)
        short += len(y) != 8 * 16 // s
        n += len(y)
    assert n == len(dm.data_train) and short <= 1 and len(loader) == len(loader.batch_sampler)


def test_naflex_trains_through_the_train_entry_point_above_chance(cfg_factory):
    cfg = cfg_factory(*TINY_NAFLEX, "model.dim=32", "model.depth=1", "trainer.max_epochs=8",
                      "trainer.limit_train_batches=null", "trainer.limit_val_batches=null", "trainer.limit_test_batches=null",
                      "data.batch_size=32", "module.optimizer.lr=3e-3")
    metrics = train(cfg)
    # 10 digit classes: chance is 0.1 (sd 0.016 over the 360 test images); this 1-block, 32-wide ViT reaches
    # 0.21 in 8 epochs, as the same model without NaFlex does (0.26): the tiny model learns slowly
    assert metrics["test/acc"] > 0.16, metrics


@pytest.mark.slow  # three training subprocesses: ~50 s on 2 shared cores
def test_a_run_killed_mid_epoch_resumes_to_the_same_weights_as_an_uninterrupted_one(tmp_path):
    common = [*TINY_NAFLEX, "test=false", "callbacks.model_checkpoint.monitor=null",
              "callbacks.model_checkpoint.save_top_k=0", "trainer.max_epochs=2", "trainer.limit_train_batches=4",
              "trainer.limit_val_batches=1", "trainer.deterministic=true", "data.hflip=true", "model.depth=2",
              "model.drop_path_rate=0.1", "callbacks.model_checkpoint.last_every_n_train_steps=3"]
    runs = tmp_path / "logs" / "debug" / "runs"
    full = _popen(*common, f"hydra.run.dir={tmp_path / 'full'}")
    killed = _popen(*common, f"paths.log_dir={tmp_path / 'logs'}", f"hydra.run.dir={runs / 'a'}",
                    *_held_at(7, tmp_path / "step7"))
    _wait_for(tmp_path / "step7", killed)
    killed.kill()  # SIGKILL: nothing is saved; last.ckpt is the step-6 one, mid-way through epoch 1
    assert _finish(killed).returncode == -signal.SIGKILL
    assert _last(runs / "a")["global_step"] == 6
    resumed = _finish(_popen(*common, f"paths.log_dir={tmp_path / 'logs'}", f"hydra.run.dir={runs / 'b'}",
                             "ckpt_path=last"))
    done = _finish(full)
    assert resumed.returncode == 0 and done.returncode == 0, resumed.stderr[-3000:] + done.stderr[-3000:]
    a, b = _last(tmp_path / "full"), _last(runs / "b")
    assert a["global_step"] == b["global_step"] == 8
    assert _equal_weights(a, b) == []


def test_an_image_folder_of_any_sizes_trains_on_the_standard_path(cfg_factory, tmp_path):
    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", 16), ("val", 6)):
        for c, rgb in (("red", (220, 30, 30)), ("blue", (30, 30, 220))):
            (tmp_path / "img" / split / c).mkdir(parents=True)
            for i in range(n):
                w, h = torch.randint(10, 50, (2,), generator=gen).tolist()  # every aspect, wide and tall
                Image.new("RGB", (w, h), rgb).save(tmp_path / "img" / split / c / f"{i}.png")
    cfg = cfg_factory(*TINY_NAFLEX, "data=imagefolder", f"data.root={tmp_path / 'img'}", "data.num_workers=0",
                      "model.img_size=32", "model.patch_size=4", "data.naflex.seq_lens=[16,36]",
                      "data.naflex.max_seq_len=36", "data.batch_size=8", "trainer.max_epochs=3",
                      "trainer.limit_train_batches=null", "trainer.limit_val_batches=null",
                      "trainer.limit_test_batches=null", "module.optimizer.lr=3e-3", sub="run_if")
    assert train(cfg)["test/acc"] > 0.9  # red against blue, at each image's own aspect


def test_mixup_with_naflex_is_refused_in_one_line(cfg_factory):
    cfg = cfg_factory(*TINY_NAFLEX, "module.mixup={mixup_alpha:0.8}", sub="run_mix")
    from vitpipe.config.preflight import check_config

    with pytest.raises(ConfigError, match="module.mixup needs whole images"):
        check_config(cfg)  # from the config alone: before any data is read
    with pytest.raises(ConfigError, match="module.mixup needs whole images") as e:
        train(cfg)
    assert "\n" not in str(e.value)


class RecordNaFlexIds(RecordIds):
    """test_shards.RecordIds for patch-dict batches: an image's id is the red of its first patch's
    first pixel (a patch is (p, p, C) flattened: index 0 is red); pad rows of the batch hold no image."""

    def _write(self, trainer, kind: str, batch) -> None:
        dm, x = trainer.datamodule, batch[0]
        assert bool(x["patch_valid"][:, 0].all())  # every row of a batch is an image
        red = x["patches"][:, 0, 0] * dm.std[0] + dm.mean[0]  # a flat image stays flat through the resize
        row = {"kind": kind, "epoch": trainer.current_epoch, "seq_len": x["patches"].shape[1],
               "ids": (red * 255).round().long().tolist()}  # fmt: skip
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.slow  # a 2-process DDP subprocess: ~28 s on 2 shared cores
def test_ddp_two_ranks_train_each_image_once_per_epoch_and_score_val_test_once(tmp_path):
    """Real 2-process DDP (gloo) on the standard path: the flat-colour folder of test_shards (23
    training images of 3 aspects, id = red), seq_lens [4, 9] at patch 4, 2 workers a rank."""
    root = _id_folder(tmp_path / "images")
    r = _train_cli("debug=fast", "logger=none", "trainer=ddp_cpu", "trainer.devices=2", "trainer.max_epochs=1",
                   "test=true", "data=imagefolder", f"data.root={root}", "data.num_classes=3", "data.num_workers=2",
                   "data.naflex.enabled=true", "data.naflex.seq_lens=[4,9]", "data.naflex.max_seq_len=9",
                   "data.batch_size=2", "data.eval_batch_size=2", "data.hflip=true", "model.img_size=12",
                   "model.patch_size=4", "model.dim=32", "model.depth=1", "trainer.limit_train_batches=null",
                   "trainer.limit_val_batches=null", "trainer.limit_test_batches=null",
                   "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=0",
                   "callbacks.progress_bar.refresh_rate=1000", "+callbacks.ids._target_=test_naflex_data.RecordNaFlexIds",
                   f"+callbacks.ids.out={tmp_path / 'ids'}", f"hydra.run.dir={tmp_path / 'run'}",
                   env={"PYTHONPATH": str(TESTS), "XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [_rows(tmp_path / "ids" / f"rank{k}.jsonl") for k in range(2)]
    train = [[row for row in rows if row["kind"] == "train"] for rows in ranks]
    # tokens_per_batch = 2 x 9 = 18: 4 images a rank at seq_len 4, 2 at 9; the ranks step together
    assert len(train[0]) == len(train[1]) > 1
    assert [b["seq_len"] for b in train[0]] == [b["seq_len"] for b in train[1]]
    assert {b["seq_len"] for b in train[0] + train[1]} <= {4, 9} and len({b["seq_len"] for b in train[0]}) == 2
    seen = [i for rank in train for b in rank for i in b["ids"]]
    assert sorted(seen) == list(IDS["train"])  # each of the 23 images exactly once: no pad, none dropped
    for kind in ("val", "test"):
        scored = [i for rows in ranks for row in rows if row["kind"] == kind for i in row["ids"]]
        assert sorted(scored) == list(IDS[kind])  # 7 and 5 images: each scored once, none repeated
        assert {row["seq_len"] for rows in ranks for row in rows if row["kind"] == kind} == {9}  # max_seq_len
