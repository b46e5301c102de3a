"""Image files that would silently lie or fail late: 16-bit PNGs, truncated JPEGs, empty files,
non-image files; the full-decode check before training (data.on_bad_image) and its cache."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitpipe.data.images as images
from vitpipe.data import ImageFolderDataModule
from vitpipe.data.images import find_bad_images, open_image
from vitpipe.errors import ConfigError
from vitpipe.tasks.train import train


@pytest.fixture(autouse=True)
def decode_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def root(tmp_path) -> Path:
    """train/ with 3 good PNGs per class (a, b)."""
    for c in ("a", "b"):
        (tmp_path / "imgs" / "train" / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (12, 10), (40 * i, 20, 0)).save(tmp_path / "imgs" / "train" / c / f"{i}.png")
    return tmp_path / "imgs"


def truncated_jpeg(path: Path) -> None:
    """A JPEG cut in half: its header reads (PIL's verify() passes), decoding fails."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with Image.open(path) as im:
        im.verify()  # the old header-only check let this file through


def folder(root, **overrides) -> ImageFolderDataModule:
    kwargs = dict(img_size=8, in_chans=3, num_classes=2, channels=3, root=str(root), batch_size=2, val_split=0,
                  augment=False)  # fmt: skip
    return ImageFolderDataModule(**(kwargs | overrides))


def test_sixteen_bit_png_is_scaled_to_eight_bits_not_clipped(tmp_path, root):
    values = np.array([[0, 255, 256, 30000, 65535]], dtype=np.uint16).repeat(4, 0)  # (4, 5)
    Image.fromarray(values).save(tmp_path / "gray16.png")
    with Image.open(tmp_path / "gray16.png") as im:
        assert im.mode == "I;16"
    rgb = np.asarray(open_image(tmp_path / "gray16.png"))
    assert rgb.shape == (4, 5, 3) and rgb.dtype == np.uint8
    assert rgb[0, :, 0].tolist() == [0, 0, 1, 117, 255] and (rgb == rgb[..., :1]).all()  # value >> 8, gray
    assert np.asarray(open_image(tmp_path / "gray16.png", "L"))[0].tolist() == [0, 0, 1, 117, 255]
    # Through the data module: a flat 16-bit image of 30000 reaches the model as 117/255, not white.
    Image.fromarray(np.full((10, 12), 30000, np.uint16)).save(root / "train" / "a" / "flat16.png")
    dm = folder(root, mean=[0, 0, 0], std=[1, 1, 1])
    dm.setup("fit")
    i = [Path(f).name for f, _ in dm.data_train.base.samples].index("flat16.png")
    x, _ = dm.data_train[i]
    torch.testing.assert_close(x, torch.full((3, 8, 8), 117 / 255))


def test_float_images_are_refused_by_name(tmp_path):
    Image.fromarray(np.ones((4, 4), np.float32)).save(tmp_path / "f.tiff")
    with pytest.raises(ValueError, match="F .*pixels"):
        open_image(tmp_path / "f.tiff")


@pytest.mark.parametrize("kind", ["truncated", "empty"])
def test_bad_image_is_named_in_one_line_at_setup(root, kind):
    bad = root / "train" / "b" / ("cut.jpg" if kind == "truncated" else "empty.png")
    truncated_jpeg(bad) if kind == "truncated" else bad.touch()
    with pytest.raises(ConfigError) as err:
        folder(root).setup("fit")
    msg = str(err.value)
    assert "\n" not in msg and "1 unreadable images" in msg and f"b/{bad.name}" in msg
    assert ("truncated" if kind == "truncated" else "empty file") in msg and "on_bad_image=skip" in msg


def test_skip_leaves_bad_images_out_with_a_counted_warning(root):
    truncated_jpeg(root / "train" / "a" / "cut.jpg")
    (root / "train" / "b" / "empty.png").touch()
    (root / "train" / "b" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    dm = folder(root, on_bad_image="skip")
    with pytest.warns(UserWarning, match=r"skipped 3 unreadable images in .*train, e.g. a/cut.jpg"):
        dm.setup("fit")
    assert len(dm.data_train) == 6 and dm.data_train.base.targets == [0, 0, 0, 1, 1, 1]
    assert sum(len(y) for _, y in dm.train_dataloader()) == 6  # the loader never meets a bad file


def test_non_image_files_are_counted_not_silent(root):
    (root / "train" / "a" / "notes.txt").write_text("labels were checked by hand")
    (root / "train" / "b" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    dm = folder(root)
    with pytest.warns(UserWarning, match=r"skipped 2 non-image files in .*train"):
        dm.setup("fit")
    assert len(dm.data_train) == 6


def test_hidden_folders_are_not_classes(root):
    (root / "train" / ".ipynb_checkpoints").mkdir()
    Image.new("RGB", (4, 4)).save(root / "train" / ".ipynb_checkpoints" / "x.png")
    dm = folder(root)
    dm.setup("fit")
    assert dm.class_names == ["a", "b"] and len(dm.data_train) == 6


def test_second_check_decodes_only_new_or_changed_files(root, decode_cache, monkeypatch):
    decoded = []
    real = images.open_image
    monkeypatch.setattr(images, "open_image", lambda path, *a: decoded.append(Path(path).name) or real(path, *a))
    paths = sorted(str(p) for p in (root / "train").rglob("*.png"))
    assert find_bad_images(paths, folder=str(root / "train")) == {} and len(decoded) == 6
    assert len(list(decode_cache.rglob("*.json"))) == 1
    decoded.clear()
    assert find_bad_images(paths, folder=str(root / "train")) == {} and decoded == []  # all cached
    Image.new("RGB", (12, 10), (1, 2, 3)).save(root / "train" / "a" / "0.png")  # rewritten: new mtime/size
    truncated_jpeg(root / "train" / "b" / "cut.jpg")
    bad = find_bad_images([*paths, str(root / "train" / "b" / "cut.jpg")], folder=str(root / "train"))
    assert sorted(decoded) == ["0.png", "cut.jpg"] and list(bad) == [str(root / "train" / "b" / "cut.jpg")]
    decoded.clear()
    find_bad_images([str(root / "train" / "b" / "cut.jpg")], folder=str(root / "train"))
    assert decoded == ["cut.jpg"]  # a bad file is never cached as good


def test_truncated_jpeg_in_val_stops_training_before_the_first_step(cfg_factory, root):
    """The late failure this replaces: a whole training epoch, then a crash in validation."""
    (root / "val" / "a").mkdir(parents=True), (root / "val" / "b").mkdir(parents=True)
    Image.new("RGB", (12, 10)).save(root / "val" / "a" / "0.png")
    truncated_jpeg(root / "val" / "b" / "cut.jpg")
    common = ["data=imagefolder", f"data.root={root}", "data.num_classes=2", "debug=fast", "data.num_workers=0",
              "trainer.max_epochs=1", "test=false"]  # fmt: skip
    cfg = cfg_factory(*common)
    with pytest.raises(ConfigError, match=r"val: b/cut.jpg \(image file is truncated"):
        train(cfg)
    assert not (Path(cfg.paths.output_dir) / "checkpoints").exists()  # nothing trained
    with pytest.warns(UserWarning, match="skipped 1 unreadable images"):
        metrics = train(cfg_factory(*common, "data.on_bad_image=skip", sub="skip"))
    assert "val/acc" in metrics
