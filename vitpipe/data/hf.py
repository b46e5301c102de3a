"""Hugging Face ``datasets``: ``data=hf data.name=<hub id | local path | builder>``.

What ``data.name`` may be (``open_source``):

    a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``   ``datasets.load_from_disk``
    a ``.parquet`` file, or a folder of them / of images (``load_dataset``'s own detection)
    a packaged builder, ``imagefolder`` or ``parquet``, with ``data.data_dir`` or ``data.data_files``
    a Hub id (``cifar10``, ``uoft-cs/cifar10``): from the local cache, or downloaded

A Hub id that is neither cached nor reachable (``HF_HUB_OFFLINE=1``, no network) stops when the
config is checked, in one line saying what to download and where (``offline_error``).

Columns: ``data.image_column`` (an ``Image`` feature, read as bytes and decoded by vitpipe's own
``open_image``: upright by EXIF, 16-bit scaled, the file named when it fails) and
``data.label_column`` (a ``ClassLabel``: its names are the run's class names, its count
``data.num_classes`` when that is null; a plain integer column needs ``data.num_classes``). A name
that is not a column stops in one line naming the columns there are. ``data.split_map`` maps vitpipe's
train/val/test to the data set's split names; without a validation split, ``data.val_split`` carves
one out of train as every vitpipe data set does; without a test split, test uses the validation split.

Map-style (the default): the splits are ``ClassificationDataModule``'s, so everything that holds for an
image folder holds here: each training image once per epoch, DDP shards, exact mid-epoch resume
(``vitpipe.data.resume``). The same images saved as a data set train to the same weights as
``data=imagefolder`` (tests/test_hf_data.py).

Streaming (``data.streaming=true``): the training split is read as an ``IterableDataset`` (a Hub id
streams it without downloading; a local data set through ``to_iterable_dataset``), the validation and
test splits map-style (small; each image scored once, the report's rows by index); ``vitpipe.data.stream`` gives
each rank (and loader worker) its part (``datasets.distributed.split_dataset_by_node``), shuffles
through a buffer (``data.shuffle_buffer``) reseeded each epoch (``set_epoch``), and yields a fixed
number of batches per epoch from ``data.num_samples`` (else the data set's info) so schedules are sized.
Exact mid-epoch resume mirrors ``data=shards``: the position is Lightning's own count of the batches
trained (``ResumeState``), and the resumed pass reads past that many examples of the rank's stream
without decoding them. ``IterableDataset.state_dict`` is not used for this: its shuffle buffer is not
in the state, so a resume after shuffling loses the buffer's examples (datasets' docs), and its state is
per rank while a checkpoint keeps rank 0's data module state.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.utilities import rank_zero_only
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import DataLoader, Dataset

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.data.sampler import rank_layout
from vitpipe.data.stream import StreamingSource, decode
from vitpipe.errors import ConfigError

SPLITS = ("train", "val", "test")
DEFAULT_SPLIT_MAP = {"train": "train", "val": "validation", "test": "test"}
BUILDERS = ("imagefolder", "parquet", "arrow", "webdataset")  # packaged builders that read data.data_dir / data_files


def is_saved_to_disk(path: str) -> bool:
    """A folder ``save_to_disk`` wrote: a DatasetDict's ``dataset_dict.json`` or a Dataset's ``state.json``."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(os.path.join(path, "state.json"))


def is_local(name: str) -> bool:
    return os.path.exists(os.path.expanduser(str(name)))


def hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline_error(name: str, why: str) -> ConfigError:
    from huggingface_hub import constants

    reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
    return ConfigError(f"data.name={name}: not a local path and not in the Hugging Face cache ({hub_cache()}), "
                       f"and {reason} ({why}); download it where there is network with `huggingface-cli download "
                       f"--repo-type dataset {name}` (into that cache; HF_HOME moves it), or pass a folder written by "
                       "save_to_disk as data.name")


