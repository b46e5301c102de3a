"""Seams of shards and image folders: what make_shards keeps on a re-run (only splits written from the
same items with the same settings), the channel count data=shards reads from the index (as it reads the
class count), and a directory-link loop in an image folder refused in one line before anything starts.
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import pytest
from PIL import Image
from user_shell import SHORT_TRAIN, fresh_checkout, run, run_dir_of, user_env

from vitpipe.config.preflight import check_config
from vitpipe.data import ImageFolderDataModule
from vitpipe.data.shards import ShardsDataModule, ShardSplit
from vitpipe.data.synthetic import SyntheticDataModule
from vitpipe.errors import ConfigError
from vitpipe.tasks.make_shards import INDEX_FILE, RECORD_FILE, make_shards


@pytest.fixture(autouse=True)
def decode_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the image folder's decode cache


def _train_only_folder(root: Path, n: int = 24) -> Path:
    """train/c0..c2 only: the validation split is drawn from train/ by data.seed (as digits' is)."""
    for k in range(n):
        d = root / "train" / f"c{k % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (9, 9), (k * 10, 40 * (k % 3), 7)).save(d / f"{k:03d}.png")
    return root


def _dm(root: Path, seed: int = 0) -> ImageFolderDataModule:
    return ImageFolderDataModule(root=str(root), img_size=8, in_chans=3, channels=3, val_split=0.25, seed=seed)


def _stamps(out: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``out`` with its inode and mtime: a kept split is not written again."""
    return {str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))
            if p.is_file()}


def _stored_counts(split_dir: Path, count: int, num_classes: int) -> list[int]:
    """Images per class as the chunks hold them (not as the index says)."""
    split = ShardSplit(str(split_dir), count, mode="RGB")
    labels = collections.Counter(int(split.item(i)["label"]) for i in range(count))
    return [labels[c] for c in range(num_classes)]


# ---- item 2: a re-run keeps a split only if it was written from the same items and settings ------


def test_an_unchanged_rerun_keeps_every_split_and_the_index_holds_their_fingerprints(tmp_path, capsys):
    root, out = _train_only_folder(tmp_path / "img"), tmp_path / "sh"
    first = make_shards(_dm(root), str(out), shard_size="2KB")
    before = _stamps(out)
    again = make_shards(_dm(root), str(out), shard_size="2KB")
    said = capsys.readouterr().out
    assert "train is complete (18 images), kept" in said and "val is complete (6 images), kept" in said
    unchanged = {k: v for k, v in _stamps(out).items() if k != INDEX_FILE}
    assert unchanged == {k: v for k, v in before.items() if k != INDEX_FILE}  # no chunk written again
    for split in ("train", "val"):
        fp = again["splits"][split]["fingerprint"]
        assert fp == first["splits"][split]["fingerprint"] and fp["items"].startswith("sha256:")
        assert fp["count"] == again["splits"][split]["count"] and fp["shard_size"] == "2KB"
        assert json.loads((out / split / RECORD_FILE).read_text())["items"] == fp["items"]
    assert first["splits"]["train"]["fingerprint"]["seed"] == 0 and first["splits"]["val"]["fingerprint"]["seed"] is None


def test_another_data_seed_is_refused_before_anything_is_written_and_overwrite_writes_both_splits_again(tmp_path,
                                                                                                         capsys):
    root, out = _train_only_folder(tmp_path / "img"), tmp_path / "sh"
    make_shards(_dm(root), str(out), shard_size="2KB", settings={"seed": 0})
    before = _stamps(out)
    with pytest.raises(ConfigError) as err:  # the same counts (18 + 6): the old check kept both splits
        make_shards(_dm(root, seed=1), str(out), shard_size="2KB", settings={"seed": 1})
    msg = str(err.value)
    assert "\n" not in msg and f"out={out}" in msg and "train/, val/: other images or labels (data.seed 0 -> 1)" in msg
    assert "overwrite=true" in msg
    assert _stamps(out) == before  # nothing written, index included
    index = make_shards(_dm(root, seed=1), str(out), shard_size="2KB", settings={"seed": 1}, overwrite=True)
    assert "written again (overwrite=true)" in capsys.readouterr().out
    source = _dm(root, seed=1)
    source.setup("fit")
    for split, ds in (("train", source.data_train), ("val", source.data_val)):
        meta = index["splits"][split]
        expected = collections.Counter(int(ds[i][1]) for i in range(len(ds)))
        # the index describes the chunks, and both are the seed-1 split
        assert _stored_counts(out / split, meta["count"], 3) == meta["class_counts"] == [expected[c] for c in range(3)]


@pytest.mark.parametrize("change, refused", [
    (dict(seed=5), "train/: seed 0 -> 5"),                        # the training order
    (dict(shard_size="1KB"), "train/, val/: shard_size 2KB -> 1KB"),  # the chunks
])  # fmt: skip
def test_a_changed_writer_setting_is_not_kept(tmp_path, change, refused):
    root, out = _train_only_folder(tmp_path / "img"), tmp_path / "sh"
    make_shards(_dm(root), str(out), shard_size="2KB", seed=0)
    with pytest.raises(ConfigError, match="add overwrite=true") as err:
        make_shards(_dm(root), str(out), **{"shard_size": "2KB", "seed": 0, **change})
    assert refused in str(err.value)


def test_a_source_image_changed_in_place_is_not_kept(tmp_path):
    root, out = _train_only_folder(tmp_path / "img"), tmp_path / "sh"
    make_shards(_dm(root), str(out), shard_size="2KB")
    image = next((root / "train" / "c1").iterdir())
    Image.new("RGB", (9, 9), (255, 255, 255)).save(image)  # same name, same size: other pixels
    os.utime(image, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(ConfigError, match="other images or labels"):
        make_shards(_dm(root), str(out), shard_size="2KB")


def test_shards_of_an_earlier_make_shards_without_a_record_are_refused_then_rewritten_with_overwrite(tmp_path):
    root, out = _train_only_folder(tmp_path / "img"), tmp_path / "sh"
    make_shards(_dm(root), str(out), shard_size="2KB")
    for split in ("train", "val"):
        (out / split / RECORD_FILE).unlink()  # what releases before the fingerprint wrote
    index = json.loads((out / INDEX_FILE).read_text())
    for meta in index["splits"].values():
        meta.pop("fingerprint")
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="written by an earlier make_shards, which kept no record"):
        make_shards(_dm(root), str(out), shard_size="2KB")
    make_shards(_dm(root), str(out), shard_size="2KB", overwrite=True)
    assert all((out / split / RECORD_FILE).is_file() for split in ("train", "val"))


def test_a_folder_named_like_a_split_that_make_shards_did_not_write_is_never_removed(tmp_path):
    root, out = _train_only_folder(tmp_path / "img"), tmp_path / "sh"
    mine = out / "val" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    with pytest.raises(ConfigError, match="is not a split make_shards wrote"):
        make_shards(_dm(root), str(out), shard_size="2KB", overwrite=True)
    assert mine.read_text() == "mine"


def test_an_interrupted_rewrite_leaves_no_index_describing_the_old_chunks(tmp_path, monkeypatch):
    import vitpipe.tasks.make_shards as ms

    root, out = _train_only_folder(tmp_path / "img"), tmp_path / "sh"
    make_shards(_dm(root), str(out), shard_size="2KB")

    def dies(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(ms, "write_split", dies)
    with pytest.raises(KeyboardInterrupt):
        make_shards(_dm(root, seed=1), str(out), shard_size="2KB", overwrite=True)
    assert not (out / INDEX_FILE).exists()  # data=shards refuses the folder until a run completes


@pytest.mark.slow  # three make_shards start-ups (~15 s)
def test_make_shards_rerun_with_another_data_seed_as_typed(tmp_path):
    cwd, out = fresh_checkout(tmp_path / "w"), tmp_path / "S"
    first = run(f"python scripts/make_shards.py out={out}", cwd)
    assert first.returncode == 0, first.stderr[-2000:]
    index_before = (out / INDEX_FILE).read_bytes()
    second = run(f"python scripts/make_shards.py out={out} data.seed=1", cwd)
    assert second.returncode == 2, second.stderr[-2000:]
    assert second.stderr.strip().splitlines() == [second.stderr.strip()], second.stderr[-2000:]
    assert second.stderr.startswith("vitpipe: error: ") and "data.seed 0 -> 1" in second.stderr
    assert "kept" not in second.stdout and (out / INDEX_FILE).read_bytes() == index_before
    third = run(f"python scripts/make_shards.py out={out} data.seed=1 overwrite=true", cwd)
    assert third.returncode == 0, third.stderr[-2000:]
    index = json.loads((out / INDEX_FILE).read_text())
    for split in ("train", "val"):
        meta = index["splits"][split]
        assert _stored_counts(out / split, meta["count"], 10) == meta["class_counts"]


# ---- item 11: data=shards takes the channel count from the index, as it takes the class count -----


@pytest.fixture(scope="module")
def gray_shards(tmp_path_factory):
    """Shards of 1-channel images (5 classes, 6x6), as make_shards writes them from any grayscale source."""
    out = tmp_path_factory.mktemp("gray") / "shards"
    dm = SyntheticDataModule(num_classes=5, channels=1, native_size=6, length=40, img_size=8, in_chans=1, seed=0)
    make_shards(dm, str(out), shard_size="4KB")
    return out


def test_data_shards_of_grayscale_images_take_one_channel_and_the_model_follows(gray_shards, cfg_factory):
    cfg = cfg_factory("data=shards", f"data.root={gray_shards}", "model=vit_nano")
    check_config(cfg)  # what train, eval's data= and the stored config go through
    assert cfg.data.channels == 1 and cfg.model.in_chans == 1 and cfg.model.num_classes == 5
    dm = ShardsDataModule(root=str(gray_shards), img_size=8, batch_size=4, num_workers=0)  # no config: the index's
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert dm.channels == dm.in_chans == 1 and x.shape == (4, 1, 8, 8) and y.max() < 5


def test_a_run_config_carries_the_index_facts_so_its_transforms_build_where_the_shards_are_not(gray_shards,
                                                                                                cfg_factory, tmp_path):
    cfg = cfg_factory("data=shards", f"data.root={gray_shards}", "model=vit_nano")
    check_config(cfg)
    index = json.loads((gray_shards / INDEX_FILE).read_text())
    facts = {k: cfg.data[k] for k in ("num_classes", "channels", "mean", "std", "native_size")}
    assert facts == {k: index[k] for k in facts} and facts["native_size"] == [6, 6]
    elsewhere = tmp_path / "data"  # where predict's rebuild moves a stored root: no index there
    elsewhere.mkdir()
    dm = ShardsDataModule(root=str(elsewhere), img_size=8, in_chans=1, **facts)
    x = dm.transform(train=False)(Image.new("L", (6, 6), 200))
    expected = (200 / 255 - index["mean"][0]) / index["std"][0]
    assert x.shape == (1, 8, 8) and abs(float(x.mean()) - expected) < 1e-4  # the run's own normalisation
    with pytest.raises(ConfigError, match="no shard index"):  # training and eval still need the shards
        dm.check()


def test_a_channel_count_given_against_the_index_is_one_line_naming_both(gray_shards):
    with pytest.raises(ConfigError) as err:
        ShardsDataModule(root=str(gray_shards), channels=3, img_size=8, in_chans=3)
    msg = str(err.value)
    assert "\n" not in msg and "data.channels=3" in msg and "1-channel images" in msg and "data.channels=1" in msg


@pytest.mark.slow  # four script start-ups (make_shards, train, eval, predict: 40-150 s on 2 shared cores)
def test_make_shards_of_digits_then_train_eval_and_predict_as_typed(tmp_path):
    cwd, out = fresh_checkout(tmp_path / "w"), tmp_path / "S"
    made = run(f"python scripts/make_shards.py data=digits out={out}", cwd)
    assert made.returncode == 0, made.stderr[-2000:]
    trained = run(["python", "scripts/train.py", "data=shards", f"data.root={out}", *SHORT_TRAIN], cwd)
    assert trained.returncode == 0, trained.stderr[-2000:]
    run_dir = run_dir_of(trained.stdout)
    stored = (run_dir / "config.yaml").read_text()
    assert "in_chans: 1" in stored and "channels: 1" in stored and "in_chans: 3" not in stored
    evaluated = run(["python", "scripts/eval.py", f"ckpt_path={run_dir}", "data=shards", f"data.root={out}",
                     "++trainer.limit_test_batches=2"], cwd)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "test/acc" in evaluated.stdout
    Image.new("L", (8, 8), 90).save(tmp_path / "digit.png")
    predicted = run(["python", "scripts/predict.py", f"ckpt_path={run_dir}", f"images={tmp_path / 'digit.png'}",
                     f"out={tmp_path / 'p.csv'}"], cwd)  # the stored root moves under data/: no index there
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    assert "digit.png" in (tmp_path / "p.csv").read_text()


# ---- item 10: a directory-link loop in an image folder is one line, before anything starts ------------


def _looping_folder(root: Path) -> Path:
    for c in ("cat", "dog"):
        (root / "train" / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (12, 12), (i * 40, 9, 9)).save(root / "train" / c / f"{i}.png")
    (root / "train" / "cat" / "loop").symlink_to("..", target_is_directory=True)
    return root


def test_check_refuses_a_directory_link_loop_before_setup(tmp_path):
    dm = ImageFolderDataModule(root=str(_looping_folder(tmp_path / "img")), img_size=8, in_chans=3, channels=3)
    with pytest.raises(ConfigError, match=r"train/cat/loop is a directory link to .*a loop"):
        dm.check()  # what train runs before the Trainer starts; setup() found it only after


@pytest.mark.slow  # one train.py start-up (10-35 s on 2 shared cores)
def test_train_on_an_image_folder_with_a_link_loop_prints_one_line(tmp_path):
    root = _looping_folder(tmp_path / "img")
    r = run(f"python scripts/train.py data=imagefolder data.root={root}", fresh_checkout(tmp_path / "w"),
            env=user_env(XDG_CACHE_HOME=str(tmp_path / "cache")))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vitpipe: error: imagefolder: train/cat/loop is a directory link"), lines


def test_the_record_of_what_a_split_was_written_from_never_holds_storage_credentials():
    from omegaconf import OmegaConf

    from vitpipe.tasks.make_shards import _settings

    data = OmegaConf.create({"_target_": "vitpipe.data.shards.ShardsDataModule", "root": "s3://b/p", "seed": 3,
                             "storage_options": {"aws_secret_access_key": "SECRET"}, "cache_dir": "/scratch"})
    assert _settings(data) == {"_target_": "vitpipe.data.shards.ShardsDataModule", "root": "s3://b/p", "seed": 3}
