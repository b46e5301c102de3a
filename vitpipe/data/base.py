"""ClassificationDataModule: the shared LightningDataModule behind every classification data set.

Whatever the data set and path, batches reaching the LightningModule are
``(x float32 (B, in_chans, H, W) normalised, y int64 (B,))`` with (H, W) = ``img_size``.

A subclass states its static facts in a ``DatasetInfo`` and implements ``_load(split)``
(a map-style data set of ``(PIL image or uint8 (C, H, W) tensor, int label)``), ``check()``
(cheap: are the files there?), and for the fast path ``_as_tensors(ds)``.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vitpipe.data.sampler import ShardedSampler
from vitpipe.data.fast import TensorImageDataset, identity_collate, random_crop, random_hflip, to_model_input
from vitpipe.data.transforms import standard_transform
from vitpipe.errors import ConfigError

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class DatasetInfo:
    """What a data set is, independent of how it is fed.

    num_classes / native_size / class_names None: known only once the files are read (an image
    folder has any number of classes and images of any size; CIFAR's names are in its meta file).
    """

    name: str
    num_classes: int | None
    channels: int
    native_size: tuple[int, int] | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...] | None = None


def to_hw(value, name: str) -> tuple[int, int]:
    """An int or a [h, w] pair (a list, tuple or OmegaConf ListConfig) -> (h, w), both positive."""
    if isinstance(value, int) and not isinstance(value, bool):
        pair = (value, value)
    else:
        try:
            pair = tuple(value)
        except TypeError:
            pair = ()
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise ConfigError(f"{name}={value!r}: expected a positive int or a [height, width] pair of positive ints")
    return pair


class _TransformedSubset(Dataset):
    """``base[indices[i]]`` with a per-image transform: one loaded data set serves train and val."""

    def __init__(self, base: Dataset, indices: Tensor | None, transform):
        self.base, self.indices, self.transform = base, indices, transform

    def __len__(self) -> int:
        return len(self.base) if self.indices is None else len(self.indices)

    def __getitem__(self, i: int):
        image, label = self.base[i if self.indices is None else int(self.indices[i])]
        return self.transform(image), int(label)


class ClassificationDataModule(L.LightningDataModule):
    """Splits, loaders and the two input paths shared by the classification data sets.

    Args (keyword-only; the subclasses pass ``info``, the user everything else):
        root: directory holding the data set files (unused by embedded/generated data).
        download: let prepare_data() download missing files (needs internet).
        img_size: the MODEL's input size, int or [h, w]; other native sizes are resized to it.
        in_chans: the channels the model wants; grayscale data is repeated to 3 for an RGB
            model. Everything else (RGB data for a 1-channel model included: we do not
            silently convert to gray) raises ConfigError.
        num_classes, channels: the static values the config carries so other groups can
            interpolate them; checked against the data set (ConfigError on mismatch).
        batch_size, eval_batch_size: train batch, val/test batch (default: batch_size).
        num_workers: loader processes for the standard path (the fast path uses none).
        val_split: validation fraction in [0, 1) or a count of training images; taken from
            the training set by a permutation seeded with ``seed`` (unless the data set has
            its own validation split, e.g. an image folder's val/).
        augment, hflip, crop_padding: training augmentation (random crop with zero padding,
            horizontal flip); auto_augment: a timm RandAugment string (standard path only).
        fast_path: hold each split as one uint8 tensor and augment batched on the device
            (see vitpipe.data.fast); False: torchvision data sets + v2 transforms in workers.
        antialias: antialias when resizing (both paths; off by default, which is exact for
            upsampling, the usual case of small data sets on a bigger model).
        mean, std: normalisation per native channel (default: the data set's statistics).
    """

    def __init__(
        self,
        *,
        info: DatasetInfo,
        img_size: int | Sequence[int],
        in_chans: int,
        num_classes: int,
        channels: int,
        root: str | None = None,
        download: bool = False,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        val_split: float | int = 0.1,
        seed: int = 0,
        shuffle: bool = True,
        augment: bool = True,
        hflip: bool = True,
        crop_padding: int = 4,
        auto_augment: str | None = None,
        fast_path: bool = True,
        pin_memory: bool = False,
        antialias: bool = False,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ):
        super().__init__()
        self.info = info
        self.root = None if root is None else str(root)
        self.download = bool(download)
        self.img_size = to_hw(img_size, "data.img_size")
        self.native_size = info.native_size
        self.batch_size = _positive_int(batch_size, "data.batch_size")
        self.eval_batch_size = self.batch_size if eval_batch_size is None else _positive_int(
            eval_batch_size, "data.eval_batch_size"
        )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers!r}: expected an int >= 0")
        self.num_workers = num_workers
        self.val_split = _check_val_split(val_split)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)  # false: fixed order (the DDP-equals-one-process test)
        self.augment, self.hflip, self.fast_path = bool(augment), bool(hflip), bool(fast_path)
        if not isinstance(crop_padding, int) or crop_padding < 0:
            raise ConfigError(f"data.crop_padding={crop_padding!r}: expected an int >= 0")
        self.crop_padding = crop_padding
        self.auto_augment = auto_augment or None
        self.pin_memory, self.antialias = bool(pin_memory), bool(antialias)

        # Static facts the config carries, checked against what the data set is.
        self.num_classes = _positive_int(num_classes, "data.num_classes")
        if info.num_classes is not None and self.num_classes != info.num_classes:
            raise ConfigError(
                f"data.num_classes={num_classes} but {info.name} has {info.num_classes} classes; "
                f"set data.num_classes={info.num_classes}"
            )
        if channels != info.channels:
            raise ConfigError(f"data.channels={channels!r} but {info.name} images have {info.channels} channel(s)")
        self.channels = info.channels
        self.in_chans = _positive_int(in_chans, "data.in_chans")
        if self.in_chans != self.channels and not (self.channels == 1 and self.in_chans == 3):
            raise ConfigError(
                f"model in_chans={in_chans} cannot take {info.name}'s {self.channels}-channel images "
                f"(only equal counts or grayscale -> 3 are supported); set model.in_chans={self.channels}"
            )
        self.mean = tuple(float(m) for m in (info.mean if mean is None else mean))
        self.std = tuple(float(s) for s in (info.std if std is None else std))
        if len(self.mean) != self.channels or len(self.std) != self.channels or min(self.std) <= 0:
            raise ConfigError(
                f"data.mean={list(self.mean)}, data.std={list(self.std)}: need {self.channels} value(s) each, std > 0"
            )
        if self.fast_path and self.native_size is None:
            raise ConfigError(
                f"data.fast_path=true needs images of one size; {info.name} images vary in size: set data.fast_path=false"
            )
        if self.fast_path and self.auto_augment:
            raise ConfigError(
                f"data.auto_augment={auto_augment!r} is per-image PIL augmentation: it needs data.fast_path=false"
            )

        # Label index -> name; set here when static, else by check()/setup() once the files are read.
        self.class_names: list[str] | None = None if info.class_names is None else list(info.class_names)
        self.train_indices: Tensor | None = None  # indices into the loaded training set
        self.val_indices: Tensor | None = None
        self.data_train: Dataset | None = None
        self.data_val: Dataset | None = None
        self.data_test: Dataset | None = None

    # ---- what subclasses provide -------------------------------------------------------

    def check(self) -> None:
        """Cheap: raise ConfigError if the data cannot be loaded (files missing and no download)."""

    def _download(self) -> None:
        """Fetch the files into ``root`` (called by prepare_data() when download=True)."""

    def _load(self, split: str) -> Dataset | None:
        """The split as ``(PIL image or uint8 (C, H, W) tensor, int)`` items, or None if absent."""
        raise NotImplementedError

    def _as_tensors(self, ds: Dataset) -> tuple[Tensor, Tensor]:
        """The loaded split as uint8 (N, C, H, W) and int64 (N,) for the fast path."""
        raise NotImplementedError

    # ---- Lightning hooks ---------------------------------------------------------------

    def prepare_data(self) -> None:
        if self.download:
            self._download()
        self.check()

    def setup(self, stage: str | None = None) -> None:
        self.check()
        if stage in (None, "fit", "validate") and self.data_train is None:
            self._setup_train_val()
        if stage in (None, "test", "predict") and self.data_test is None:
            self._setup_test()

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._require(self.data_train, "fit"), train=True)

    def val_dataloader(self) -> DataLoader | list:
        ds = self._require(self.data_val, "fit")
        return self._loader(ds, train=False) if len(ds) else []

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._require(self.data_test, "test"), train=False)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Fast path: augment/resize/normalise the uint8 batch on the device it now lives on.

        Augmentation only while the trainer trains; without a trainer (a benchmark calling the
        hook by hand) the batch counts as training. Call augment_batch() to choose explicitly.
        """
        if not self.fast_path:
            return batch
        x, y = batch
        train = self.trainer is None or self.trainer.training
        return self.augment_batch(x, train), y

    # ---- the two paths -----------------------------------------------------------------

    def augment_batch(self, x: Tensor, train: bool) -> Tensor:
        """uint8 (B, channels, h, w) -> float32 (B, in_chans, *img_size); crop/flip only if train."""
        if train and self.augment:
            gen = self._augment_generator(x.device)
            x = random_crop(x, self.crop_padding, gen)
            if self.hflip:
                x = random_hflip(x, generator=gen)
        return to_model_input(
            x, img_size=self.img_size, mean=self.mean, std=self.std, out_chans=self.in_chans, antialias=self.antialias
        )

    def _augment_generator(self, device) -> torch.Generator | None:
        """A generator seeded by (seed, rank, index of this batch in the run).

        Lightning counts batches in its checkpointed loop state, so a run resumed after a kill
        draws the same crops and flips as one that never stopped; ranks draw different ones.
        """
        fit_loop = getattr(self.trainer, "fit_loop", None)
        if fit_loop is None:  # no trainer (a benchmark): the global RNG
            return None
        step = fit_loop.epoch_loop.batch_progress.total.ready  # batches before this one
        gen = torch.Generator(device=device)
        gen.manual_seed(hash((self.seed, self.trainer.global_rank, step)) & 0x7FFF_FFFF_FFFF_FFFF)
        return gen

    # ---- exact mid-epoch resume: how far into the epoch the checkpoint was written ------

    def state_dict(self) -> dict:
        if getattr(self.trainer, "fit_loop", None) is None:
            return {}
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.completed
        return {"batches_done_in_epoch": int(done) if done < self.trainer.num_training_batches else 0}

    def load_state_dict(self, state: dict) -> None:
        self._resume_batches = state.get("batches_done_in_epoch", 0)

    def transform(self, train: bool):
        """The standard path's per-image torchvision v2 pipeline for a split."""
        return standard_transform(
            train=train,
            native_size=self.native_size,
            img_size=self.img_size,
            mean=self.mean,
            std=self.std,
            channels=self.channels,
            in_chans=self.in_chans,
            augment=self.augment,
            crop_padding=self.crop_padding,
            hflip=self.hflip,
            auto_augment=self.auto_augment,
            antialias=self.antialias,
        )

    def _setup_train_val(self) -> None:
        train = self._load("train")
        val = self._load("val")
        if val is None:
            self.train_indices, self.val_indices = self._split_indices(len(train))
            val, val_idx, train_idx = train, self.val_indices, self.train_indices
        else:
            train_idx = val_idx = None
        self.data_train = self._prepare(train, train_idx, train=True)
        self.data_val = self._prepare(val, val_idx, train=False)

    def _setup_test(self) -> None:
        test = self._load("test")
        if test is not None:
            self.data_test = self._prepare(test, None, train=False)
            return
        # So that fit-then-test runs end to end on a folder without test/; the warning says what it is.
        rank_zero_warn(f"{self.info.name} under {self.root} has no test split: testing on the validation split")
        if self.data_val is None:
            self._setup_train_val()
        self.data_test = self.data_val

    def _prepare(self, ds: Dataset, indices: Tensor | None, *, train: bool) -> Dataset:
        """Fast path: the (sub)split as one tensor. Standard: the data set behind a transform."""
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise ConfigError(
                f"data.num_classes={self.num_classes} but {self.info.name} has {len(self.class_names)} classes "
                f"({', '.join(map(str, self.class_names[:10]))}{', ...' if len(self.class_names) > 10 else ''})"
            )
        if not self.fast_path:
            return _TransformedSubset(ds, indices, self.transform(train))
        images, labels = self._as_tensors(ds)
        if images.shape[1] != self.channels:
            raise ConfigError(f"data.channels={self.channels} but {self.info.name} images have {images.shape[1]}")
        if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ConfigError(
                f"{self.info.name} has labels up to {int(labels.max())}, more than data.num_classes={self.num_classes}"
            )
        if indices is not None:
            images, labels = images[indices], labels[indices]
        return TensorImageDataset(images, labels)

    def _split_indices(self, n: int) -> tuple[Tensor, Tensor]:
        """(train, val) indices into a training set of n, from a permutation seeded by ``seed``."""
        n_val = self.val_split if isinstance(self.val_split, int) else round(self.val_split * n)
        if n_val >= n:
            raise ConfigError(f"data.val_split={self.val_split} leaves no training images out of {n}")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
        return perm[n_val:].sort().values, perm[:n_val].sort().values

    def _loader(self, ds: Dataset, *, train: bool) -> DataLoader:
        batch_size = self.batch_size if train else self.eval_batch_size
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        sampler = ShardedSampler(len(ds), num_replicas=world, rank=rank, shuffle=train and self.shuffle,
                                 seed=self.seed, pad=train)
        if train:
            sampler.skip, self._resume_batches = getattr(self, "_resume_batches", 0) * batch_size, 0
        if self.fast_path:
            # Main-process indexing is one tensor op per batch: workers would only add IPC.
            return DataLoader(
                ds, batch_size=batch_size, sampler=sampler, collate_fn=identity_collate, pin_memory=self.pin_memory
            )
        return DataLoader(
            ds,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
        )

    def _require(self, ds: Dataset | None, stage: str) -> Dataset:
        if ds is None:
            raise RuntimeError(f"{type(self).__name__}.setup({stage!r}) must run before its dataloaders")
        return ds


def _positive_int(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={value!r}: expected a positive int")
    return value


def _check_val_split(value) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"data.val_split={value!r}: expected a fraction in [0, 1) or a count >= 0")
    if isinstance(value, float) and not 0.0 <= value < 1.0 or isinstance(value, int) and value < 0:
        raise ConfigError(f"data.val_split={value!r}: expected a fraction in [0, 1) or a count >= 0")
    return value