def open_source(name: str, *, streaming: bool = False, data_dir: str | None = None, data_files=None,
                revision: str | None = None, cache_dir: str | None = None, split: str | None = None):
    """The DatasetDict / IterableDatasetDict (or a single Dataset) ``data.name`` names; with ``split``, that
    split alone (a Hub data set then downloads only its files)."""
    import datasets

    name = str(name)
    if split is not None and is_local(name) and is_saved_to_disk(os.path.expanduser(name)):
        return splits_of(open_source(name, streaming=streaming))[split]
    try:
        if is_local(name) and is_saved_to_disk(os.path.expanduser(name)):
            ds = datasets.load_from_disk(os.path.expanduser(name))
            if streaming:
                if isinstance(ds, datasets.DatasetDict):
                    return datasets.IterableDatasetDict({k: _to_iterable(v, k) for k, v in ds.items()})
                return _to_iterable(ds, "train")
            return ds
        if is_local(name) and os.path.isfile(name) and name.endswith(".parquet"):
            return datasets.load_dataset("parquet", data_files=name, streaming=streaming, cache_dir=cache_dir,
                                         split=split)
        if is_local(name) or name in BUILDERS:
            return datasets.load_dataset(name, data_dir=data_dir, data_files=data_files, streaming=streaming,
                                         cache_dir=cache_dir, split=split)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.name={name}: {_first_line(e)}") from None
    try:
        return datasets.load_dataset(name, data_dir=data_dir, data_files=data_files, revision=revision,
                                     streaming=streaming, cache_dir=cache_dir, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises ConnectionError, FileNotFoundError, DatasetNotFoundError...
        raise offline_error(name, _first_line(e)) from None


def _to_iterable(ds, split: str):
    """A local Dataset streamed (``to_iterable_dataset``), its length kept in its info as a Hub data set's is."""
    from datasets import SplitDict, SplitInfo

    # 64 shards (or one per row): split_dataset_by_node hands whole shards to ranks when they divide evenly
    stream = ds.to_iterable_dataset(num_shards=max(1, min(64, len(ds))))
    stream.info.splits = SplitDict()
    stream.info.splits.add(SplitInfo(name=split, num_examples=len(ds)))
    return stream


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def splits_of(source) -> dict:
    """``{split name: data set}``; a single Dataset is one split, ``train``."""
    return dict(source) if hasattr(source, "keys") else {"train": source}


def check_columns(ds, name: str, split: str, image_column: str, label_column: str | None) -> None:
    if getattr(ds, "features", None) is None:
        return  # a stream whose features are known only once read: the first row names what is missing
    columns = list(ds.features)
    for key, col in (("data.image_column", image_column), ("data.label_column", label_column)):
        if col is not None and col not in columns:
            raise ConfigError(f"{key}={col!r} is not a column of {name} ({split}); its columns: {', '.join(columns)}")


def class_names_of(ds, label_column: str) -> list[str] | None:
    """The ClassLabel's names, or None for a plain integer column."""
    from datasets import ClassLabel

    feature = (ds.features or {}).get(label_column)
    return list(feature.names) if isinstance(feature, ClassLabel) else None


class HFImages(Dataset):
    """A map-style split as ``(PIL image, int label)``, decoded by ``open_image``; ``targets``: the labels."""

    def __init__(self, ds, image_column: str, label_column: str, mode: str, where: str) -> None:
        from datasets import Image

        self.ds = ds.cast_column(image_column, Image(decode=False))  # bytes/path: vitpipe decodes
        self.image_column, self.label_column, self.mode, self.where = image_column, label_column, mode, where
        self.targets = list(ds[label_column])

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        row = self.ds[int(i)]
        return decode(row[self.image_column], self.mode, f"{self.where} row {int(i)}"), int(row[self.label_column])


class HFDataModule(ClassificationDataModule):
    """A Hugging Face data set (map-style or streamed), standard path only. ImageNet statistics by default.

    Args (beyond ClassificationDataModule's):
        name: a Hub id, a folder written by save_to_disk, a parquet file or folder, or a builder name
            (``imagefolder``, ``parquet``) with ``data_dir`` / ``data_files``.
        split_map: ``{train, val, test}`` -> the data set's split names (default train / validation / test);
            a val or test name the data set lacks: carved from train (``val_split``) / the validation split.
        image_column, label_column: the columns (CIFAR-10: ``img``, ``label``).
        streaming: read as an IterableDataset (see the module docstring); ``shuffle_buffer``: its shuffle
            buffer; ``num_samples``: training examples per epoch (None: the data set's info).
        revision, cache_dir: for a Hub id.
    """

    has_val_split = True

    def __init__(self, *, name: str, split_map: dict | None = None, image_column: str = "image",
                 label_column: str = "label", streaming: bool = False, shuffle_buffer: int = 1000,
                 num_samples: int | None = None, data_dir: str | None = None, data_files=None,
                 revision: str | None = None, cache_dir: str | None = None, num_classes: int | None = None,
                 channels: int = 3, fast_path: bool = False, **kwargs) -> None:  # fmt: skip
        if not name:
            raise ConfigError("data.name is required for data=hf (a Hub id, or a folder written by save_to_disk)")
        if fast_path:
            raise ConfigError("data.fast_path=true: Hugging Face images are decoded per item; set data.fast_path=false")
        self.name, self.streaming = str(name), bool(streaming)
        self._said: set[str] = set()  # the splits a note has named as missing
        self.split_map = {**DEFAULT_SPLIT_MAP, **dict(split_map or {})}
        unknown = sorted(set(self.split_map) - set(SPLITS))
        if unknown:
            raise ConfigError(f"data.split_map.{unknown[0]}: valid keys: {', '.join(SPLITS)}")
        self.image_column, self.label_column = image_column, label_column
        self.shuffle_buffer, self.num_samples = int(shuffle_buffer), num_samples
        self._open = dict(streaming=self.streaming, data_dir=data_dir, data_files=data_files, revision=revision,
                          cache_dir=cache_dir)
        try:
            self._splits = splits_of(open_source(self.name, **self._open))
        except ConfigError:
            if num_classes is None:
                raise
            # a stored run's config (num_classes filled in) where its data is not: enough for its transforms
            # (predict, export, serve); check() and setup() open the data set and say what is wrong
            self._splits = None
        names = None
        if self._splits is not None:
            train = self._split_named("train", required=True)
            check_columns(train, self.name, self.split_map["train"], image_column, label_column)
            names = class_names_of(train, label_column)
        if num_classes is None:
            if names is None:
                raise ConfigError(f"data.label_column={label_column!r} of {self.name} is not a ClassLabel; "
                                  "set data.num_classes")
            num_classes = len(names)
        info = DatasetInfo(name=self.name, num_classes=None if names is None else len(names), channels=channels,
                           native_size=None, mean=IMAGENET_DEFAULT_MEAN[:channels] if channels == 3 else (0.5,),
                           std=IMAGENET_DEFAULT_STD[:channels] if channels == 3 else (0.5,),
                           class_names=None if names is None else tuple(names))  # fmt: skip
        super().__init__(info=info, num_classes=num_classes, channels=channels, fast_path=False, **kwargs)
        if self.streaming and (self.sampler != "default" or self.repeated_aug != 1 or self.naflex is not None):
            raise ConfigError("data.streaming=true reads in stream order: data.sampler=default, data.repeated_aug=1 "
                              "and data.naflex.enabled=false only")

    @staticmethod
    def facts_of(data) -> dict:
        """``num_classes`` from the label column's ClassLabel, when the config leaves it null (one line if it
        cannot be read: a Hub id that is neither cached nor reachable stops here, before anything is built)."""
        from omegaconf import OmegaConf

        if OmegaConf.is_missing(data, "name") or not data.name:
            raise ConfigError("data.name must be set: a Hub id (e.g. data.name=uoft-cs/cifar10), a folder written by "
                              "save_to_disk, parquet files, or a builder (imagefolder, parquet) with data.data_dir")
        source = open_source(str(data.name), streaming=bool(data.get("streaming", False)),
                             data_dir=data.get("data_dir"), data_files=_plain(data.get("data_files")),
                             revision=data.get("revision"), cache_dir=data.get("cache_dir"))
        split_map = {**DEFAULT_SPLIT_MAP, **(_plain(data.get("split_map")) or {})}
        splits = splits_of(source)
        train = splits.get(split_map["train"])
        if train is None:
            raise ConfigError(f"data.split_map.train={split_map['train']!r}: {data.name} has the splits "
                              f"{', '.join(splits)}")
        label = data.get("label_column", "label")
        check_columns(train, str(data.name), split_map["train"], data.get("image_column", "image"), label)
        names = class_names_of(train, label)
        if names is None:
            raise ConfigError(f"data.label_column={label!r} of {data.name} is not a ClassLabel; set data.num_classes")
        return {"num_classes": len(names)}

    # ---- splits ------------------------------------------------------------------------

    def check(self) -> None:
        if self._splits is None:
            self._splits = splits_of(open_source(self.name, **self._open))
            names = class_names_of(self._split_named("train", required=True), self.label_column)
            if names is not None and len(names) != self.num_classes:
                raise ConfigError(f"data.num_classes={self.num_classes} but {self.name} has {len(names)} classes; "
                                  f"set data.num_classes={len(names)}")
            self.class_names = names

    def _split_named(self, split: str, required: bool = False):
        theirs = self.split_map.get(split)
        ds = self._splits.get(theirs) if theirs else None
        if ds is None and required:
            raise ConfigError(f"data.split_map.{split}={theirs!r}: {self.name} has the splits {', '.join(self._splits)}")
        if ds is None and split not in self._said:
            self._said.add(split)
            instead = ("validation images carved from train by data.val_split" if split == "val"
                       else "testing on the validation split")
            why = (f"data.split_map.{split}=null" if theirs is None else
                   f"{self.name} has no split {theirs!r} for {split} (its splits: {', '.join(self._splits)})")
            _note(f"{why}: {instead}")
        return ds

    def _load(self, split: str):
        """train streamed (``data.streaming``) or map-style; val and test always map-style: they are small, and
        read that way every image is scored exactly once under DDP and the report knows which it was."""
        ds = self._split_named(split, required=split == "train")
        if ds is None:
            return None
        theirs = self.split_map[split]
        check_columns(ds, self.name, theirs, self.image_column, self.label_column)
        where = f"{self.name} ({theirs})"
        mode = "L" if self.channels == 1 else "RGB"
        if self.streaming and split == "train":
            return StreamingSource(ds, self.image_column, self.label_column, mode, where, self._count(ds))
        if self.streaming:
            ds = open_source(self.name, **{**self._open, "streaming": False}, split=theirs)
        return HFImages(ds, self.image_column, self.label_column, mode, where)

    def _count(self, ds) -> int:
        """Training examples per epoch of a stream: data.num_samples, else the data set's info."""
        if self.num_samples is not None:
            return int(self.num_samples)
        info, theirs = getattr(ds, "info", None), self.split_map["train"]
        n = info.splits[theirs].num_examples if info is not None and info.splits and theirs in info.splits else None
        if not n:
            raise ConfigError(f"{self.name} ({theirs}) does not say how many examples it streams; set data.num_samples "
                              "(training examples per epoch, which sizes the schedule)")
        return int(n)

    # ---- streaming: the training split ------------------------------------------------

    def _setup_train_val(self) -> None:
        if not self.streaming:
            return super()._setup_train_val()
        train = self._load("train")
        val = self._load("val")
        if val is None:  # a stream has no index to carve by
            raise ConfigError(f"data.streaming=true needs a validation split; {self.name} has {', '.join(self._splits)}: "
                              "set data.split_map.val=<one of them>, or data.streaming=false (val_split carves one)")
        self.data_train = train.transformed(self.transform(True))
        self.data_val = self._prepare(val, None, train=False)

    def _loader(self, ds, *, train: bool) -> DataLoader:
        if not isinstance(ds, StreamingSource):
            return super()._loader(ds, train=train)
        world, rank = rank_layout(self.trainer)
        batches = ds.batches(batch_size=self.batch_size, rank=rank, world=world, shuffle=self.shuffle,
                             buffer=self.shuffle_buffer, seed=self.seed, train=True)
        batches.set_epoch(self.resume.epoch)
        trainer = self.trainer
        if trainer is not None:  # each pass reshuffles with the epoch it trains (the loader is made once)
            batches.epoch_of = lambda: trainer.current_epoch
        batches.skip = self.resume.take_offset(1)  # in batches of this rank
        # read in this process (vitpipe.data.stream says why); it batches itself
        return DataLoader(batches, batch_size=None, num_workers=0, pin_memory=self.pin_memory)


def _plain(value):
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


@rank_zero_only
def _note(line: str) -> None:
    print(f"vitpipe: note: {line}", file=sys.stderr, flush=True)
