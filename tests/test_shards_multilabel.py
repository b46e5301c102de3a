"""Multi-label shards: make_shards on an image folder with a labels file keeps each image's bytes and
label set (read back equal to the folder's, item by item through source_index), the index says
multi-label with per-class positive counts; data=shards then gives the folder's multi-hot targets,
batches, val/test mAP, balanced pos_weight and an exactly resumed epoch; a task that does not match
the shards is one line before data loads; single-label shards stay format 1.

The images are flat colours whose red channel is the image's id, so a batch names its images."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from vitpipe.config.preflight import check_config
from vitpipe.data import ImageFolderDataModule
from vitpipe.data.multilabel import balanced_pos_weight, multilabel_targets
from vitpipe.data.shards import LABELS_FILE, ShardsDataModule, ShardSplit
from vitpipe.errors import ConfigError
from vitpipe.run.build import build_from_config
from vitpipe.tasks.make_shards import INDEX_FILE, make_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NAMES = ("cat", "dog", "owl")  # the list layout's classes: sorted names of the training rows
IDS = {"train": range(0, 13), "val": range(20, 25), "test": range(30, 33)}  # 0, 8, 32: no label
RED = 5  # red = RED * id


def label_set(i: int) -> list[str]:
    return [NAMES[c] for c in range(3) if i >> c & 1]


def multi_hot(i: int) -> list[float]:
    return [float(i >> c & 1) for c in range(3)]


def _folder(root: Path) -> Path:
    rows = []
    for split, ids in IDS.items():
        for i in ids:
            path = root / "img" / f"{i:03d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8 + i % 3, 8), (RED * i, 40, 128)).save(path)
            rows.append(f"img/{i:03d}.png,{';'.join(label_set(i))},{split}")
    (root / "labels.csv").write_text("path,labels,split\n" + "\n".join(rows) + "\n")
    return root


def _folder_dm(root, **kw) -> ImageFolderDataModule:
    args = dict(root=str(root), labels="labels.csv", num_classes=None, channels=3, img_size=8, in_chans=3,
                batch_size=4, eval_batch_size=4, num_workers=0, augment=False, shuffle=False)
    return ImageFolderDataModule(**{**args, **kw})


def _shards_dm(root, **kw) -> ShardsDataModule:
    args = dict(root=str(root), channels=3, img_size=8, in_chans=3, batch_size=4, eval_batch_size=4,
                num_workers=0, augment=False, shuffle=False)
    return ShardsDataModule(**{**args, **kw})


def _ids(x: torch.Tensor, dm) -> list[int]:
    """The images' ids from a normalised batch (a flat image stays flat through the transforms)."""
    red = x[:, 0, 0, 0] * dm.std[0] + dm.mean[0]
    return (red * 255 / RED).round().long().tolist()


@pytest.fixture(scope="module")
def ml_shards(tmp_path_factory):
    """The labelled image folder and its multi-label shards (training written in several chunks)."""
    tmp = tmp_path_factory.mktemp("mlshards")
    root = _folder(tmp / "images")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp / "cache"))
        index = make_shards(_folder_dm(root), str(tmp / "shards"), shard_size="400B")
    return root, tmp / "shards", index


@pytest.fixture(autouse=True)
def decode_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# ---- conversion ------------------------------------------------------------------------------


