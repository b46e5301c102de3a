"""Image folders as they are found on disk: directory and file links, EXIF orientation, the file types
predict reads, a val/ folder lacking a class, and the class count read from the folders or the shard index."""

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import open_dict
from PIL import Image, ImageOps
from test_data import write_png

from vitpipe.config.preflight import check_config
from vitpipe.data import ImageFolderDataModule
from vitpipe.data.images import open_image
from vitpipe.data.preprocess import Preprocess
from vitpipe.data.shards import ShardsDataModule, ShardSplit
from vitpipe.errors import ConfigError
from vitpipe.inference.images import ImageFiles, find_images
from vitpipe.run.build import build_from_config
from vitpipe.tasks.make_shards import INDEX_FILE, make_shards


@pytest.fixture(autouse=True)
def decode_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def root(tmp_path) -> Path:
    """train/ with 2 PNGs in each of cat and dog."""
    for c, name in enumerate(("cat", "dog")):
        for i in range(2):
            write_png(tmp_path / "imgs" / "train" / name / f"{i}.png", value=40 * c + i)
    return tmp_path / "imgs"


def folder(root, **overrides) -> ImageFolderDataModule:
    kwargs = dict(img_size=8, in_chans=3, num_classes=2, channels=3, root=str(root), batch_size=2, val_split=0,
                  augment=False)  # fmt: skip
    return ImageFolderDataModule(**(kwargs | overrides))


def names(dm) -> list[tuple[str, int]]:
    """(path relative to train/, label) of every training sample."""
    train = os.path.join(dm.root, "train")
    return sorted((os.path.relpath(p, train), y) for p, y in dm.data_train.base.samples)


# ---- directory and file links -------------------------------------------------------------------


@pytest.mark.parametrize("target", ["..", "../..", "../../..", "../dog", "../../val"])
def test_directory_link_into_or_above_the_tree_is_refused_by_name(root, target):
    """train/cat/loop -> .. made ~1,100 files out of 4 and labelled dog images as cat."""
    write_png(root / "val" / "cat" / "0.png", 1)
    write_png(root / "val" / "dog" / "0.png", 2)
    (root / "train" / "cat" / "loop").symlink_to(target, target_is_directory=True)
    with pytest.raises(ConfigError) as err:
        folder(root).setup("fit")
    msg = str(err.value)
    assert "\n" not in msg and "cat/loop" in msg and "link" in msg and len(msg) < 400


def test_class_folder_linked_to_another_split_is_refused(root):
    """val/cat -> ../train/cat would validate on training images."""
    write_png(root / "val" / "dog" / "0.png", 2)
    (root / "val" / "cat").symlink_to(root / "train" / "cat", target_is_directory=True)
    with pytest.raises(ConfigError, match=r"val/cat.*link"):
        folder(root).setup("fit")


def test_directory_link_outside_the_tree_is_followed_once(root, tmp_path):
    external = tmp_path / "more_cats"
    for i in range(3):
        write_png(external / f"x{i}.png", 100 + i)
    (root / "train" / "cat" / "more").symlink_to(external, target_is_directory=True)
    dm = folder(root)
    dm.setup("fit")
    assert names(dm) == [("cat/0.png", 0), ("cat/1.png", 0), ("cat/more/x0.png", 0), ("cat/more/x1.png", 0),
                         ("cat/more/x2.png", 0), ("dog/0.png", 1), ("dog/1.png", 1)]  # fmt: skip
    # the same outside folder a second time would count its images twice: refused, naming the second link
    (root / "train" / "dog" / "again").symlink_to(external, target_is_directory=True)
    with pytest.raises(ConfigError, match=r"dog/again.*link"):
        folder(root).setup("fit")
    # a loop inside the outside folder is refused too
    (root / "train" / "dog" / "again").unlink()
    (external / "loop").symlink_to("..", target_is_directory=True)
    with pytest.raises(ConfigError, match=r"cat/more/loop.*link"):
        folder(root).setup("fit")


