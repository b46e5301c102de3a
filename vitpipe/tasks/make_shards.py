"""make_shards: any classification DataModule -> LitData shards that ``data=shards`` streams.

Layout of ``out``::

    train/ val/ [test/]     LitData chunks (chunk-*.bin) + LitData's index.json, one folder per split
    vitpipe_shards.json     vitpipe's index: class names, channels, native size, mean/std, counts and
                            each split's chunk sizes (the reader's sampler keeps reads chunk-local)

Each item is ``{"image": encoded bytes, "label": int, "source_index": int}``: an image file's own
bytes (a JPEG stays that JPEG: decoding gives the source's pixels), in-memory images as lossless PNG.
``source_index`` is the item's index in the source split, so a shard can be traced to its image.

Training items are written in a seeded random order: the reader shuffles within chunks, and chunks
of one class each (an image folder lists class by class) would give one-class batches. Val/test keep
the source order (a batch of them equals the source DataModule's batch).

Multi-label sources (``data=imagefolder data.labels=<file>.csv``) give ``{"image", "labels",
"source_index"}``: ``labels`` holds the class indices of the image's set as a 1-D uint16 array
(uint32 past 65,536 classes; empty for an image without labels). LitData stores a 1-D array as its
raw bytes with the dtype once per split (``no_header_numpy``), so a set costs 2 bytes per label
present, where a multi-hot row would cost C bytes whatever the set. A Python list is no option
across the supported releases: LitData 0.2.76 stores it as JSON text, 0.2.71 (the floor) flattens it
into one leaf per element, and there the leaf count must not vary between items. The index
is then format 2 with ``task: multilabel`` and, per split, ``positive_counts`` (images holding each
class) and ``unlabeled`` (images without a label) in place of ``class_counts``. Each split's folder
also holds its label sets in item order (``vitpipe_labels.npz``, written before the folder is
renamed into place), which ``multilabel_targets`` and ``pos_weight=balanced`` read without reading
an image. Single-label shards are written exactly as before (format 1).

Re-runnable: a split is written to ``.<split>.partial/`` and renamed when complete, the index is
written last (atomically); a re-run keeps a complete split only if it was written from the same items
with the same settings. Each split's folder holds the record of what it was written from
(``vitpipe_split.json``, ``split_record``: a digest of its items, the training order's seed, the chunk
size, the item layout; the index repeats it as the split's ``fingerprint``), so a re-run after an
interruption can judge the splits already written even before there is an index. A split written from
other items or settings (``data.seed=1`` after ``data.seed=0``: another validation split), or by an
earlier make_shards that kept no record, stops the run before anything is written, in one line naming
the split and what changed; ``overwrite=true`` writes it again (the old index is removed first, so an
interrupted rewrite is never read as complete). A folder named like a split that make_shards did not
write (no LitData index) is never removed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from tqdm import tqdm

from vitpipe.data.base import ClassificationDataModule
from vitpipe.data.shards import FORMAT_VERSION, INDEX_FILE, LABELS_FILE, MULTILABEL_FORMAT, write_label_sets
from vitpipe.data.splits import split_indices
from vitpipe.errors import ConfigError
from vitpipe.run.files import atomic_write_json

SPLITS = ("train", "val", "test")
RECORD_FILE = "vitpipe_split.json"  # in each split's folder: what it was written from (``split_record``)
RECORD_VERSION = 1  # how ``split_record`` digests the items; a record of another version never matches
COMPARED = ("version", "task", "num_classes", "count", "items", "seed", "shard_size")  # the bytes follow these


def encode_image(image) -> bytes:
    """A PIL image or uint8 (C, H, W) tensor -> PNG bytes (lossless)."""
    if isinstance(image, Tensor):
        array = image.permute(1, 2, 0).numpy()  # (H, W, C)
        image = Image.fromarray(array[..., 0] if array.shape[2] == 1 else array)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _source_splits(dm: ClassificationDataModule) -> dict[str, tuple[object, list[int]]]:
    """{split: (loaded data set, indices into it)}: the splits the DataModule itself would train on."""
    dm.prepare_data()
    train = dm._load("train")
    val = dm._load("val") if dm.has_val_split else None
    if val is None:  # the DataModule's own seeded split of the training set
        train_idx, val_idx = split_indices(len(train), dm.val_split, dm.seed)
        splits = {"train": (train, train_idx.tolist()), "val": (train, val_idx.tolist())}
    else:
        splits = {"train": (train, list(range(len(train)))), "val": (val, list(range(len(val))))}
    test = dm._load("test")
    if test is not None:
        splits["test"] = (test, list(range(len(test))))
    return splits


def _item_bytes(ds, i: int) -> tuple[bytes, int]:
    samples = getattr(ds, "samples", None)  # an ImageFolder: keep the file's own bytes
    if samples is not None:
        path, label = samples[i]
        with open(path, "rb") as f:
            return f.read(), int(label)
    image, label = ds[i]
    return encode_image(image), int(label)


def _multilabel_item(ds, i: int, dtype) -> tuple[bytes, np.ndarray]:
    """A multi-label source item: the file's own bytes (or PNG) and its label set as class indices."""
    samples = getattr(ds, "samples", None)  # MultiLabelImages: [(path, row)]
    if samples is not None:
        with open(samples[i][0], "rb") as f:
            image = f.read()
        target = _targets(ds)[i]
    else:
        image, target = ds[i]
        image = encode_image(image)
    return image, np.flatnonzero(np.asarray(target) > 0.5).astype(dtype)