def test_items_hold_the_folders_bytes_and_label_sets_and_the_index_says_multilabel(ml_shards):
    root, shards, index = ml_shards
    assert index["format"] == 2 and index["task"] == "multilabel" and index["class_names"] == list(NAMES)
    assert json.loads((shards / INDEX_FILE).read_text()) == index
    src = _folder_dm(root)
    for split, ids in IDS.items():
        source, meta = src._load(split), index["splits"][split]
        assert meta["count"] == len(ids) == sum(meta["chunk_sizes"]) and "class_counts" not in meta
        assert meta["positive_counts"] == [sum(i >> c & 1 for i in ids) for c in range(3)]
        assert meta["unlabeled"] == sum(i % 8 == 0 for i in ids) and (shards / split / LABELS_FILE).is_file()
        if split == "train":
            assert len(meta["chunk_sizes"]) > 1  # the index maps across chunks
        shard = ShardSplit(str(shards / split), len(ids), mode="RGB", num_classes=3)
        seen = []
        for n in range(len(ids)):
            item = shard.item(n)
            k = item["source_index"]
            assert "label" not in item and item["labels"].dtype == np.uint16  # 2 bytes per label present
            assert bytes(item["image"]) == Path(source.paths[k]).read_bytes()
            image, target = shard[n]
            assert target.dtype == torch.float32 and torch.equal(target, source.targets[k])
            assert torch.equal(shard.targets[n], source.targets[k])  # the labels file, in item order
            assert target.tolist() == multi_hot(int(Path(source.paths[k]).stem))
            seen.append(k)
        assert sorted(seen) == list(range(len(ids)))
        if split == "train":
            assert seen != sorted(seen)  # training items are written shuffled, traced by source_index


def test_a_single_label_split_left_in_the_output_is_rewritten_with_label_sets(ml_shards, tmp_path):
    root, _, _ = ml_shards
    out = tmp_path / "sh"
    folders = tmp_path / "folders"
    for i in IDS["train"]:
        d = folders / "train" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (RED * i, 0, 0)).save(d / f"{i}.png")
    single = make_shards(ImageFolderDataModule(root=str(folders), num_classes=2, channels=3, img_size=8,
                                               in_chans=3, test_split=0, val_split=0), str(out),
                         shard_size="400B")
    assert single["splits"]["train"]["count"] == len(IDS["train"])  # same count: only the kind differs
    with pytest.raises(ConfigError, match="train/: multiclass items, now multilabel"):  # kept only if the same
        make_shards(_folder_dm(root), str(out), shard_size="400B")
    index = make_shards(_folder_dm(root), str(out), shard_size="400B", overwrite=True)
    shard = ShardSplit(str(out / "train"), index["splits"]["train"]["count"], mode="RGB", num_classes=3)
    assert "labels" in shard.item(0) and (out / "train" / LABELS_FILE).is_file()


# ---- reading ---------------------------------------------------------------------------------


def test_batches_targets_and_pos_weight_equal_the_image_folders(ml_shards):
    root, shards, _ = ml_shards
    src, sh = _folder_dm(root), _shards_dm(shards, num_workers=2)
    src.setup(), sh.setup()
    assert sh.multilabel and src.multilabel and sh.num_classes == 3 and sh.class_names == list(NAMES)
    for split in ("val", "test"):  # source order kept: batch for batch the folder's
        for (xa, ya), (xb, yb) in zip(*(getattr(dm, f"{split}_dataloader")() for dm in (src, sh)), strict=True):
            assert yb.dtype == torch.float32 and yb.shape == (len(xb), 3)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x, y = next(iter(sh.train_dataloader()))
    assert y.tolist() == [multi_hot(i) for i in _ids(x, sh)]  # each image's own label set
    order = [sh.data_train.base.item(n)["source_index"] for n in range(len(sh.data_train))]
    t_src, t_sh = multilabel_targets(src.data_train), multilabel_targets(sh.data_train)
    assert torch.equal(t_sh, t_src[order])
    assert torch.equal(balanced_pos_weight(t_sh), balanced_pos_weight(t_src))
    assert sh.class_counts("train") == t_src.sum(0).long().tolist()


def test_a_resumed_epoch_continues_with_the_same_images_and_targets(ml_shards):
    _, shards, _ = ml_shards
    full = _shards_dm(shards, shuffle=True, seed=3)
    full.setup("fit")
    full.resume.load_state_dict({"epoch": 1, "batches_done_in_epoch": 0, "step": 0})
    epoch = [(_ids(x, full), y) for x, y in full.train_dataloader()]
    assert len(epoch) == 4 and sorted(i for ids, _ in epoch for i in ids)[: len(IDS["train"])] == list(IDS["train"])
    resumed = _shards_dm(shards, shuffle=True, seed=3)
    resumed.setup("fit")
    resumed.resume.load_state_dict({"epoch": 1, "batches_done_in_epoch": 2, "step": 2})
    rest = [(_ids(x, resumed), y) for x, y in resumed.train_dataloader()]
    assert [ids for ids, _ in rest] == [ids for ids, _ in epoch[2:]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(rest, epoch[2:], strict=True))


