"""ShardsDataModule: train from shards written by ``scripts/make_shards.py``, on disk or in object storage.

Storage and streaming are LitData's (chunks + index.json per split; ``s3://``, ``gs://``,
``azure://``, ``hf://`` and ``r2://`` roots are downloaded chunk by chunk into a local cache). The
ORDER is vitpipe's: LitData's own iterable path drops the tail of an epoch under DDP (``drop_last``
is forced on in a distributed run) and resumes within tolerances, so here the splits are read as
map-style data sets through ``ChunkSampler``, a ShardedSampler whose order stays inside chunks.
Hence the guarantees of every other vitpipe data set: each training image once per epoch (ranks
padded from the head of the order to equal counts), each val/test image scored exactly once, exact
mid-epoch resume (``ResumeState``). Decoding and augmentation run in the loader workers (the
standard torchvision path; ``vitpipe.data.transforms``).

Multi-label shards (written from ``data=imagefolder data.labels=<file>.csv``; index ``format`` 2,
``task: multilabel``) give ``(image, multi-hot float32 (C,))`` as the image folder does, for
``module.task=multilabel``; each split's label sets are also kept apart from the images
(``<split>/vitpipe_labels.npz``), so ``multilabel_targets`` and ``pos_weight=balanced`` read no image.
Single-label shards stay format 1, read by earlier releases too (each split's ``fingerprint`` in the index,
what make_shards wrote it from, is a key they ignore).
"""

from __future__ import annotations

import inspect
import io
import os
import tempfile

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.data.images import open_image
from vitpipe.data.multilabel import MultiLabelSubset
from vitpipe.data.object_store import check_s3, is_s3
from vitpipe.data.sampler import ShardedSampler
from vitpipe.errors import ConfigError
from vitpipe.run.jsonfiles import loads

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # litdata asks PyPI per process otherwise (offline)

INDEX_FILE = "vitpipe_shards.json"  # beside the split folders: what make_shards wrote
# "format": the oldest reader that reads the shards. 1: one class per image (items hold "label": int).
# 2: adds "task"; "multilabel" items hold "labels" (the class indices of the image's set, a 1-D array),
# each split "positive_counts" and "unlabeled" in place of "class_counts" and its folder LABELS_FILE.
# A reader before format 2 refuses multi-label shards in one line instead of failing on a missing "label".
FORMAT_VERSION = 1
MULTILABEL_FORMAT = 2
FORMATS = (FORMAT_VERSION, MULTILABEL_FORMAT)
INDEX_KEYS = ("format", "class_names", "num_classes", "channels", "native_size", "mean", "std", "splits")
LABELS_FILE = "vitpipe_labels.npz"  # in a multi-label split's folder: its label sets in item order (CSR)


def is_url(root: str) -> bool:
    return "://" in root


def _fetch(root: str, name: str, cache_dir: str | None, storage_options: dict | None = None) -> str:
    """A local path holding ``root/name``: the file itself, or a downloaded copy for a URL root."""
    if not is_url(root):
        return os.path.join(root, name)
    from litdata.streaming.downloader import get_downloader

    local_dir = cache_dir or tempfile.mkdtemp(prefix="vitpipe-shards-")
    os.makedirs(local_dir, exist_ok=True)
    local = os.path.join(local_dir, name)
    get_downloader(root, local_dir, [], storage_options or {}).download_file(f"{root.rstrip('/')}/{name}", local)
    return local


