"""Classification DataModules: splits, validation, real torchvision loaders on files the tests
write, the fast on-device path (DDP sharding, augmentation) and its agreement with the standard path."""

import gzip
import hashlib
import os
import pickle
import struct
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
import torchvision
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image
from sklearn.datasets import load_digits

from vitpipe.data import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    DigitsDataModule,
    FashionMNISTDataModule,
    ImageFolderDataModule,
    SyntheticDataModule,
)
from vitpipe.data.digits import DIGITS
from vitpipe.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "data"
DEBIAN_FMNIST = "/usr/share/datasets/fashion-mnist"


@pytest.fixture(autouse=True)
def decode_cache(tmp_path, monkeypatch):
    """Image folders remember decoded files under $XDG_CACHE_HOME: keep that out of the home directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def digits(**overrides) -> DigitsDataModule:
    kwargs = dict(img_size=8, in_chans=1, num_classes=10, channels=1, batch_size=64)
    return DigitsDataModule(**(kwargs | overrides))


def synthetic(**overrides) -> SyntheticDataModule:
    kwargs = dict(img_size=32, in_chans=3, num_classes=10, channels=3, length=100, test_length=20, val_split=0.2)
    return SyntheticDataModule(**(kwargs | overrides))


def first_batch(loader):
    return next(iter(loader))


# ---- files in the on-disk formats torchvision reads ---------------------------------------


def write_cifar10(root: Path, *, per_batch: int = 3, n_test: int = 5):
    """CIFAR-10's python layout: pickled dicts with 'data' (N, 3072) rows R|G|B and 'labels'."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    splits = {"train": ([], []), "test": ([], [])}
    names = [(f"data_batch_{i}", "train", per_batch) for i in range(1, 6)] + [("test_batch", "test", n_test)]
    for name, split, n in names:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "data": data, "labels": labels}, f)
        splits[split][0].append(data.reshape(n, 3, 32, 32))
        splits[split][1].extend(labels)
    class_names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": class_names, "num_cases_per_batch": per_batch, "num_vis": 3072}, f)
    return {k: (np.concatenate(v[0]), np.array(v[1])) for k, v in splits.items()}, class_names


@pytest.fixture
def cifar_files(tmp_path, monkeypatch):
    # torchvision checks each file's md5 against the real CIFAR-10 archive's; the files written
    # here are tiny stand-ins in the same format, so the md5 checks are bypassed (only those).
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    expected, class_names = write_cifar10(tmp_path / "data")
    return tmp_path / "data", expected, class_names


def write_idx_gz(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray):
    """MNIST idx format (big-endian): magic 0x803 + dims for images, 0x801 + count for labels."""
    n, h, w = images.shape
    with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">IIII", 0x803, n, h, w) + images.tobytes())
    with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">II", 0x801, n) + labels.astype(np.uint8).tobytes())


@pytest.fixture
def fmnist_system_dir(tmp_path):
    """A stand-in for Debian's /usr/share/datasets/fashion-mnist with a few images."""
    folder = tmp_path / "system"
    folder.mkdir()
    rng = np.random.default_rng(1)
    data = {}
    for prefix, n in (("train", 12), ("t10k", 5)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n)
        write_idx_gz(folder, prefix, images, labels)
        data[prefix] = (images, labels)
    return folder, data