def _overrides(data: list[str]) -> list[str]:
    return [*data, "module.task=multilabel", "model=vit_nano", "model.img_size=8", "model.patch_size=4",
            "model.dim=32", "model.depth=1", "model.num_heads=2", "trainer=cpu", "logger=none", "seed=0",
            "data.num_workers=0", "data.batch_size=4", "data.eval_batch_size=4", "data.augment=false",
            "data.shuffle=false", "module.class_weights=balanced"]


class Targets(L.Callback):
    def __init__(self):
        self.train = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append((_ids(batch[0], trainer.datamodule), batch[1].tolist()))


def test_a_multilabel_run_on_shards_trains_and_scores_what_the_image_folder_scores(ml_shards, cfg_factory):
    root, shards, _ = ml_shards
    folder = cfg_factory(*_overrides(["data=imagefolder", f"data.root={root}", "data.labels=labels.csv"]), sub="f")
    dm_f, _, module_f = build_from_config(folder)
    cfg = cfg_factory(*_overrides(["data=shards", f"data.root={shards}"]), sub="s")
    dm_s, _, module_s = build_from_config(cfg)
    module_s.load_state_dict(module_f.state_dict())
    trainer = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    scores = [L.Trainer(**trainer).validate(m, dm, verbose=False)[0] for m, dm in ((module_f, dm_f),
                                                                                    (module_s, dm_s))]
    assert scores[0]["val/map"] == pytest.approx(scores[1]["val/map"], abs=1e-6)
    assert scores[0]["val/loss"] == pytest.approx(scores[1]["val/loss"], abs=1e-6)
    assert set(scores[0]) == set(scores[1]) and 0.0 < scores[1]["val/map"] <= 1.0
    targets = Targets()
    before = [p.detach().clone() for p in module_s.parameters()]
    L.Trainer(**trainer, max_steps=3, limit_val_batches=0, callbacks=[targets]).fit(module_s, dm_s)
    assert len(targets.train) == 3
    for ids, y in targets.train:
        assert y == [multi_hot(i) for i in ids]
    assert any(not torch.equal(a, b) for a, b in zip(before, module_s.parameters()))
    t = multilabel_targets(dm_f.data_train)
    assert torch.allclose(module_s.class_weight, (len(t) - t.sum(0)) / t.sum(0))  # pos_weight=balanced


# ---- mismatches, old shards ------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    for i in IDS["train"]:
        d = tmp / "images" / "train" / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (RED * i, 0, 0)).save(d / f"{i}.png")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp / "cache"))
        dm = ImageFolderDataModule(root=str(tmp / "images"), num_classes=3, channels=3, img_size=8, in_chans=3)
        make_shards(dm, str(tmp / "shards"), shard_size="400B")
    return tmp / "shards"


def test_a_task_that_does_not_match_the_shards_is_one_line_before_data_loads(ml_shards, single_shards,
                                                                              cfg_factory, monkeypatch):
    _, shards, _ = ml_shards

    def no_data(*a, **kw):
        raise AssertionError("data read before the check")

    monkeypatch.setattr(ShardSplit, "item", no_data)
    cases = ((single_shards, ["module.task=multilabel"], "holds single-label shards .* set module.task=multiclass"),
             (shards, [], "holds multi-label shards .*; set module.task=multilabel"),
             (shards, ["module.task=multiclass"], "holds multi-label shards .*; set module.task=multilabel"))
    for root, extra, match in cases:
        with pytest.raises(ConfigError, match=match) as err:
            check_config(cfg_factory("data=shards", f"data.root={root}", "debug=fast", *extra))
        assert f"data.root={root}" in str(err.value) and "\n" not in str(err.value)
    check_config(cfg_factory("data=shards", f"data.root={shards}", "module.task=multilabel", "debug=fast"))
    check_config(cfg_factory("data=shards", f"data.root={single_shards}", "debug=fast"))
    for key, override in (("data.sampler", "data.sampler=balanced"),  # refused as for the image folder
                          ("data.naflex.enabled", "+data.naflex={enabled: true}")):
        with pytest.raises(ConfigError, match=f"module.task=multilabel cannot take {key}="):
            check_config(cfg_factory("data=shards", f"data.root={shards}", "module.task=multilabel", override,
                                     "debug=fast"))