def read_index(root: str, cache_dir: str | None = None, storage_options: dict | None = None) -> dict:
    """vitpipe's shard index under ``root`` (a folder or URL); ConfigError naming what is wrong. An
    ``s3://`` root is checked first with short timeouts (``object_store.check_s3``): a wrong key, a
    missing bucket or an endpoint that does not answer is one line within seconds."""
    where = f"{root.rstrip('/')}/{INDEX_FILE}"
    hint = "; write shards with scripts/make_shards.py data=<data config> out=DIR"
    if is_s3(root):
        check_s3(root, storage_options, need=INDEX_FILE)
    try:
        with open(_fetch(root, INDEX_FILE, cache_dir, storage_options)) as f:
            index = loads(f.read())  # depth-bounded (vitpipe.run.jsonfiles): never a RecursionError
    except FileNotFoundError:
        raise ConfigError(f"data.root={root}: no shard index {where}{hint}") from None
    except ValueError as err:
        raise ConfigError(f"data.root={root}: {where} is not a shard index ({err}){hint}") from None
    except Exception as err:  # a URL: the storage client's own error types
        raise ConfigError(f"data.root={root}: cannot read {where} ({type(err).__name__}: {err})") from None
    missing = [k for k in INDEX_KEYS if not isinstance(index, dict) or k not in index]
    task = index.get("task", "multiclass") if not missing else None
    if (missing or index["format"] not in FORMATS or "train" not in index["splits"]
            or (task == "multilabel") != (index["format"] == MULTILABEL_FORMAT)):  # fmt: skip
        what = f"missing {', '.join(missing)}" if missing else "another format or no train split"
        raise ConfigError(f"data.root={root}: {where} is not a vitpipe shard index ({what}){hint}")
    return index


def is_multilabel_index(index: dict) -> bool:
    """Whether a shard index (``read_index``) is of multi-label shards (items hold label sets)."""
    return index.get("task", "multiclass") == "multilabel"


def write_label_sets(path: str, label_sets: list) -> None:
    """Label sets (one 1-D array of class indices per item, in item order) -> ``path`` as CSR
    (``offsets`` (N + 1,) int64, ``classes`` the indices concatenated, in the items' dtype), via a temp
    file + rename."""
    offsets = np.cumsum([0, *(len(s) for s in label_sets)]).astype(np.int64)
    classes = np.concatenate(label_sets) if label_sets else np.zeros(0, np.uint16)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, offsets=offsets, classes=classes)
    os.replace(tmp, path)


def read_label_sets(path: str, num_classes: int) -> Tensor:
    """(N, C) float32 multi-hot targets from a ``write_label_sets`` file."""
    with np.load(path, allow_pickle=False) as f:
        offsets, classes = f["offsets"], f["classes"]
    _check_classes(classes, num_classes, path)
    rows = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    out = torch.zeros(len(offsets) - 1, num_classes)
    out[torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(classes.astype(np.int64))] = 1.0
    return out


def _check_classes(classes: np.ndarray, num_classes: int, where: str) -> None:
    """ConfigError naming ``where`` when a stored class index is not one of the index's classes."""
    bad = classes[(classes < 0) | (classes >= num_classes)] if classes.size else classes
    if bad.size:
        raise ConfigError(f"{where} holds class index {int(bad[0])}, not one of the {num_classes} classes of "
                          "vitpipe_shards.json; write the shards again with scripts/make_shards.py")


def multi_hot(labels, num_classes: int, where: str = "a shard item") -> Tensor:
    """A stored item's class indices -> (C,) float32 multi-hot."""
    classes = np.asarray(labels, dtype=np.int64)
    _check_classes(classes, num_classes, where)
    out = torch.zeros(num_classes)
    out[torch.as_tensor(classes)] = 1.0
    return out


