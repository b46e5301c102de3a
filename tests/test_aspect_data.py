"""scripts/make_aspect_data.py: Fashion-MNIST items on canvases of aspect 1:3 to 3:1, as an image folder."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitpipe.data.fashion_mnist import DEBIAN_DIR
from vitpipe.data.imagefolder import ImageFolderDataModule
from vitpipe.errors import ConfigError
from vitpipe.tasks.make_aspect_data import (
    MANIFEST,
    AspectConfig,
    load_source,
    main,
    make_aspect_data,
)

pytestmark = pytest.mark.skipif(not Path(DEBIAN_DIR).is_dir(), reason="needs Debian's dataset-fashion-mnist package")
COUNTS = {"train": 40, "val": 13, "test": 10}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _manifest(root: Path) -> list[dict]:
    with open(root / MANIFEST) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def aspect_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("aspect") / "set"
    make_aspect_data(AspectConfig(out=str(root), seed=3, **COUNTS), progress=False)
    return root


def test_same_seed_same_bytes_other_seed_other_set(aspect_set, tmp_path):
    again = make_aspect_data(AspectConfig(out=str(tmp_path / "again"), seed=3, **COUNTS), progress=False)
    other = make_aspect_data(AspectConfig(out=str(tmp_path / "other"), seed=4, **COUNTS), progress=False)
    first = _files(aspect_set)
    assert len(first) == sum(COUNTS.values()) + 1  # the images and the manifest
    assert _files(again) == first
    assert _files(other) != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_aspects_classes_and_pixels_match_the_source(aspect_set):
    source = load_source(DEBIAN_DIR)
    rows = _manifest(aspect_set)
    aspects = []
    for r in rows:
        img = np.asarray(Image.open(aspect_set / r["path"]))
        h, w, top, left = (int(r[k]) for k in ("height", "width", "top", "left"))
        assert img.shape == (h, w) and min(h, w) == 28 and 1 / 3 <= w / h <= 3, r
        aspects.append(w / h)
        images, labels = source[r["source_split"]]
        i = int(r["source_index"])
        assert int(r["label"]) == labels[i] and r["path"].split("/")[1].startswith(f"{labels[i]}_")
        assert (img[top : top + 28, left : left + 28] == images[i]).all()  # the item itself, unscaled
        rest = img.copy()
        rest[top : top + 28, left : left + 28] = 0
        assert rest.max() == 0  # background everywhere else
    assert min(aspects) < 0.6 and max(aspects) > 1.7  # tall and wide canvases both occur
    for split, n in COUNTS.items():  # class-balanced: counts differ by at most one
        per = Counter(r["label"] for r in rows if r["split"] == split)
        assert sum(per.values()) == n and max(per.values()) - min(per.values()) <= 1, (split, per)
    train = {(r["source_split"], r["source_index"]) for r in rows if r["split"] == "train"}
    val = {(r["source_split"], r["source_index"]) for r in rows if r["split"] == "val"}
    assert len(train) == COUNTS["train"] and not train & val  # val never repeats a training item


def test_squash_writes_the_same_canvases_resized_to_a_square(aspect_set, tmp_path):
    sq = make_aspect_data(AspectConfig(out=str(tmp_path / "sq"), seed=3, squash=28, **COUNTS), progress=False)
    assert (sq / MANIFEST).read_bytes() == (aspect_set / MANIFEST).read_bytes()
    for r in _manifest(aspect_set)[:10]:
        native = Image.open(aspect_set / r["path"])
        assert np.array_equal(np.asarray(Image.open(sq / r["path"])),
                              np.asarray(native.resize((28, 28), Image.Resampling.BICUBIC)))


def test_imagefolder_reads_it(aspect_set, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the image folder's decode cache
    dm = ImageFolderDataModule(root=str(aspect_set), img_size=28, in_chans=3, channels=3, fast_path=False,
                               batch_size=8, num_workers=0, augment=False)
    dm.setup("fit")
    dm.setup("test")
    assert dm.num_classes == 10
    assert (len(dm.data_train), len(dm.data_val), len(dm.data_test)) == tuple(COUNTS.values())
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 28, 28) and set(y.tolist()) <= set(range(10))


def test_bad_settings_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--short-side=2"):
        AspectConfig(out=str(tmp_path / "x"), short_side=2)
    with pytest.raises(ConfigError, match="--source-dir=.*lacks train-images"):
        make_aspect_data(AspectConfig(out=str(tmp_path / "x"), source_dir=str(tmp_path)), progress=False)
    assert main(["--out", str(tmp_path), "--train", "10"]) == 2  # exists
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "y"), "--train", "59990", "--val", "20", "--test", "0",
                 "--no-progress"]) == 2  # 6001 of a class with 6000
    assert not (tmp_path / "y").exists()