def write_png(path: Path, value: int, size=(12, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((*size, 3), value, dtype=np.uint8)).save(path)


@pytest.fixture
def image_root(tmp_path):
    root = tmp_path / "images"
    for split, n in (("train", 4), ("test", 2)):
        for c, name in enumerate(("cat", "dog")):
            for i in range(n):
                write_png(root / split / name / f"{i}.png", value=40 * c + i, size=(12 + i, 10))
    return root


# ---- digits: shapes, splits, statistics ----------------------------------------------------


def test_digits_batches_have_contract_shapes_dtype_and_range():
    dm = digits()
    dm.setup("fit")
    x, y = first_batch(dm.train_dataloader())
    assert x.dtype == torch.uint8 and x.shape == (64, 1, 8, 8)
    assert y.dtype == torch.int64 and y.shape == (64,) and int(y.min()) >= 0 and int(y.max()) < 10
    assert int(x.max()) == 255  # 16 maps to 255: the full uint8 range is used
    out, y2 = dm.on_after_batch_transfer((x, y), 0)  # no trainer: the training transform
    assert out.dtype == torch.float32 and out.shape == (64, 1, 8, 8) and torch.equal(y2, y)
    ev = dm.augment_batch(x, train=False)
    pixels = ev * dm.std[0] + dm.mean[0]  # undo the normalisation: back in [0, 1]
    assert float(pixels.min()) >= -1e-6 and float(pixels.max()) <= 1 + 1e-6
    torch.testing.assert_close(pixels, x.float() / 255)


def test_digits_split_sizes_add_up_without_overlap():
    dm = digits(val_split=0.1)
    dm.setup("fit")
    dm.setup("test")
    n_train_pool = 1797 - 360  # fixed stratified 20% test split
    assert len(dm.data_test) == 360
    assert len(dm.data_train) + len(dm.data_val) == n_train_pool
    assert len(dm.data_val) == round(0.1 * n_train_pool)
    train, val = set(dm.train_indices.tolist()), set(dm.val_indices.tolist())
    assert not train & val and train | val == set(range(n_train_pool))
    # Stratified: every class has 36 (or 37) test images of its ~180.
    counts = torch.bincount(dm.data_test.labels, minlength=10)
    assert int(counts.min()) >= 35 and int(counts.max()) <= 37
    # No test image is among the training pool's (digits has no pixel-identical duplicates).
    pool = {bytes(img.numpy()) for img in dm.data_train.images} | {bytes(img.numpy()) for img in dm.data_val.images}
    assert len(pool) == n_train_pool
    assert not any(bytes(img.numpy()) in pool for img in dm.data_test.images)


def test_split_is_fixed_by_seed_and_changes_with_it():
    a, b, c = digits(seed=3), digits(seed=3), digits(seed=4)
    for dm in (a, b, c):
        dm.setup("fit")
    assert torch.equal(a.val_indices, b.val_indices) and torch.equal(a.data_val.images, b.data_val.images)
    assert not torch.equal(a.val_indices, c.val_indices)
    # The held-out test split does not depend on the training seed.
    a.setup("test"), c.setup("test")
    assert torch.equal(a.data_test.images, c.data_test.images)


def test_val_split_as_count_and_zero():
    dm = digits(val_split=100)
    dm.setup("fit")
    assert len(dm.data_val) == 100 and len(dm.data_train) == 1437 - 100
    dm0 = digits(val_split=0)
    dm0.setup("fit")
    assert len(dm0.data_val) == 0 and dm0.val_dataloader() == []
    with pytest.raises(ConfigError, match="val_split"):
        d = digits(val_split=1437)
        d.setup("fit")


def test_digits_statistics_match_the_data():
    images = np.rint(load_digits().images * (255 / 16)) / 255
    assert abs(images.mean() - DIGITS.mean[0]) < 1e-3 and abs(images.std() - DIGITS.std[0]) < 1e-3


# ---- argument validation: the config check before the module is built; the data set's facts in it ----------


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(num_classes=7), ["num_classes=7", "10"]),
        (dict(channels=3), ["channels=3", "1"]),
        (dict(img_size=0), ["img_size=0"]),
        (dict(img_size=[8]), ["img_size=[8]"]),
        (dict(in_chans=2), ["in_chans=2", "1-channel"]),
        (dict(mean=[0.1, 0.2]), ["data.mean"]),
    ],
)
def test_bad_arguments_raise_config_error_naming_the_value(overrides, words):
    """What the data set is (its classes, channels, the model's input size for it): the constructor compares."""
    with pytest.raises(ConfigError) as err:
        digits(**overrides)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "override, words",
    [
        ("data.batch_size=0", ["batch_size=0"]),
        ("data.eval_batch_size=-1", ["eval_batch_size=-1"]),
        ("data.val_split=1.0", ["val_split=1.0"]),
        ("data.val_split=-3", ["val_split=-3"]),
        ("data.img_size=0", ["img_size=0"]),
        ("data.fast_path=true +data.auto_augment=rand-m9-n2", ["auto_augment", "fast_path=false"]),
        ("data.crop_padding=-1", ["crop_padding=-1"]),
        ("data.sampler=balanced data.shuffle=false", ["data.sampler=balanced", "data.shuffle=false"]),
    ],
)
def test_bad_arguments_are_refused_by_the_config_check_before_the_module_is_built(cfg_factory, override, words):
    """Values and pairs of values the config alone refuses: vitpipe.config.preflight, before any data module."""
    from vitpipe.config.preflight import check_config

    with pytest.raises(ConfigError) as err:
        check_config(cfg_factory("debug=fast", "logger=none", *override.split()))
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_rgb_data_for_a_one_channel_model_is_refused():
    with pytest.raises(ConfigError, match=r"in_chans=1.*3-channel"):
        synthetic(in_chans=1)