class ShardSplit(Dataset):
    """One split's shards as a map-style data set of ``(PIL image, label)``; with ``num_classes`` (multi-label
    shards) of ``(PIL image, multi-hot float32 (C,))``, and ``targets`` the (N, C) matrix in item order, read
    from the split's labels file without reading an image.

    The LitData StreamingDataset opens lazily, in the process that reads (each loader worker).
    """

    def __init__(self, url: str, count: int, *, mode: str, cache_dir: str | None = None,
                 storage_options: dict | None = None, num_classes: int | None = None) -> None:
        import litdata  # noqa: F401  (here, in the parent: forked loader workers then skip a ~1 s import each)

        self.url, self.count, self.mode, self.cache_dir = url, count, mode, cache_dir
        self.storage_options = dict(storage_options or {})
        self.num_classes = num_classes  # None: single-label items
        self._stream = None
        self._targets: Tensor | None = None

    def __len__(self) -> int:
        return self.count

    def item(self, i: int) -> dict:
        """The stored item: ``{"image": bytes, "label": int, "source_index": int}`` (multi-label:
        ``"labels"``, the class indices of the image's set, in place of ``"label"``)."""
        if self._stream is None:
            from litdata import StreamingDataset

            self._stream = StreamingDataset(self.url, cache_dir=self.cache_dir, storage_options=self.storage_options,
                                            **_per_item_decode(StreamingDataset))
        return self._stream[int(i)]

    def __getitem__(self, i: int):
        item = self.item(i)
        image = open_image(io.BytesIO(item["image"]), self.mode)
        if self.num_classes is None:
            return image, int(item["label"])
        return image, multi_hot(item["labels"], self.num_classes, f"{self.url} item {i}")

    @property
    def targets(self) -> Tensor:
        """(N, C) float32 multi-hot targets in item order (multi-label shards only; AttributeError otherwise,
        so ``getattr(split, "targets", None)`` is None for single-label shards, whose labels are in the items)."""
        if self.num_classes is None:
            raise AttributeError("single-label shards keep their labels in the items only")
        if self._targets is None:
            local = _fetch(self.url, LABELS_FILE, self.cache_dir, self.storage_options)
            try:
                self._targets = read_label_sets(local, self.num_classes)
            except (OSError, ValueError, KeyError) as err:
                raise ConfigError(f"cannot read {self.url}/{LABELS_FILE} ({type(err).__name__}: {err}); an "
                                  "incomplete copy of the shards? write them again with scripts/make_shards.py") from None
            if len(self._targets) != self.count:
                raise ConfigError(f"{self.url}/{LABELS_FILE} holds {len(self._targets)} label sets for {self.count} "
                                  "images; write the shards again with scripts/make_shards.py")
        return self._targets

    def __getstate__(self) -> dict:  # workers open their own reader
        return {**self.__dict__, "_stream": None, "_targets": None}


def _per_item_decode(streaming_dataset) -> dict:
    """StreamingDataset's option to deserialise only the item asked for, where the release has it.

    From LitData 0.2.76 (older releases have no decode window) its ``batch_decode="auto"`` decodes an
    aligned window of up to 256 items around each read and keeps only that window; ChunkSampler's
    random order inside a chunk lands in another window almost every read, so each image cost
    ~350 us of Python deserialisation of 255 neighbours (~5 us per item alone), which made shards
    read at 0.58x of the same JPEG files from a folder (``scripts/benchmark.py --only shards``).
    """
    params = inspect.signature(streaming_dataset.__init__).parameters
    return {"batch_decode": 0} if "batch_decode" in params else {}