def _targets(ds) -> torch.Tensor:
    """(N, C) multi-hot targets of a multi-label source split."""
    targets = getattr(ds, "targets", None)
    if isinstance(targets, torch.Tensor) and targets.ndim == 2:
        return targets
    return torch.stack([torch.as_tensor(ds[i][1]) for i in range(len(ds))])


def label_dtype(num_classes: int):
    """The narrowest unsigned dtype of a class index (one dtype per split: LitData's format is per split)."""
    return np.uint16 if num_classes <= 2**16 else np.uint32


def _complete_count(split_dir: str, *, multilabel: bool = False) -> int | None:
    """Items in a complete split folder, None if it is not one (or holds the other kind of labels)."""
    if os.path.isfile(os.path.join(split_dir, LABELS_FILE)) != multilabel:
        return None
    try:
        with open(os.path.join(split_dir, "index.json")) as f:
            return sum(c["chunk_size"] for c in json.load(f)["chunks"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _chunk_sizes(split_dir: str) -> list[int]:
    with open(os.path.join(split_dir, "index.json")) as f:
        chunks = json.load(f)["chunks"]
    return [int(c["chunk_size"]) for c in chunks]  # LitData merges them in write order


def write_split(ds, indices: list[int], split_dir: str, *, shard_size: str, shuffle_seed: int | None,
                desc: str, num_classes: int | None = None, record: dict | None = None) -> None:
    """Write ``ds[indices]`` to ``split_dir`` (complete or absent), in a random order if shuffle_seed.
    ``num_classes`` given: a multi-label source, whose items hold label sets (and the folder LABELS_FILE).
    ``record`` (``split_record``) is written into the folder before it is renamed into place."""
    from litdata.streaming.writer import BinaryWriter
    from litdata.types import File

    partial = os.path.join(os.path.dirname(split_dir), f".{os.path.basename(split_dir)}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier attempt
    order = list(range(len(indices)))
    if shuffle_seed is not None:
        order = torch.randperm(len(indices), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    # Each image as a File leaf (read back as its bytes): with pyarrow installed, LitData 0.2.75+ stores rows of
    # plain bytes and ints as Arrow record batches of 256 rows, and a read in ChunkSampler's order (random inside a
    # chunk) converted a whole batch to Python for one item (shards at 0.58-0.77x of the same JPEGs in a folder in
    # `scripts/benchmark.py --only shards --workers 2`, 0.97-1.15x as File leaves). A media leaf keeps per-item rows.
    writer = BinaryWriter(partial, chunk_bytes=shard_size)
    label_sets = []
    for n, k in enumerate(tqdm(order, desc=desc, unit="img")):
        if num_classes is None:
            image, label = _item_bytes(ds, indices[k])
            writer.add_item(n, {"image": File(bytes=image), "label": label, "source_index": k})
        else:
            image, labels = _multilabel_item(ds, indices[k], label_dtype(num_classes))
            writer.add_item(n, {"image": File(bytes=image), "labels": labels, "source_index": k})
            label_sets.append(labels)
    writer.done()
    writer.merge()
    if num_classes is not None:
        write_label_sets(os.path.join(partial, LABELS_FILE), label_sets)
    if record is not None:
        atomic_write_json(os.path.join(partial, RECORD_FILE), record)
    os.replace(partial, split_dir)


def split_record(ds, indices: list[int], *, multilabel: bool, num_classes: int, seed: int | None,
                 shard_size: str, settings: dict | None = None) -> dict:
    """What the bytes of a split written from ``ds[indices]`` are a function of (the keys of COMPARED):
    a digest of its items in source order (each image as its file's path, size and modification time,
    the identity the decode cache also trusts, or, held in memory, as its pixels; and its label or label
    set), their count, the training order's seed (None: the source order), the chunk size and the item
    layout. ``settings`` (the data config that chose the items) only explains a changed digest."""
    digest = hashlib.sha256()
    samples = getattr(ds, "samples", None)  # files: stat them, do not read them
    targets = _targets(ds) if multilabel else None
    for i in indices:
        if samples is not None:
            path = samples[i][0]
            st = os.stat(path)
            digest.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            label = None if multilabel else _label(ds, i)
        else:
            image, label = ds[i]
            digest.update(_pixel_bytes(image))
        if multilabel:
            label = np.flatnonzero(np.asarray(targets[i]) > 0.5).tolist()
        digest.update(f"{json.dumps(int(label) if not multilabel else label)}\n".encode())
    return {"version": RECORD_VERSION, "task": "multilabel" if multilabel else "multiclass", "num_classes": num_classes,
            "count": len(indices), "items": f"sha256:{digest.hexdigest()}", "seed": seed, "shard_size": str(shard_size),
            "settings": settings}  # fmt: skip


def _pixel_bytes(image) -> bytes:
    """An in-memory image's pixels with their shape and type (so a reshape or a mode change digests apart)."""
    if isinstance(image, Image.Image):
        return f"{image.mode}{image.size}".encode() + image.tobytes()
    array = np.ascontiguousarray(image.numpy() if isinstance(image, Tensor) else np.asarray(image))
    return f"{array.dtype}{array.shape}".encode() + array.tobytes()


def _read_record(split_dir: str) -> dict | None:
    try:
        with open(os.path.join(split_dir, RECORD_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _differences(old: dict, new: dict) -> str:
    """What changed between two split records, in the user's terms."""
    if old.get("version") != new["version"]:
        return "a record of another make_shards version"
    said = []
    if old.get("task") != new["task"]:
        said.append(f"{old.get('task')} items, now {new['task']}")
    if old.get("count") != new["count"] or old.get("items") != new["items"] or old.get("num_classes") != new["num_classes"]:
        before, now = _flat(old.get("settings")), _flat(new.get("settings"))
        changed = [f"{k} {before.get(k)} -> {now.get(k)}" for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
        which = f"{', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}" if changed and before else ""
        counts = f"{old.get('count')} images, now {new['count']}" if old.get("count") != new["count"] else ""
        said.append(f"other images or labels{' (' if counts or which else ''}{counts}{'; ' if counts and which else ''}"
                    f"{which}{')' if counts or which else ''}")
    for key in ("seed", "shard_size"):
        if old.get(key) != new[key]:
            said.append(f"{key} {old.get(key)} -> {new[key]}")
    return ", ".join(said)


def _flat(settings, prefix: str = "data") -> dict:
    if not isinstance(settings, dict):
        return {}
    out = {}
    for k, v in settings.items():
        out.update(_flat(v, f"{prefix}.{k}") if isinstance(v, dict) else {f"{prefix}.{k}": v})
    return out


def _stale(split_dir: str, record: dict | None, multilabel: bool) -> str | None:
    """Why the split folder ``split_dir`` (present) is not the one ``record`` describes (None: no items
    now), or None when it is: complete, of the same items and settings. ConfigError for a folder that
    make_shards did not write (no LitData index): that is never removed."""
    if not os.path.isdir(split_dir) or not os.path.isfile(os.path.join(split_dir, "index.json")):
        raise ConfigError(f"make_shards: {split_dir} is not a split make_shards wrote (no index.json) and would be "
                          "replaced; choose an empty folder or earlier shards for out=")
    if record is None:
        return "no images now"
    old = _read_record(split_dir)
    if old is None:
        return "written by an earlier make_shards, which kept no record of its items and settings"
    why = _differences(old, record)
    if why:
        return why
    if _complete_count(split_dir, multilabel=multilabel) != record["count"]:
        return f"its chunks do not hold the {record['count']} images of its record"
    return None


def make_shards(dm: ClassificationDataModule, out: str, *, shard_size: str = "64MB", seed: int = 0,
                overwrite: bool = False, settings: dict | None = None) -> dict:
    """Convert ``dm``'s train/val/test splits to shards under ``out``; returns the index written.

    Splits already in ``out`` are kept when written from the same items with the same settings
    (``split_record``); any other is a ConfigError naming it before anything is written, or with
    ``overwrite`` written again. ``settings``: the data config, stored to name what changed next time."""
    os.makedirs(out, exist_ok=True)
    multilabel = bool(getattr(dm, "multilabel", False))  # an image folder with a labels file
    splits = _source_splits(dm)
    records = {split: split_record(ds, indices, multilabel=multilabel, num_classes=dm.num_classes,
                                   seed=seed if split == "train" else None, shard_size=shard_size, settings=settings)
               for split, (ds, indices) in splits.items() if indices}  # fmt: skip
    present = [s for s in SPLITS if os.path.lexists(os.path.join(out, s))]
    stale = {s: why for s in present if (why := _stale(os.path.join(out, s), records.get(s), multilabel))}
    if stale and not overwrite:
        by_why: dict[str, list[str]] = {}
        for s, why in stale.items():
            by_why.setdefault(why, []).append(f"{s}/")
        raise ConfigError(f"out={out} holds shards written from other images or settings ("
                          + "; ".join(f"{', '.join(names)}: {why}" for why, names in by_why.items())
                          + "); add overwrite=true to write them again, or choose another out=")
    # an interrupted rewrite must not find the old index
    if (stale or any(s not in present for s in records)) and os.path.isfile(os.path.join(out, INDEX_FILE)):
        os.remove(os.path.join(out, INDEX_FILE))
    for split, why in stale.items():
        print(f"make_shards: {os.path.join(out, split)} was {why if why.startswith('written') else 'written from ' + why}"
              f"; {'written again' if split in records else 'removed'} (overwrite=true)")
        shutil.rmtree(os.path.join(out, split))
    index = {
        "format": MULTILABEL_FORMAT if multilabel else FORMAT_VERSION, "source": dm.info.name,
        "class_names": list(dm.class_names or []), "num_classes": dm.num_classes, "channels": dm.channels,
        "native_size": None if dm.native_size is None else list(dm.native_size),
        "mean": list(dm.mean), "std": list(dm.std), "splits": {},
    }  # fmt: skip
    if multilabel:
        index["task"] = "multilabel"
    if not index["class_names"]:
        index["class_names"] = [str(c) for c in range(dm.num_classes)]
    for split, (ds, indices) in splits.items():
        split_dir = os.path.join(out, split)
        if not indices:  # e.g. val_split=0: nothing to write (LitData writes no index for no items)
            index["splits"][split] = ({"count": 0, "chunk_sizes": [], "positive_counts": [0] * dm.num_classes,
                                       "unlabeled": 0} if multilabel else
                                      {"count": 0, "chunk_sizes": [], "class_counts": [0] * dm.num_classes})
            continue
        if os.path.isdir(split_dir):  # not stale: complete, from the same items and settings
            print(f"make_shards: {split_dir} is complete ({len(indices)} images), kept: the same items and settings")
        else:
            write_split(ds, indices, split_dir, shard_size=shard_size, shuffle_seed=seed if split == "train" else None,
                        desc=f"{split} -> {split_dir}", num_classes=dm.num_classes if multilabel else None,
                        record=records[split])
        meta = {"count": len(indices), "chunk_sizes": _chunk_sizes(split_dir),
                "fingerprint": {k: records[split][k] for k in COMPARED}}
        if multilabel:
            targets = _targets(ds)[torch.as_tensor(indices, dtype=torch.long)] > 0.5  # (N, C)
            meta.update(positive_counts=targets.sum(0).tolist(), unlabeled=int((~targets.any(1)).sum()))
        else:
            labels = torch.tensor([_label(ds, i) for i in indices], dtype=torch.long)
            meta["class_counts"] = torch.bincount(labels, minlength=dm.num_classes).tolist()
        index["splits"][split] = meta
    atomic_write_json(os.path.join(out, INDEX_FILE), index)
    return index


def _settings(data) -> dict | None:
    """The data config as plain values (stored in each split's record, to name what changed on a re-run)."""
    from omegaconf import OmegaConf

    from vitpipe.run.stored import LOCAL_KEYS

    try:
        settings = OmegaConf.to_container(data, resolve=True)
    except Exception:  # noqa: BLE001 - only an explanation: a value that does not resolve leaves it out
        return None
    return {k: v for k, v in settings.items() if k not in LOCAL_KEYS}  # never storage credentials or caches


def _label(ds, i: int) -> int:
    targets = getattr(ds, "targets", None)
    if targets is not None:
        return int(targets[i])
    labels = getattr(ds, "labels", None)
    if labels is not None:
        return int(labels[i])
    return int(ds[i][1])


def make_shards_from_config(cfg) -> dict:
    """scripts/make_shards.py: ``cfg.data`` (any classification data config) -> shards in ``cfg.out``,
    a folder or an ``s3://bucket/prefix`` URL (written to a local folder first, then uploaded with
    the indexes last, so a reader never finds an index before what it lists)."""
    from hydra.utils import instantiate

    from vitpipe.data.object_store import check_s3, is_s3, upload_tree
    from vitpipe.data.shards import _plain

    out = str(cfg.out)
    storage_options = _plain(cfg.get("storage_options"))
    if "://" in out and not is_s3(out):
        raise ConfigError(f"out={out}: make_shards writes to a folder or an s3:// URL; for other stores, write to a "
                          "folder and copy it with the store's own tool")
    if is_s3(out):
        check_s3(out, storage_options, key="out")  # before any image is converted
    else:  # not the data it converts, nor in it; writable (vitpipe.run.outputs), before any image is read
        from vitpipe.run.outputs import data_inputs, prepare_output

        prepare_output(out, data_inputs(cfg.data), key="out", folder=True)
    dm = instantiate(cfg.data)
    if not isinstance(dm, ClassificationDataModule):
        raise ConfigError(f"data={cfg.data._target_}: make_shards converts classification data sets only")
    local = tempfile.mkdtemp(prefix="vitpipe-shards-upload-") if is_s3(out) else os.path.abspath(out)
    try:
        index = make_shards(dm, local, shard_size=str(cfg.shard_size), seed=int(cfg.seed),
                            overwrite=bool(cfg.get("overwrite", False)), settings=_settings(cfg.data))
        if is_s3(out):
            last = tuple(f"{split}/index.json" for split in SPLITS) + (INDEX_FILE,)
            upload_tree(local, out, storage_options, last=last)
    finally:
        if is_s3(out):
            shutil.rmtree(local, ignore_errors=True)
    out = out if is_s3(out) else local
    counts = ", ".join(f"{s} {m['count']} images in {len(m['chunk_sizes'])} chunk(s)" for s, m in index["splits"].items())
    task = " module.task=multilabel" if index.get("task") == "multilabel" else ""
    print(f"make_shards: {out}: {counts}; train with data=shards data.root={out} "
          f"data.num_classes={index['num_classes']} data.channels={index['channels']}{task}")
    return index