def test_constructor_is_cheap(tmp_path):
    dm = digits()
    assert dm.data_train is None and dm._splits is None  # nothing loaded yet
    CIFAR10DataModule(img_size=32, in_chans=3, num_classes=10, channels=3, root=str(tmp_path))  # no files: fine


def test_img_size_accepts_pairs_from_hydra():
    dm = digits(img_size=OmegaConf.create([8, 12]))
    assert dm.img_size == (8, 12)
    dm.setup("fit")
    x, _ = first_batch(dm.train_dataloader())
    assert dm.augment_batch(x, train=False).shape == (64, 1, 8, 12)


# ---- real torchvision classes on files the tests write ------------------------------------


def test_cifar10_loads_through_torchvision_from_pickles(cifar_files):
    root, expected, class_names = cifar_files
    dm = CIFAR10DataModule(img_size=32, in_chans=3, num_classes=10, channels=3, root=str(root), val_split=5)
    dm.check()
    dm.setup("fit")
    dm.setup("test")
    assert dm.class_names == class_names
    train_images, train_labels = expected["train"]
    assert len(dm.data_train) == 10 and len(dm.data_val) == 5
    # Pixels and labels round-trip exactly: the val rows are the expected rows at val_indices.
    idx = dm.val_indices.numpy()
    assert np.array_equal(dm.data_val.images.numpy(), train_images[idx])
    assert np.array_equal(dm.data_val.labels.numpy(), train_labels[idx])
    assert np.array_equal(dm.data_test.images.numpy(), expected["test"][0])
    # The standard path (PIL from torchvision's __getitem__) gives the same eval tensors.
    std = CIFAR10DataModule(img_size=32, in_chans=3, num_classes=10, channels=3, root=str(root), fast_path=False)
    std.setup("test")
    x_std, y_std = first_batch(std.test_dataloader())
    x_fast = dm.augment_batch(dm.data_test.images, train=False)
    assert torch.equal(y_std, dm.data_test.labels)
    assert (x_std - x_fast).abs().max() < 1e-5


def test_cifar10_corrupted_files_raise_config_error(tmp_path):
    write_cifar10(tmp_path)  # md5 check NOT bypassed: these files are not the real archive's
    dm = CIFAR10DataModule(img_size=32, in_chans=3, num_classes=10, channels=3, root=str(tmp_path))
    with pytest.raises(ConfigError, match="corrupted"):
        dm.setup("fit")


@pytest.mark.parametrize("stage", ["check", "prepare_data", "setup"])
def test_missing_cifar_offline_says_download(tmp_path, stage):
    dm = CIFAR10DataModule(img_size=32, in_chans=3, num_classes=10, channels=3, root=str(tmp_path))
    with pytest.raises(ConfigError, match="download") as err:
        getattr(dm, stage)()
    assert "cifar-10-batches-py" in str(err.value)


def test_missing_fashion_mnist_offline_says_download(tmp_path):
    dm = FashionMNISTDataModule(
        img_size=28, in_chans=1, num_classes=10, channels=1, root=str(tmp_path), system_dir=str(tmp_path / "none")
    )
    with pytest.raises(ConfigError, match="download"):
        dm.check()
    with pytest.raises(ConfigError, match="download"):
        dm.setup("fit")


def test_fashion_mnist_from_debian_layout_round_trips(tmp_path, fmnist_system_dir):
    system_dir, data = fmnist_system_dir
    root = tmp_path / "data"
    dm = FashionMNISTDataModule(
        img_size=28, in_chans=1, num_classes=10, channels=1, root=str(root), system_dir=str(system_dir), val_split=0
    )
    dm.prepare_data()  # decompresses into root/FashionMNIST/raw, where torchvision reads
    assert sorted(os.listdir(root / "FashionMNIST" / "raw")) == sorted(dm._file_names())
    dm.setup()
    assert dm.class_names[0] == "T-shirt/top"
    for ds, prefix in ((dm.data_train, "train"), (dm.data_test, "t10k")):
        images, labels = data[prefix]
        assert np.array_equal(ds.images[:, 0].numpy(), images)
        assert np.array_equal(ds.labels.numpy(), labels)