class ChunkSampler(ShardedSampler):
    """ShardedSampler over chunked storage: chunk-local order, one contiguous block per rank.

    Training order: the chunks in a random order, the items of each chunk in a random order (a
    function of (seed, epoch), as for ShardedSampler), so a worker reads one chunk at a time
    instead of one random chunk per image. Each rank takes a contiguous block of that order (a node
    downloads about 1/world of the chunks), of the same length as ShardedSampler's strided share:
    training pads from the head of the order, evaluation is not padded.
    """

    def __init__(self, chunk_sizes: list[int], **kwargs) -> None:
        super().__init__(sum(chunk_sizes), **kwargs)
        self.chunk_sizes = list(chunk_sizes)

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        starts = torch.tensor([0, *self.chunk_sizes]).cumsum(0)
        parts = [starts[c] + torch.randperm(self.chunk_sizes[c], generator=gen)
                 for c in torch.randperm(len(self.chunk_sizes), generator=gen).tolist()]  # fmt: skip
        return torch.cat(parts) if parts else torch.arange(0)

    def _indices(self) -> list[int]:
        order, world, rank = self._order(), self.num_replicas, self.rank
        if self.pad:
            total = len(self) * world
            order = order.repeat(-(-total // max(self.n, 1)))[:total]  # the head again, as ShardedSampler
            return order[rank * len(self) : (rank + 1) * len(self)].tolist()
        start = rank * (self.n // world) + min(rank, self.n % world)
        return order[start : start + len(self)].tolist()


class ShardsDataModule(ClassificationDataModule):
    """Images streamed from ``root`` (a folder or URL written by make_shards), standard path only.

    Class names, channels, the native size and mean/std come from the shard index (mean/std can be
    overridden); ``num_classes`` and ``channels`` (None: the index's) are checked against it.
    ``cache_dir``: where chunks of a URL root are downloaded (default: LitData's, under ~/.lightning).
    ``storage_options``: the object store's client settings (for ``s3://``: boto3 client arguments
    such as ``endpoint_url``, ``verify``, ``aws_access_key_id``; default: the standard AWS variables).
    Not supported here, with a one-line error: ``fast_path`` (the data is streamed, not held) and
    ``sampler=balanced`` (its draws with replacement jump between chunks; balance the classes when
    writing the shards). Multi-label shards (``multilabel``: from the index) give multi-hot (C,) float32
    targets, for ``module.task=multilabel``; NaFlex is refused on them as on a multi-label image folder.

    A run's config carries the index's facts (``facts_of``: class and channel counts, mean/std, native
    size, filled in at check_config), so the data module of a stored run builds where its shards are not
    (predict, export, serve and demo read no data file: the stored root moves under ``paths.data_dir``);
    check() and setup() still need the index.
    """

    has_val_split = True  # make_shards always writes val/

    def __init__(self, *, root: str, channels: int | None = None, num_classes: int | None = None,
                 cache_dir: str | None = None,
                 storage_options: dict | None = None, fast_path: bool = False, sampler: str = "default",
                 repeated_aug: int = 1, mean=None, std=None, native_size=None,
                 **kwargs) -> None:  # fmt: skip
        if root is None or not str(root).strip():
            raise ConfigError("data.root is required for shards (a folder or URL written by scripts/make_shards.py)")
        if fast_path:
            raise ConfigError("data.fast_path=true: shards are streamed from storage, not held in memory; "
                              "set data.fast_path=false")  # fmt: skip
        if sampler == "balanced":
            raise ConfigError("data.sampler=balanced is not supported with data=shards (random draws across all "
                              "chunks); use data.sampler=default or module.class_weights=balanced")  # fmt: skip
        if repeated_aug != 1:
            raise ConfigError(f"data.repeated_aug={repeated_aug!r} is not supported with data=shards (chunks are "
                              "streamed in order, not drawn per image); use data.repeated_aug=1")  # fmt: skip
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        self.storage_options = _plain(storage_options)
        try:
            self.index = read_index(str(root), self.cache_dir, self.storage_options)
        except ConfigError:
            if None in (num_classes, channels, mean, std):
                raise
            self.index = None  # a stored run's facts (its shards are elsewhere): enough for transforms; check() reads it
        idx = self.index or {"source": "data", "num_classes": num_classes, "channels": channels, "mean": mean,
                             "std": std, "native_size": native_size, "class_names": None}  # fmt: skip
        info = DatasetInfo(
            name=f"shards of {idx.get('source', 'data')}", num_classes=int(idx["num_classes"]),
            channels=int(idx["channels"]), native_size=None if idx["native_size"] is None else tuple(idx["native_size"]),
            mean=tuple(idx["mean"]), std=tuple(idx["std"]),
            class_names=None if idx["class_names"] is None else tuple(idx["class_names"]),
        )  # fmt: skip
        num_classes = info.num_classes if num_classes is None else num_classes  # a number given is checked
        if channels is not None and channels != info.channels:
            raise ConfigError(f"data.channels={channels!r} but the shards in {root} hold {info.channels}-channel images "
                              f"({INDEX_FILE}); set data.channels={info.channels} or leave it out (null: the index's)")
        channels = info.channels
        if kwargs.get("in_chans") is None:  # built without a config (whose model.in_chans follows data.channels)
            kwargs["in_chans"] = channels
        super().__init__(info=info, root=str(root).rstrip("/"), num_classes=num_classes, channels=channels,
                         fast_path=False, sampler=sampler, mean=mean, std=std, **kwargs)  # fmt: skip
        self.multilabel = self.index is not None and is_multilabel_index(idx)  # batches carry multi-hot (B, C) targets
        if self.multilabel and self.naflex is not None:
            raise ConfigError(f"data.naflex.enabled=true takes one class per image; data.root={self.root} holds "
                              "multi-label shards: set data.naflex.enabled=false")

    @staticmethod
    def num_classes_of(data) -> int:
        """The class count of a data config whose ``num_classes`` is null: the shard index's (a URL
        root: its one small JSON file is fetched, as constructing the data module does)."""
        return int(_index_of(data)["num_classes"])

    @staticmethod
    def facts_of(data) -> dict:
        """What the shard index says that a data config may leave null, in one read: the class and channel
        counts (``model.num_classes`` and ``model.in_chans`` follow them), mean/std and the native size (so
        a stored run's config builds its transforms without the index)."""
        index = _index_of(data)
        return {"num_classes": int(index["num_classes"]), "channels": int(index["channels"]),
                "mean": [float(m) for m in index["mean"]], "std": [float(s) for s in index["std"]],
                "native_size": None if index["native_size"] is None else [int(n) for n in index["native_size"]]}

    def check(self) -> None:
        if self.index is None:  # built from a stored run's facts: training and eval read the shards themselves
            self.index = read_index(self.root, self.cache_dir, self.storage_options)
        if not is_url(self.root):  # a URL's chunks are checked by LitData as they download
            for split, meta in self.index["splits"].items():
                if not meta["count"]:
                    continue
                path = os.path.join(self.root, split, "index.json")
                if not os.path.isfile(path):
                    raise ConfigError(f"data.root={self.root}: {path} is missing (an incomplete copy of the shards?)")

    def class_counts(self, split: str) -> list[int]:
        """Images per class in a split, from the index (no data read); multi-label shards: the images
        holding each class (``positive_counts``; images without a label: ``unlabeled``)."""
        meta = self.index["splits"][split]
        return list(meta["positive_counts"] if self.multilabel else meta["class_counts"])

    def _load(self, split: str) -> ShardSplit | None:
        meta = self.index["splits"].get(split)
        if meta is None:
            return None
        cache = None if self.cache_dir is None else os.path.join(self.cache_dir, split)
        return ShardSplit(f"{self.root}/{split}", int(meta["count"]), mode="L" if self.channels == 1 else "RGB",
                          cache_dir=cache, storage_options=self.storage_options,
                          num_classes=self.info.num_classes if self.multilabel else None)  # fmt: skip

    def _prepare(self, ds, indices, *, train: bool):
        if self.multilabel:  # targets kept as (C,) floats (the base class makes labels ints)
            return MultiLabelSubset(ds, indices, self.transform(train))
        return super()._prepare(ds, indices, train=train)

    def _sampler(self, ds: Dataset, *, train: bool, world: int, rank: int) -> ChunkSampler:
        split = ds.base.url.rsplit("/", 1)[1]
        return ChunkSampler(self.index["splits"][split]["chunk_sizes"], num_replicas=world, rank=rank,
                            shuffle=train and self.shuffle, seed=self.seed, pad=train)  # fmt: skip


def _index_of(data) -> dict:
    """The shard index a data config names (``data.root``, ``data.cache_dir``, ``data.storage_options``)."""
    cache_dir = data.get("cache_dir")
    return read_index(str(data.root), None if cache_dir is None else str(cache_dir), _plain(data.get("storage_options")))


def _plain(options) -> dict | None:
    """storage_options as a plain dict (a Hydra DictConfig is not what boto3 takes)."""
    if options is None:
        return None
    from omegaconf import DictConfig, OmegaConf

    return dict(OmegaConf.to_container(options, resolve=True)) if isinstance(options, DictConfig) else dict(options)
