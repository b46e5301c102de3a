"""Multi-label training on the Fashion-MNIST mosaics (scripts/make_mosaics.py): the module's logged
scores recomputed with sklearn, a short run that learns, mixup/EMA/pos_weight paths, and (slow) a
longer run to a stated mAP."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, f1_score

from vitpipe.run.build import build_from_config
from vitpipe.tasks.make_mosaics import MosaicConfig, make_mosaics
from vitpipe.tasks.train import train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def mosaics(tmp_path_factory):
    """1200 / 200 / 300 mosaics, seed 0 (made once for the module)."""
    out = tmp_path_factory.mktemp("mosaics") / "fmnist_mosaics"
    return make_mosaics(MosaicConfig(out=str(out), train=1200, val=200, test=300, seed=0), progress=False)


def overrides(root, *extra):
    """A 2-block, 64-wide ViT on the 56 x 56 mosaics at patch 14 (a tile is 2 x 2 patches); no random
    crops (a RandomResizedCrop cuts tiles away: labels the image no longer shows)."""
    return ["data=imagefolder", f"data.root={root}", "data.labels=labels.csv", "module.task=multilabel",
            "model=vit_nano", "model.img_size=56", "model.patch_size=14", "model.dim=64", "model.depth=2",
            "model.num_heads=2", "trainer=cpu", "logger=none", "data.num_workers=0", "data.batch_size=64",
            "data.augment=false", "module.optimizer.lr=3e-3", "module.label_smoothing=0", *extra]


def baseline_map(targets: torch.Tensor) -> float:
    """The label-frequency baseline: every image scored alike, each class's AP is its positive rate."""
    return float(targets.float().mean(0).mean())


class Collect(L.Callback):
    def __init__(self):
        self.logits, self.targets = [], []

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.logits.append(outputs.detach().cpu())
        self.targets.append(batch[1].cpu())


def test_logged_map_ap_f1_equal_sklearn_on_the_same_logits(mosaics, cfg_factory):
    cfg = cfg_factory(*overrides(mosaics, "debug=fast", "trainer.limit_test_batches=null", "data.eval_batch_size=64"))
    dm, _, module = build_from_config(cfg)
    collect = Collect()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=[collect])
    logged = {k: float(v) for k, v in trainer.test(module, dm, verbose=False)[0].items()}
    logits, y = torch.cat(collect.logits), torch.cat(collect.targets).long().numpy()
    assert len(y) == 300 and y.sum(1).min() >= 1 and y.sum(1).max() <= 4
    p = torch.sigmoid(logits).numpy()
    pred = (p >= 0.5).astype(int)
    assert logged["test/map"] == pytest.approx(average_precision_score(y, p, average="macro"), abs=1e-5)
    assert logged["test/map_micro"] == pytest.approx(average_precision_score(y, p, average="micro"), abs=1e-5)
    per_class = average_precision_score(y, p, average=None)
    for c, name in enumerate(dm.class_names):
        assert logged[f"test/ap/{name}"] == pytest.approx(per_class[c], abs=1e-5), name
    for avg in ("macro", "micro"):
        assert logged[f"test/f1_{avg}"] == pytest.approx(f1_score(y, pred, average=avg, zero_division=0), abs=1e-5)
    assert logged["test/f1_example"] == pytest.approx(f1_score(y, pred, average="samples", zero_division=0), abs=1e-5)
    assert np.unique(pred).size == 2  # an untrained net predicts some labels and not others: F1 is exercised


def test_short_run_learns_well_above_the_label_frequency_baseline(mosaics, cfg_factory):
    cfg = cfg_factory(*overrides(mosaics, "trainer.max_epochs=8"))
    metrics = train(cfg)
    dm, _, _ = build_from_config(cfg)
    dm.setup("test")
    targets = dm.data_test.base.targets
    base = baseline_map(targets)
    assert base == pytest.approx(0.25, abs=0.03)  # k ~ U{1..4} distinct classes of 10: 2.5 / 10
    assert metrics["test/map"] > base + 0.15, (metrics["test/map"], base)  # measured: 0.52 vs 0.25
    assert metrics["val/map_best"] >= metrics["val/map"] - 1e-6
    assert (cfg.callbacks.model_checkpoint.monitor, cfg.optimized_metric) == ("val/map", "val/map_best")


def test_mixup_ema_asl_and_balanced_pos_weight_train(mosaics, cfg_factory):
    cfg = cfg_factory(*overrides(mosaics, "debug=fast", "+module.mixup={mixup_alpha: 0.8, cutmix_alpha: 1.0}",
                                 "module.ema_decay=0.9", "module.loss=asl", "module.class_weights=balanced",
                                 "module.label_smoothing=0.1"))
    metrics = train(cfg)
    assert np.isfinite(metrics["train/loss"]) and 0.0 <= metrics["test/map"] <= 1.0
    dm, _, module = build_from_config(cfg)
    dm.setup("fit")
    w = module._balanced_weight(dm.data_train)
    t = dm.data_train.base.targets[dm.data_train.indices] if dm.data_train.indices is not None else dm.data_train.base.targets
    assert torch.allclose(w, (len(t) - t.sum(0)) / t.sum(0))


@pytest.mark.slow
def test_mosaics_train_to_a_stated_map(tmp_path, cfg_factory):
    """20 epochs on 4000 mosaics (docs/multilabel.md's table, seed 0): test mAP >= 0.70."""
    root = make_mosaics(MosaicConfig(out=str(tmp_path / "m"), train=4000, val=500, test=500, seed=0), progress=False)
    metrics = train(cfg_factory(*overrides(root, "trainer.max_epochs=20", "seed=0")))
    assert metrics["test/map"] >= 0.70, metrics["test/map"]


def test_make_mosaics_is_seeded_labels_are_the_tiles_classes_and_out_is_never_half_written(tmp_path, mosaics):
    import csv

    from vitpipe.errors import ConfigError
    from vitpipe.tasks.make_mosaics import CLASS_NAMES, LABELS_FILE, MANIFEST

    again = make_mosaics(MosaicConfig(out=str(tmp_path / "again"), train=1200, val=200, test=300, seed=0),
                         progress=False)
    assert (again / LABELS_FILE).read_bytes() == (mosaics / LABELS_FILE).read_bytes()
    assert (again / "test/00007.png").read_bytes() == (mosaics / "test/00007.png").read_bytes()
    labels = list(csv.DictReader((mosaics / LABELS_FILE).read_text().splitlines()))
    tiles = list(csv.DictReader((mosaics / MANIFEST).read_text().splitlines()))
    for row, m in zip(labels, tiles, strict=True):
        assert row["path"] == m["path"] and row["split"] == m["split"]
        assert row["labels"].split(";") == [CLASS_NAMES[c] for c in sorted({int(m[f"tile{t}_class"]) for t in range(4)})]
    counts = {n: sum(len(r["labels"].split(";")) == n for r in labels) for n in (1, 2, 3, 4)}
    assert all(c > 0.2 * len(labels) for c in counts.values()), counts  # k ~ U{1..4}
    train_items = {m[f"tile{t}_index"] for m in tiles if m["split"] == "train" for t in range(4)}
    val_items = {m[f"tile{t}_index"] for m in tiles if m["split"] == "val" for t in range(4)}
    assert not train_items & val_items  # disjoint parts of Fashion-MNIST's training set
    with pytest.raises(ConfigError, match=r"--out=.* exists; pass --overwrite"):
        make_mosaics(MosaicConfig(out=str(again), train=1, val=0, test=0), progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left beside it