def test_fashion_mnist_setup_alone_uses_system_files(tmp_path, fmnist_system_dir):
    system_dir, data = fmnist_system_dir
    dm = FashionMNISTDataModule(
        img_size=28, in_chans=1, num_classes=10, channels=1, root=str(tmp_path / "d"), system_dir=str(system_dir)
    )
    dm.setup("test")  # no prepare_data(): the copy still happens
    assert np.array_equal(dm.data_test.labels.numpy(), data["t10k"][1])


@pytest.mark.skipif(not os.path.isdir(DEBIAN_FMNIST), reason="Debian's fashion-mnist package is not installed")
def test_real_fashion_mnist_from_debian_package(tmp_path):
    dm = FashionMNISTDataModule(img_size=28, in_chans=1, num_classes=10, channels=1, root=str(tmp_path), val_split=0)
    dm.setup()
    assert len(dm.data_train) == 60000 and len(dm.data_test) == 10000
    assert dm.data_train.images.shape == (60000, 1, 28, 28)
    assert torch.equal(torch.bincount(dm.data_test.labels), torch.full((10,), 1000))
    # The published statistics the module normalises with.
    pixels = dm.data_train.images.float() / 255
    assert abs(pixels.mean() - dm.mean[0]) < 1e-3 and abs(pixels.std() - dm.std[0]) < 1e-3


# ---- image folders ---------------------------------------------------------------------


def imagefolder(root, **overrides) -> ImageFolderDataModule:
    kwargs = dict(img_size=16, in_chans=3, num_classes=2, channels=3, root=str(root), batch_size=4, val_split=2)
    return ImageFolderDataModule(**(kwargs | overrides))


def test_imagefolder_loads_user_images(image_root):
    dm = imagefolder(image_root)
    dm.setup("fit")
    dm.setup("test")
    assert dm.class_names == ["cat", "dog"]
    assert len(dm.data_train) == 6 and len(dm.data_val) == 2 and len(dm.data_test) == 4
    x, y = first_batch(dm.test_dataloader())
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32 and y.tolist() == [0, 0, 1, 1]
    x, _ = first_batch(dm.train_dataloader())
    assert x.shape == (4, 3, 16, 16)


def test_every_data_module_names_its_classes(image_root, cifar_files, tmp_path):
    """class_names[i] names label i: static ones from construction, file-based ones from the files."""
    assert digits().class_names == [str(d) for d in range(10)]  # before setup(): static
    assert synthetic(num_classes=3).class_names == ["class_0", "class_1", "class_2"]
    fm = FashionMNISTDataModule(img_size=28, in_chans=1, num_classes=10, channels=1, root=str(tmp_path))
    assert fm.class_names == torchvision.datasets.FashionMNIST.classes and fm.class_names[0] == "T-shirt/top"
    folder = imagefolder(image_root)
    folder.check()  # a folder's names are known once its class folders are listed
    assert folder.class_names == ["cat", "dog"]
    root, _, names = cifar_files
    cifar = CIFAR10DataModule(img_size=32, in_chans=3, num_classes=10, channels=3, root=str(root), val_split=5)
    cifar.setup("fit")  # read from the data's own batches.meta
    assert cifar.class_names == names and cifar.class_names[0] == "airplane"


def test_imagefolder_corrupt_image_names_the_file(image_root):
    bad = image_root / "train" / "dog" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    with pytest.raises(ConfigError, match="broken.png"):
        imagefolder(image_root).setup("fit")


def test_imagefolder_num_classes_checked_against_folders(image_root):
    dm = imagefolder(image_root, num_classes=3)
    with pytest.raises(ConfigError, match=r"num_classes=3.*2 class folders"):
        dm.check()
    with pytest.raises(ConfigError, match="fast_path"):
        imagefolder(image_root, fast_path=True)


