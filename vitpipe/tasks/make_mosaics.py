"""make_mosaics: Fashion-MNIST 2x2 mosaics with the set of classes present as labels (multi-label).

    python scripts/make_mosaics.py --out data/fmnist_mosaics --train 2000 --val 500 --test 500 --seed 0

Layout of ``out`` (what ``data=imagefolder data.root=<out> data.labels=labels.csv module.task=multilabel``
reads)::

    train/ val/ test/ <index>.png     56 x 56 8-bit grayscale PNGs (four 28 x 28 tiles)
    labels.csv                        path,labels,split   labels: class names joined by ';'
    manifest.csv                      split, path, the four tiles' source split and index and class

Each mosaic first draws how many classes it shows, k uniform in 1..4, then k distinct classes
(uniform), then fills its four tiles so that each of the k classes appears at least once (the rest
drawn from the k), in a random order; each tile is a random item of its class. Its labels are the k
classes: 1 to 4 labels, 2.5 on average, each class on a quarter of the images. train/ and val/ draw
items from disjoint parts of Fashion-MNIST's training set (its first 50,000 and last 10,000
images), test/ from its test set. Class names: Fashion-MNIST's, with '/' and ' ' replaced
(``T-shirt-top``). Deterministic: one ``--seed`` gives the same files byte for byte. The set is
written into a temporary folder beside ``out`` and renamed when complete, so an interrupted run
leaves no half data set under ``out``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vitpipe.data.fashion_mnist import DEBIAN_DIR, FASHION_MNIST
from vitpipe.errors import ConfigError
from vitpipe.export.staging import staged_folder
from vitpipe.tasks.make_aspect_data import data_set_parser, load_source, png_bytes, write_manifest

TILE = 28
LABELS_FILE = "labels.csv"
MANIFEST = "manifest.csv"
VAL_SOURCE_START = 50_000  # val/ items: Fashion-MNIST train images 50,000..59,999; train/ items: the rest
CLASS_NAMES = tuple(n.replace("/", "-").replace(" ", "_") for n in FASHION_MNIST.class_names)
MANIFEST_FIELDS = ("split", "path", *(f"tile{t}_{k}" for t in range(4) for k in ("source", "index", "class")))


@dataclass(frozen=True)
class MosaicConfig:
    """Images per split, the seed, where the Fashion-MNIST gz idx files are."""

    out: str
    train: int = 2000
    val: int = 500
    test: int = 500
    seed: int = 0
    source_dir: str = DEBIAN_DIR
    overwrite: bool = False

    def __post_init__(self) -> None:
        for name in ("train", "val", "test"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name}={getattr(self, name)}: expected a count >= 0")
        if self.train < 1:
            raise ConfigError(f"--train={self.train}: the data set needs at least one training image")


def tile_classes(rng: np.random.Generator, num_classes: int = 10) -> list[int]:
    """The classes of the four tiles (row-major): k ~ U{1..4} distinct classes, each at least once."""
    k = int(rng.integers(1, 5))
    chosen = rng.choice(num_classes, size=k, replace=False).tolist()
    tiles = chosen + rng.choice(chosen, size=4 - k).tolist()
    return [int(c) for c in rng.permutation(tiles)]


def plan(cfg: MosaicConfig, source: dict) -> list[dict]:
    """One manifest row per mosaic, in a fixed order; all randomness from ``cfg.seed``."""
    rng = np.random.default_rng(cfg.seed)
    train_labels, test_labels = source["train"][1], source["test"][1]
    n = len(train_labels)
    pools = {  # split -> (source split, class -> its item indices)
        "train": ("train", np.arange(min(VAL_SOURCE_START, n))),
        "val": ("train", np.arange(min(VAL_SOURCE_START, n), n)),
        "test": ("test", np.arange(len(test_labels))),
    }
    rows = []
    for split, count in (("train", cfg.train), ("val", cfg.val), ("test", cfg.test)):
        src, items = pools[split]
        labels = source[src][1][items]
        by_class = [items[labels == c] for c in range(FASHION_MNIST.num_classes)]
        for i in range(count):
            row = {"split": split, "path": f"{split}/{i:05d}.png"}
            for t, c in enumerate(tile_classes(rng)):
                if not len(by_class[c]):
                    raise ConfigError(f"--source-dir has no {split} items of class {c}")
                row.update({f"tile{t}_source": src, f"tile{t}_index": int(rng.choice(by_class[c])), f"tile{t}_class": c})
            rows.append(row)
    return rows


def mosaic(source: dict, row: dict) -> np.ndarray:
    """The (56, 56) uint8 image of a manifest row: tiles 0 1 / 2 3."""
    tiles = [source[row[f"tile{t}_source"]][0][row[f"tile{t}_index"]] for t in range(4)]
    return np.block([[tiles[0], tiles[1]], [tiles[2], tiles[3]]])


def row_labels(row: dict) -> list[str]:
    """The class names present, in class order."""
    return [CLASS_NAMES[c] for c in sorted({row[f"tile{t}_class"] for t in range(4)})]


def make_mosaics(cfg: MosaicConfig, *, progress: bool = True) -> Path:
    """Write the data set (see the module docstring); returns ``out``."""
    out = Path(cfg.out)
    if out.exists() and not cfg.overwrite:
        raise ConfigError(f"--out={out} exists; pass --overwrite to replace it, or choose another folder")
    source = load_source(cfg.source_dir)  # checked before anything is written
    rows = plan(cfg, source)
    with staged_folder(out, overwrite=True) as tmp:  # checked above; a kill leaves the old set or none
        for split in ("train", "val", "test"):
            (tmp / split).mkdir()
        for r in tqdm(rows, desc=f"mosaics -> {out}", unit="img", disable=not progress):
            (tmp / r["path"]).write_bytes(png_bytes(mosaic(source, r)))
        with open(tmp / LABELS_FILE, "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(("path", "labels", "split"))
            writer.writerows((r["path"], ";".join(row_labels(r)), r["split"]) for r in rows)
        write_manifest(tmp / MANIFEST, rows, MANIFEST_FIELDS)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    return data_set_parser(__doc__.split("\n")[0], what="mosaics").parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = MosaicConfig(out=args.out, train=args.train, val=args.val, test=args.test, seed=args.seed,
                           source_dir=args.source_dir, overwrite=args.overwrite)
        out = make_mosaics(cfg, progress=not args.no_progress)
    except ConfigError as e:
        print(f"make_mosaics: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {cfg.train + cfg.val + cfg.test} mosaics to {out} (labels: {out / LABELS_FILE})")
    return 0