def test_single_label_shards_stay_format_1_and_read_as_before(single_shards):
    index = json.loads((single_shards / INDEX_FILE).read_text())
    assert index["format"] == 1 and "task" not in index  # what readers before multi-label shards accept
    # and the fingerprint of what the split was written from (make_shards' re-runs), which readers ignore
    assert set(index["splits"]["train"]) == {"count", "chunk_sizes", "class_counts", "fingerprint"}
    assert not (single_shards / "train" / LABELS_FILE).exists()
    dm = _shards_dm(single_shards)
    dm.setup("fit")
    assert not dm.multilabel and getattr(dm.data_train.base, "targets", None) is None
    x, y = next(iter(dm.train_dataloader()))
    assert y.dtype == torch.int64 and y.tolist() == [i % 3 for i in _ids(x, dm)]
    bad = single_shards.parent / "bad"
    bad.mkdir()
    (bad / INDEX_FILE).write_text(json.dumps({**index, "format": 2}))  # format 2 without task: multilabel
    with pytest.raises(ConfigError, match="is not a vitpipe shard index"):
        _shards_dm(bad)


# ---- the commands as typed -------------------------------------------------------------------


@pytest.mark.slow  # ~20 s on 2 shared cores: two script start-ups
def test_the_make_shards_and_train_commands_run_a_multilabel_model_from_shards(tmp_path):
    """scripts/make_shards.py on the labelled folder, then scripts/train.py data=shards module.task=multilabel:
    the printed command names the task, and the run's predictions name each test image's own label set."""
    import csv

    from test_scale import _train_cli

    root, shards = _folder(tmp_path / "images"), tmp_path / "shards"
    r = _train_cli("data=imagefolder", f"data.root={root}", "data.labels=labels.csv", f"out={shards}",
                   f"hydra.run.dir={tmp_path / 'make'}", script="make_shards.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"train with data=shards data.root={shards} data.num_classes=3 data.channels=3 module.task=multilabel" in r.stdout
    run = tmp_path / "run"
    r = _train_cli("data=shards", f"data.root={shards}", "module.task=multilabel", "debug=fast", "logger=none",
                   "model.img_size=8", "model.patch_size=4", "data.num_workers=0", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert 0.0 < metrics["test/map"] <= 1.0 and {f"test/ap/{n}" for n in NAMES} <= set(metrics)
    with open(run / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["labels"] for row in rows] == [";".join(label_set(i)) for i in IDS["test"]]  # the source order


def test_a_class_index_outside_the_index_is_one_line_naming_the_file(tmp_path):
    """Shards are data someone hands us: a stored class index past the index's classes (a corrupt or
    foreign labels file, a bad item) is a one-line error naming where, not an IndexError."""
    import numpy as np

    from vitpipe.data.shards import multi_hot, read_label_sets, write_label_sets

    path = str(tmp_path / "vitpipe_labels.npz")
    write_label_sets(path, [np.array([0, 2], np.uint16), np.array([7], np.uint16)])
    with pytest.raises(ConfigError, match="holds class index 7, not one of the 3 classes") as err:
        read_label_sets(path, 3)
    assert path in str(err.value) and "\n" not in str(err.value)
    assert read_label_sets(path, 8)[1].tolist() == [0.0] * 7 + [1.0]
    with pytest.raises(ConfigError, match="s3://b/train item 4 holds class index 3"):
        multi_hot(np.array([3], np.uint16), 3, "s3://b/train item 4")
    assert multi_hot(np.array([2, 0], np.uint16), 3).tolist() == [1.0, 0.0, 1.0]