def test_imagefolder_without_test_split_never_tests_on_val(image_root):
    """No test/: test images are held out of train/ (test_split), or there are none; never the validation
    split (tests/test_image_folders.py runs it end to end)."""
    import shutil

    shutil.rmtree(image_root / "test")
    dm = imagefolder(image_root)  # test_split None: no test split
    dm.setup("test")
    assert len(dm.data_test) == 0 and dm.test_dataloader() == []
    dm = imagefolder(image_root, test_split=2)
    dm.setup("fit")
    dm.setup("test")
    assert (len(dm.data_train), len(dm.data_val), len(dm.data_test)) == (4, 2, 2)


# ---- the fast path ---------------------------------------------------------------------


def test_fast_path_loader_shards_disjointly_over_ranks():
    dm = synthetic(batch_size=16)
    dm.setup("fit")
    row_to_index = {hashlib.sha1(img.numpy().tobytes()).hexdigest(): i for i, img in enumerate(dm.data_train.images)}
    assert len(row_to_index) == 80
    shards = []
    for rank in range(2):
        dm.trainer = SimpleNamespace(world_size=2, global_rank=rank)  # what the module's loaders read under DDP
        seen = []
        for x, _y in dm.train_dataloader():
            assert x.dtype == torch.uint8 and x.shape[1:] == (3, 32, 32)
            seen += [row_to_index[hashlib.sha1(img.numpy().tobytes()).hexdigest()] for img in x]
        shards.append(seen)
    assert len(shards[0]) == len(shards[1]) == 40
    assert not set(shards[0]) & set(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(range(80))


def asymmetric_batch(n: int) -> torch.Tensor:
    img = torch.arange(3 * 6 * 5, dtype=torch.uint8).reshape(1, 3, 6, 5) * 2  # every pixel differs
    return img.expand(n, -1, -1, -1).contiguous()


def test_flip_flips_and_keeps_shape():
    torch.manual_seed(0)
    dm = synthetic(img_size=(6, 5), native_size=(6, 5), crop_padding=0)
    x = asymmetric_batch(64)
    out = dm.augment_batch(x, train=True)
    plain, mirrored = dm.augment_batch(x[:1], train=False), dm.augment_batch(x[:1].flip(-1), train=False)
    is_plain = (out == plain).flatten(1).all(1)
    is_mirrored = (out == mirrored).flatten(1).all(1)
    assert out.shape == (64, 3, 6, 5)
    assert bool((is_plain ^ is_mirrored).all())  # each sample is one or the other
    assert 10 < int(is_mirrored.sum()) < 54  # about half are flipped
    assert not torch.equal(plain, mirrored)


def test_crop_is_a_shift_of_the_zero_padded_image():
    torch.manual_seed(0)
    p = 2
    dm = synthetic(img_size=(6, 5), native_size=(6, 5), crop_padding=p, hflip=False)
    x = asymmetric_batch(32)
    from vitpipe.data.fast import random_crop

    out = random_crop(x, p)
    assert out.shape == x.shape and out.dtype == torch.uint8
    padded = torch.nn.functional.pad(x[0], (p, p, p, p))
    offsets = set()
    for sample in out:
        matches = [
            (dy, dx) for dy in range(2 * p + 1) for dx in range(2 * p + 1)
            if torch.equal(sample, padded[:, dy : dy + 6, dx : dx + 5])
        ]  # fmt: skip
        assert len(matches) == 1
        offsets.add(matches[0])
    assert len(offsets) > 5  # offsets vary per sample, not one per batch
    assert dm.augment_batch(x, train=True).shape == (32, 3, 6, 5)


def test_eval_path_is_deterministic_and_hook_follows_trainer_state():
    dm = digits(img_size=16)
    dm.setup("fit")
    x, y = first_batch(dm.val_dataloader())
    a, b = dm.augment_batch(x, train=False), dm.augment_batch(x, train=False)
    assert torch.equal(a, b) and a.shape == (64, 1, 16, 16)
    dm.trainer = SimpleNamespace(training=False)  # validation: no augmentation
    assert torch.equal(dm.on_after_batch_transfer((x, y), 0)[0], a)
    dm.trainer = SimpleNamespace(training=True)
    torch.manual_seed(0)
    assert not torch.equal(dm.on_after_batch_transfer((x, y), 0)[0], a)


@pytest.mark.parametrize(
    "make, img_size, in_chans",
    [(digits, 8, 1), (digits, 32, 3), (digits, 20, 1), (synthetic, 32, 3), (synthetic, 24, 3)],
)
def test_fast_and_standard_paths_give_the_same_eval_tensors(make, img_size, in_chans):
    """Same pixels in, same tensors out: no resize, upsampling, and (synthetic 32 -> 24) downsampling."""
    fast = make(img_size=img_size, in_chans=in_chans, eval_batch_size=360)
    slow = make(img_size=img_size, in_chans=in_chans, eval_batch_size=360, fast_path=False)
    fast.setup("test"), slow.setup("test")
    xu, yu = first_batch(fast.test_dataloader())
    xs, ys = first_batch(slow.test_dataloader())
    xf = fast.augment_batch(xu, train=False)
    assert xs.dtype == xf.dtype == torch.float32 and xs.shape == xf.shape == (len(yu), in_chans, img_size, img_size)
    assert torch.equal(ys, yu)
    assert (xs - xf).abs().max() < 1e-5


def test_standard_path_training_batches_and_rand_augment():
    for channels in (1, 3):
        dm = synthetic(channels=channels, in_chans=3, fast_path=False, auto_augment="rand-m9-n2-mstd0.5",
                       img_size=40, batch_size=8)  # fmt: skip
        dm.setup("fit")
        x, y = first_batch(dm.train_dataloader())
        assert x.shape == (8, 3, 40, 40) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert dm.on_after_batch_transfer((x, y), 0)[0] is x  # the standard path is done on the CPU


def test_grayscale_is_repeated_to_rgb():
    dm = digits(in_chans=3, img_size=16)
    dm.setup("fit")
    x, _ = first_batch(dm.train_dataloader())
    out = dm.augment_batch(x, train=True)
    assert out.shape == (64, 3, 16, 16)
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 0], out[:, 2])
    assert out[:, 0].std() > 0.5


