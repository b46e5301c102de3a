"""ClassificationDataModule: the shared LightningDataModule behind every classification data set.

Whatever the data set and path, batches reaching the LightningModule are
``(x float32 (B, in_chans, H, W) normalised, y int64 (B,))`` with (H, W) = ``img_size``.
With ``naflex.enabled`` they are ``(patch dict, y)`` instead: timm NaFlexVit's ``patches`` /
``patch_coord`` / ``patch_valid`` at each image's own aspect, batched to a token budget (naflex.py).

A subclass states its static facts in a ``DatasetInfo`` and implements ``_load(split)``
(a map-style data set of ``(PIL image or uint8 (C, H, W) tensor, int label)``), ``check()``
(cheap: are the files there?), and for the fast path ``_as_tensors(ds)``. Beside it: checks.py,
splits.py, fast.py and transforms.py (the two paths), sampler.py, resume.py (exact resume).

Over 400 lines on purpose: one class whose constructor documents every ``data.*`` argument in one
docstring (a third of the file), the place a user reads them; its checks live in ``vitpipe.config``.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms.v2 import functional as TF

from vitpipe.data.balance import BalancedSampler, dataset_labels
from vitpipe.data.erasing import random_erasing
from vitpipe.data.fast import (
    TensorImageDataset,
    identity_collate,
    random_crop,
    random_hflip_flags,
    random_resized_crop,
    to_model_input,
)
from vitpipe.data.naflex import (
    NaFlexConfig,
    NaFlexImageDataset,
    NaFlexInput,
    NaFlexTensorDataset,
    TokenBudgetBatchSampler,
    naflex_collate,
)
from vitpipe.data.repeated import RepeatedAugSampler
from vitpipe.data.resume import ResumeState, loader_generator
from vitpipe.data.sampler import ShardedSampler, rank_layout
from vitpipe.data.splits import split_indices
from vitpipe.data.subset import check_classes, select
from vitpipe.data.transforms import (
    MAE_AUGMENT,
    MAE_CROP_SCALE,
    TransformedSubset,
    standard_transform,
)
from vitpipe.data.workers import local_world_size, resolve_num_workers
from vitpipe.errors import ConfigError, to_hw


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
        num_workers: loader processes for the standard path (the fast path uses none); None: chosen
            from this machine's CPUs and the processes per node (vitpipe.data.workers).
        val_split: validation fraction in [0, 1) or a count of training images; taken from
            the training set by a permutation seeded with ``seed`` (unless the data set has
            its own validation split, e.g. an image folder's val/).
        shuffle: false reads a fixed order (the DDP-equals-one-process test).
        sampler: ``default`` (each training image once per epoch) or ``balanced`` (a class-balanced
            epoch drawn with replacement, vitpipe.data.balance; needs shuffle).
        augment, hflip, crop_padding: training augmentation (random crop with zero padding,
            horizontal flip); ``augment="mae"``: MAE pre-training's, RandomResizedCrop at scale
            0.2-1 to the model's size + the flip of ``hflip``, nothing else (both paths; He et al.
            2022); auto_augment: a timm RandAugment string (standard path only).
        random_erasing: probability of erasing one random box per training image (timm's
            RandomErasing, mode pixel; both paths, vitpipe.data.erasing). DeiT: 0.25.
        repeated_aug: r > 1 puts each training image r times in the epoch's order, the copies on
            different ranks, the epoch keeping the data set's length (vitpipe.data.repeated). DeiT: 3.
        fast_path: hold each split as one uint8 tensor and augment batched on the device
            (see vitpipe.data.fast); False: torchvision data sets + v2 transforms in workers.
        antialias: antialias when resizing (both paths; off by default, which is exact for
            upsampling, the usual case of small data sets on a bigger model).
        mean, std: normalisation per native channel (default: the data set's statistics).
        classes, train_per_class: keep only these classes (relabelled 0..k-1 in this order) and
            only that many training images of each (vitpipe.data.subset; fast path only).
        naflex: ``{enabled, seq_lens, max_seq_len, tokens_per_batch, loss_scale, patch_size}``: batches of
            patch dicts at each image's own aspect, to a token budget (vitpipe.data.naflex); off: None
            or ``enabled: false``.
    """

    has_val_split = False  # True: _load("val") may return the data set's own validation split

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
        num_workers: int | None = 0,
        val_split: float | int = 0.1,
        seed: int = 0,
        shuffle: bool = True,
        sampler: str = "default",
        augment: bool | str = True,
        hflip: bool = True,
        crop_padding: int = 4,
        auto_augment: str | None = None,
        random_erasing: float = 0.0,
        repeated_aug: int = 1,
        fast_path: bool = True,
        pin_memory: bool = False,
        antialias: bool = False,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        classes: Sequence[int] | None = None,
        train_per_class: int | None = None,
        naflex: dict | None = None,
    ):
        super().__init__()
        # The arguments are checked before the module is built, from the config (vitpipe.config.preflight:
        # types, ranges and the pairs that exclude each other); here they are assigned. What stays is the
        # comparison of the config with what this data set is (its classes, channels, image size), which
        # only the constructed module knows (an image folder's, a shard index's facts).
        self.info = info
        self.root = None if root is None else str(root)
        self.download = bool(download)
        self.img_size = to_hw(img_size, "data.img_size")
        self.native_size = info.native_size
        self.batch_size = batch_size
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        self.num_workers = num_workers
        self.val_split = val_split
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.sampler = sampler
        self.repeated_aug = repeated_aug
        self.augment = augment if augment == MAE_AUGMENT else bool(augment)
        self.hflip, self.fast_path = bool(hflip), bool(fast_path)
        self.crop_padding = crop_padding
        self.auto_augment = auto_augment or None
        self.random_erasing = float(random_erasing)
        self.pin_memory, self.antialias = bool(pin_memory), bool(antialias)
        self.classes = None if classes is None else [int(c) for c in classes]
        self.train_per_class = train_per_class
        self.naflex = NaFlexConfig.from_cfg(naflex, self.batch_size)

        # The config's static facts against what the data set is.
        self.num_classes = num_classes
        check_classes(classes, train_per_class, info.num_classes)
        expected = len(self.classes) if self.classes is not None else info.num_classes
        if expected is not None and self.num_classes != expected:
            raise ConfigError(
                f"data.num_classes={num_classes} but {info.name} has {expected} classes"
                f"{' in data.classes' if self.classes is not None else ''}; set data.num_classes={expected}"
            )
        if channels != info.channels:
            raise ConfigError(f"data.channels={channels!r} but {info.name} images have {info.channels} channel(s)")
        self.channels = info.channels
        self.in_chans = in_chans
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
        if self.naflex is not None:
            self.naflex_input = NaFlexInput(self.naflex.patch_size, self.mean, self.std, self.in_chans)

        # Label index -> name; set here when static, else by check()/setup() once the files are read.
        self.class_names: list[str] | None = None if info.class_names is None else list(info.class_names)
        self._selected_names: list[str] | None = None  # class_names after data.classes picked from them
        self.resume = ResumeState(self.seed)
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
        if isinstance(ds, TensorImageDataset):
            return ds.images, ds.labels
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
        if self.classes is not None and self.class_names is not None and self.class_names is not self._selected_names:
            self.class_names = self._selected_names = [self.class_names[c] for c in self.classes]  # (re)loaded names

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
        if self.naflex is not None:
            return self.naflex_input.batch(*batch)
        train = self.trainer is None or self.trainer.training
        if len(batch) == 3:  # a teacher's precomputed logits per view (vitpipe.lit.distill): the one the student sees
            x, y, t = batch
            x, flipped = self._augment(x, train)
            view = flipped.long() if flipped is not None else torch.zeros(len(y), dtype=torch.long, device=t.device)
            return x, y, t[torch.arange(len(y), device=t.device), view.to(t.device)]
        x, y = batch
        return self.augment_batch(x, train), y

    def state_dict(self) -> dict:
        return self.resume.state_dict() if self.resume.observe(self.trainer) else {}

    def load_state_dict(self, state: dict) -> None:  # exact mid-epoch resume: see resume.py
        self.resume.load_state_dict(state)

    # ---- the two paths -----------------------------------------------------------------

    def augment_batch(self, x: Tensor, train: bool) -> Tensor:
        """uint8 (B, channels, h, w) -> float32 (B, in_chans, *img_size); crop/flip only if train.

        Under a fit loop the crops and flips come from the resume state's generator (the same
        after a resume, different per rank); otherwise (a benchmark) from the global RNG.
        """
        return self._augment(x, train)[0]

    def _augment(self, x: Tensor, train: bool) -> tuple[Tensor, Tensor | None]:
        """``augment_batch`` and which images it mirrored ((B,) bool; None: no flips drawn)."""
        gen, flipped = None, None
        if train and self.augment:
            observed = self.resume.observe(self.trainer)
            gen = self.resume.generator(x.device, self.trainer.global_rank) if observed else None
            if self.augment == MAE_AUGMENT:  # the crop resizes: on float pixels, straight to the model's size
                x = random_resized_crop(TF.to_dtype(x, torch.float32, scale=True), self.img_size,
                                        scale=MAE_CROP_SCALE, generator=gen)
            else:
                x = random_crop(x, self.crop_padding, gen)
            if self.hflip:
                x, flipped = random_hflip_flags(x, generator=gen)
        x = to_model_input(
            x, img_size=self.img_size, mean=self.mean, std=self.std, out_chans=self.in_chans, antialias=self.antialias
        )
        if train and self.augment and self.random_erasing > 0:  # never with augment=mae (refused)
            x = random_erasing(x, self.random_erasing, generator=gen)  # same generator: exact resume holds
        return x, flipped

    def transform(self, train: bool):
        """The standard path's per-image torchvision v2 pipeline for a split."""
        return standard_transform(
            train=train, native_size=self.native_size, img_size=self.img_size, mean=self.mean, std=self.std,
            channels=self.channels, in_chans=self.in_chans, augment=self.augment, crop_padding=self.crop_padding,
            hflip=self.hflip, auto_augment=self.auto_augment, antialias=self.antialias,
            random_erasing=self.random_erasing,
        )  # fmt: skip

    def _setup_train_val(self) -> None:
        train = self._load("train")
        val = self._load("val") if self.has_val_split else None
        if val is None:
            self.train_indices, self.val_indices = split_indices(len(train), self.val_split, self.seed)
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
        if not self.fast_path:
            if self.naflex is not None:
                return NaFlexImageDataset(ds, indices, self.naflex_input, self.naflex.max_seq_len)
            return TransformedSubset(ds, indices, self.transform(train))
        images, labels = self._as_tensors(ds)
        if images.shape[1] != self.channels:
            raise ConfigError(f"data.channels={self.channels} but {self.info.name} images have {images.shape[1]}")
        if indices is not None:
            images, labels = images[indices], labels[indices]
        if self.classes is not None or (train and self.train_per_class is not None):
            keep, labels = select(labels, self.classes, self.train_per_class if train else None, self.seed)
            images = images[keep]
        if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ConfigError(
                f"{self.info.name} has labels up to {int(labels.max())}, more than data.num_classes={self.num_classes}"
            )
        if self.naflex is not None:
            return NaFlexTensorDataset(images, labels, self.naflex.max_seq_len)
        return TensorImageDataset(images, labels)

    def _sampler(self, ds: Dataset, *, train: bool, world: int, rank: int) -> ShardedSampler:
        """This rank's share of ``ds``: training shards padded to equal length, evaluation shards not."""
        if train and self.sampler == "balanced":
            return BalancedSampler(dataset_labels(ds), num_replicas=world, rank=rank, seed=self.seed)
        if train and self.repeated_aug > 1:
            return RepeatedAugSampler(len(ds), repeats=self.repeated_aug, num_replicas=world, rank=rank,
                                      shuffle=self.shuffle, seed=self.seed)  # fmt: skip
        return ShardedSampler(len(ds), num_replicas=world, rank=rank, shuffle=train and self.shuffle,
                              seed=self.seed, pad=train)  # fmt: skip

    def _naflex_loader(self, ds: Dataset, *, train: bool) -> DataLoader:
        """Token-budget training batches, evaluation at max_seq_len each image once (vitpipe.data.naflex)."""
        world, rank = rank_layout(self.trainer)
        if train:
            sampler = TokenBudgetBatchSampler(len(ds), seq_lens=self.naflex.seq_lens,
                                              tokens_per_batch=self.naflex.tokens_per_batch, num_replicas=world,
                                              rank=rank, shuffle=self.shuffle, seed=self.seed,
                                              hflip=bool(self.augment) and self.hflip)  # fmt: skip
            sampler.set_epoch(self.resume.epoch)
            sampler.skip = self.resume.take_offset(1)  # in batches
            kwargs = {"batch_sampler": sampler}
            generator = self.resume.loader_generator(rank)
        else:
            kwargs = {"batch_size": self.eval_batch_size,
                      "sampler": ShardedSampler(len(ds), num_replicas=world, rank=rank, shuffle=False, pad=False)}
            generator = loader_generator(self.seed, rank)
        if self.fast_path:
            return DataLoader(ds, collate_fn=identity_collate, pin_memory=self.pin_memory, generator=generator,
                              **kwargs)  # fmt: skip
        workers = resolve_num_workers(self.num_workers, local_world_size(self.trainer))
        return DataLoader(ds, collate_fn=naflex_collate, num_workers=workers, persistent_workers=workers > 0,
                          pin_memory=self.pin_memory, generator=generator, **kwargs)  # fmt: skip

    def _loader(self, ds: Dataset, *, train: bool) -> DataLoader:
        if self.naflex is not None:
            return self._naflex_loader(ds, train=train)
        batch_size = self.batch_size if train else self.eval_batch_size
        world, rank = rank_layout(self.trainer)
        sampler = self._sampler(ds, train=train, world=world, rank=rank)
        if train:
            # the epoch it resumes in: with workers, the loader draws indices as soon as its iterator
            # is made, which Lightning does before its first set_epoch of a resumed run
            sampler.set_epoch(self.resume.epoch)
            sampler.skip = self.resume.take_offset(batch_size)
        # its own generator: making an iterator draws nothing from torch's global one (resume.py)
        generator = self.resume.loader_generator(rank) if train else loader_generator(self.seed, rank)
        if self.fast_path:
            # Main-process indexing is one tensor op per batch: workers would only add IPC.
            return DataLoader(ds, batch_size=batch_size, sampler=sampler, collate_fn=identity_collate,
                              pin_memory=self.pin_memory, generator=generator)  # fmt: skip
        workers = resolve_num_workers(self.num_workers, local_world_size(self.trainer))
        return DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers,
                          persistent_workers=workers > 0, pin_memory=self.pin_memory, generator=generator)  # fmt: skip

    def _require(self, ds: Dataset | None, stage: str) -> Dataset:
        if ds is None:
            raise RuntimeError(f"{type(self).__name__}.setup({stage!r}) must run before its dataloaders")
        return ds