def test_file_link_loop_is_one_short_line_or_skipped_counted(root):
    cat = root / "train" / "cat"
    (cat / "a.png").symlink_to("b.png")
    (cat / "b.png").symlink_to("a.png")
    (cat / "gone.png").symlink_to("nowhere.png")
    with pytest.raises(ConfigError) as err:
        folder(root).setup("fit")
    msg = str(err.value)
    assert "\n" not in msg and "3 unreadable images" in msg and "cat/a.png" in msg and "cat/gone.png" in msg
    assert msg.count(str(root)) == 1 and len(msg) < 250 + len(str(root)), msg  # the folder named once
    with pytest.warns(UserWarning, match=r"skipped 3 unreadable images in .*train, e.g. cat/a.png \(.*link"):
        dm = folder(root, on_bad_image="skip")
        dm.setup("fit")
    assert names(dm) == [("cat/0.png", 0), ("cat/1.png", 0), ("dog/0.png", 1), ("dog/1.png", 1)]


# ---- EXIF orientation -----------------------------------------------------------------------------


def exif_jpeg(path: Path, orientation: int = 6) -> np.ndarray:
    """A 10x16 JPEG whose pixels differ under every flip and turn, stored with an EXIF orientation;
    returns the upright pixels as PIL's exif_transpose gives them (16x10 for orientation 6)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    y, x = np.mgrid[0:10, 0:16]
    pixels = np.stack([x * 15, y * 25, (x < 4) * 200 + (y < 3) * 50], -1).astype(np.uint8)  # (10, 16, 3)
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels).save(path, quality=95, exif=exif)
    with Image.open(path) as im:
        stored = np.asarray(im.convert("RGB"))  # (10, 16, 3): as the pixels lie in the file
        upright = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    if orientation == 6:  # "rotate 90 degrees clockwise to display"
        assert upright.shape == (16, 10, 3) and np.array_equal(upright, np.rot90(stored, -1))
    assert not np.array_equal(upright, upright[::-1]) and not np.array_equal(upright, upright[:, ::-1])
    return upright


def test_exif_orientation_is_applied_when_opening(tmp_path):
    upright = exif_jpeg(tmp_path / "turned.jpg")
    assert np.array_equal(np.asarray(open_image(tmp_path / "turned.jpg")), upright)
    gray = np.asarray(open_image(tmp_path / "turned.jpg", "L"))
    assert gray.shape == (16, 10)


def test_exif_orientation_in_training_predict_and_shards(root, tmp_path):
    upright = exif_jpeg(root / "train" / "cat" / "turned.jpg")
    exif_jpeg(root / "val" / "cat" / "turned.jpg")
    write_png(root / "val" / "dog" / "0.png", 3)
    dm = folder(root, img_size=16)
    dm.setup("fit")
    # training: the image the data module loads, and the eval tensor of val/
    i = [Path(p).name for p, _ in dm.data_train.base.samples].index("turned.jpg")
    assert np.array_equal(np.asarray(dm.data_train.base[i][0]), upright)
    expected = dm.transform(train=False)(Image.fromarray(upright))  # (3, 16, 16)
    torch.testing.assert_close(dm.data_val[0][0], expected, rtol=0, atol=0)
    # predict: the file through the checkpoint's eval transform
    preprocess = Preprocess(folder(root, img_size=16), SimpleNamespace(in_chans=3, img_size=(16, 16)))
    _, x, why = ImageFiles([root / "train" / "cat" / "turned.jpg"], preprocess)[0]
    assert why is None
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    # shards keep the file's bytes (EXIF included) and decode them upright
    make_shards(folder(root), str(tmp_path / "sh"), shard_size="64KB")
    shard = ShardSplit(str(tmp_path / "sh" / "val"), 2, mode="RGB")
    assert np.array_equal(np.asarray(shard[0][0]), upright)


# ---- one rule for what an image file is -------------------------------------------------------------


def test_image_folder_and_predict_accept_the_same_files(root):
    cat = root / "train" / "cat"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (9, 7, 3), dtype=np.uint8)).save(cat / "anim.gif")
    Image.fromarray(rng.integers(0, 255, (9, 7, 3), dtype=np.uint8)).save(cat / "photo.jpg")
    Image.fromarray(rng.integers(0, 255, (9, 7, 3), dtype=np.uint8)).save(cat / "pic.webp")
    (cat / "notes.txt").write_text("hand-checked")
    (cat / "paper.pdf").write_bytes(b"%PDF-1.4 not an image")
    dm = folder(root)
    with pytest.warns(UserWarning, match=r"skipped 2 non-image files"):
        dm.setup("fit")
    in_folder = {Path(p).name for p, y in dm.data_train.base.samples if y == 0}
    found, passed_over = find_images(str(cat))
    assert in_folder == {p.name for p in found} == {"0.png", "1.png", "anim.gif", "photo.jpg", "pic.webp"}
    assert passed_over == 2
    i = [Path(p).name for p, _ in dm.data_train.base.samples].index("anim.gif")
    assert np.asarray(dm.data_train.base[i][0]).shape == (9, 7, 3)


# ---- val/ and test/ against train/ ----------------------------------------------------------------


def test_val_folder_missing_classes_names_them_and_the_folder(root):
    write_png(root / "train" / "bird" / "0.png", 7)
    write_png(root / "val" / "dog" / "0.png", 7)
    write_png(root / "val" / "fish" / "0.png", 7)
    with pytest.raises(ConfigError) as err:
        folder(root, num_classes=3).check()
    msg = str(err.value)
    assert "\n" not in msg and str(root / "val") in msg
    assert "bird, cat" in msg and "fish" in msg, msg


def _train_and_val_only(root: Path, n_train: int = 10, n_val: int = 2) -> Path:
    """train/ and val/ (no test/) with cat, dog and fish; every file a different gray."""
    for c, name in enumerate(("cat", "dog", "fish")):
        for i in range(n_train):
            write_png(root / "train" / name / f"{i}.png", value=10 * c + i)
        for i in range(n_val):
            write_png(root / "val" / name / f"{i}.png", value=100 + 10 * c + i)
    return root


FOLDER_RUN = ["debug=fast", "logger=none", "data=imagefolder", "model.img_size=16", "model.patch_size=4",
              "data.num_workers=0", "trainer.limit_test_batches=null", "callbacks.progress_bar.refresh_rate=1000"]


def test_folder_without_test_is_tested_on_images_held_out_of_train(tmp_path, cfg_factory, capsys):
    """No test/: the test split is a seeded 10% of train/ (data.test_split), stated at the start in one line,
    never trained or validated on; test/acc is computed on those images, not on val/ (which picked the
    checkpoint) as it was."""
    import csv

    import hydra

    from vitpipe.tasks.train import train

    root = _train_and_val_only(tmp_path / "imgs")
    cfg = cfg_factory(*FOLDER_RUN, f"data.root={root}")
    assert cfg.data.test_split == 0.1
    metrics = train(cfg)
    notes = [x for x in capsys.readouterr().err.splitlines() if "test/" in x and "held out" in x]
    assert len(notes) == 1 and "3 of the 30 images of train/" in notes[0] and "data.test_split=0.1" in notes[0], notes
    with (Path(cfg.paths.output_dir) / "predictions.csv").open() as f:
        tested = {os.path.relpath(r["path"], root) for r in csv.DictReader(f)}
    assert len(tested) == 3 and all(p.startswith("train" + os.sep) for p in tested), tested
    assert "test/acc" in metrics
    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("fit")
    used = {os.path.relpath(dm.data_train.base.samples[i][0], root) for i in range(len(dm.data_train))}
    assert used.isdisjoint(tested) and len(used) == 27  # the rest of train/ trains; val/ validates
    dm.setup("test")
    assert {os.path.relpath(p, root) for p, _ in dm.data_test.base.samples} == tested  # seeded: the same again
    other = hydra.utils.instantiate(cfg.data, seed=1)
    other.setup("test")
    assert {os.path.relpath(p, root) for p, _ in other.data_test.base.samples} != tested  # the seed picks them


def test_folder_without_test_and_test_split_0_reports_no_test_metrics(tmp_path, cfg_factory, capsys):
    """data.test_split=0 and no test/: no test split at all; no test/ keys (not val/ results renamed)."""
    from vitpipe.tasks.train import train

    root = _train_and_val_only(tmp_path / "imgs", n_train=4)
    metrics = train(cfg_factory(*FOLDER_RUN, f"data.root={root}", "data.test_split=0"))
    assert "val/acc" in metrics and not [k for k in metrics if k.startswith("test/")], metrics
    notes = [x for x in capsys.readouterr().err.splitlines() if "no test split" in x]
    assert len(notes) == 1 and "data.test_split=0" in notes[0], notes
    from vitpipe.tasks.evaluate import evaluate

    eval_cfg = cfg_factory(f"ckpt_path={next(tmp_path.rglob('epoch_*.ckpt'))}", "data=imagefolder", f"data.root={root}",
                           "data.test_split=0", "data.num_workers=0", config_name="eval", sub="eval")
    with pytest.raises(ConfigError, match="no test split.*split=val"):  # eval says so too, in one line
        evaluate(eval_cfg)
    assert "carve" not in capsys.readouterr().err  # the run's own test_split: nothing to warn about
    # eval's data= carving otherwise than the run (the yaml's 0.1 here) may test on training images: one line
    with open_dict(eval_cfg):
        eval_cfg.data.test_split = 0.1
    evaluate(eval_cfg)
    warned = [x for x in capsys.readouterr().err.splitlines() if "carve" in x]
    assert len(warned) == 1 and "data.test_split=0.1" in warned[0] and "(data.test_split=0)" in warned[0], warned


# ---- the class count from the folders or the shard index ------------------------------------------------


def test_imagefolder_num_classes_comes_from_the_class_folders(root, cfg_factory):
    assert folder(root, num_classes=None).num_classes == 2
    cfg = cfg_factory("data=imagefolder", f"data.root={root}", "debug=fast", "data.num_workers=0")
    assert cfg.data.num_classes is None
    check_config(cfg)  # before anything is built: the config the run stores carries the count
    assert cfg.data.num_classes == 2 and cfg.model.num_classes == 2
    dm, net, _ = build_from_config(cfg)
    assert dm.num_classes == 2 and net.head.out_features == 2
    with pytest.raises(ConfigError) as err:  # a number given: checked against the folders before a model is built
        build_from_config(cfg_factory("data=imagefolder", f"data.root={root}", "data.num_classes=3", "debug=fast"))
    msg = str(err.value)
    assert "\n" not in msg and "data.num_classes=3" in msg and "2 class folders" in msg
    with pytest.raises(ConfigError, match=r"model.num_classes=5 does not match data.num_classes=2"):
        check_config(cfg_factory("data=imagefolder", f"data.root={root}", "model.num_classes=5", "debug=fast"))
    with pytest.raises(ConfigError, match=rf"{root.parent}/train does not exist"):
        check_config(cfg_factory("data=imagefolder", f"data.root={root.parent}", "debug=fast"))


def test_shards_num_classes_comes_from_the_index(root, tmp_path, cfg_factory):
    write_png(root / "train" / "owl" / "0.png", 9)
    make_shards(folder(root, num_classes=3), str(tmp_path / "sh"), shard_size="64KB")
    shards = dict(root=str(tmp_path / "sh"), channels=3, img_size=8, in_chans=3, num_workers=0)
    assert ShardsDataModule(**shards, num_classes=None).num_classes == 3
    cfg = cfg_factory("data=shards", f"data.root={tmp_path / 'sh'}", "debug=fast")
    check_config(cfg)
    assert cfg.data.num_classes == 3 and cfg.model.num_classes == 3
    with pytest.raises(ConfigError) as err:
        build_from_config(cfg_factory("data=shards", f"data.root={tmp_path / 'sh'}", "data.num_classes=5", "debug=fast"))
    msg = str(err.value)
    assert "\n" not in msg and "data.num_classes=5" in msg and "3 classes" in msg
    (tmp_path / "sh" / INDEX_FILE).unlink()
    with pytest.raises(ConfigError, match="no shard index"):
        check_config(cfg_factory("data=shards", f"data.root={tmp_path / 'sh'}", "debug=fast"))


def test_num_classes_given_is_not_checked_against_files_at_config_time(cfg_factory, tmp_path):
    """An explicit count needs no files (a config composed where the data is not, e.g. for a SLURM job)."""
    cfg = cfg_factory("data=imagefolder", f"data.root={tmp_path / 'elsewhere'}", "data.num_classes=4", "debug=fast")
    check_config(cfg)
    assert cfg.data.num_classes == 4 and cfg.model.num_classes == 4