def test_synthetic_is_deterministic_from_seed():
    a, b, c = synthetic(seed=1), synthetic(seed=1), synthetic(seed=2)
    for dm in (a, b, c):
        dm.setup()
    assert torch.equal(a.data_train.images, b.data_train.images) and torch.equal(a.data_test.labels, b.data_test.labels)
    assert not torch.equal(a.data_train.images, c.data_train.images)
    assert not torch.equal(a.data_test.images[:20], a.data_train.images[:20])


def test_batches_reaching_the_lightning_module_follow_the_contract():
    class Probe(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3 * 16 * 16, 10)
            self.seen = []

        def training_step(self, batch, _):
            return self._step(batch, "train")

        def validation_step(self, batch, _):
            self._step(batch, "val")

        def _step(self, batch, split):
            x, y = batch
            self.seen.append((split, x.dtype, tuple(x.shape), y.dtype))
            return torch.nn.functional.cross_entropy(self.net(x.flatten(1)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Probe()
    trainer = L.Trainer(fast_dev_run=True, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(model, datamodule=digits(in_chans=3, img_size=16, batch_size=8, eval_batch_size=8))
    assert model.seen == [
        ("train", torch.float32, (8, 3, 16, 16), torch.int64),
        ("val", torch.float32, (8, 3, 16, 16), torch.int64),
    ]


# ---- configs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, cls, extra",
    [
        ("digits", DigitsDataModule, {}),
        ("synthetic", SyntheticDataModule, {"length": 16}),
        ("cifar10", CIFAR10DataModule, {}),
        ("cifar100", CIFAR100DataModule, {}),
        ("fashion_mnist", FashionMNISTDataModule, {}),
        ("imagefolder", ImageFolderDataModule, {"num_classes": 2, "root": "/tmp/images"}),
    ],
)
def test_data_configs_instantiate(tmp_path, name, cls, extra):
    data = OmegaConf.load(CONF_DIR / f"{name}.yaml")
    for key, value in extra.items():
        data[key] = value
    cfg = OmegaConf.create(
        {"model": {"img_size": 32, "in_chans": data.channels}, "paths": {"data_dir": str(tmp_path)}, "data": data}
    )
    dm = instantiate(cfg.data)
    assert dm.img_size == (32, 32) and dm.in_chans == data.channels
    assert dm.num_classes == data.num_classes and dm.channels == data.channels
    assert type(dm) is cls
    if name == "digits":
        assert dm.hflip is False
