"""make_aspect_data: Fashion-MNIST items on canvases of random aspect ratio, as an image folder.

    python scripts/make_aspect_data.py --out data/fmnist_aspect --train 2000 --val 500 --test 500 --seed 0

Layout of ``out`` (what ``data=imagefolder data.root=<out>`` reads)::

    train/ val/ test/ <label>_<class name>/<source split>-<source index>.png    8-bit grayscale PNGs
    manifest.csv      one row per image: split, path, label, source split and index, canvas size, item box

Each item is scaled (bicubic) so that its square fits the canvas's short side (``--short-side``;
28, the default, keeps the pixels as they are) and placed at a random offset along the long side
of a canvas filled with ``--background``; the canvas's aspect ratio W/H is log-uniform in
[1/3, 3] (as many tall canvases as wide ones), rounded to whole pixels. The item's own square
keeps its aspect, so the only thing that tells canvases apart is where, and on how wide a field,
the item sits: what squashing a canvas to a square distorts and native-aspect (NaFlex) input keeps.

Class-balanced: each split holds ``count // 10`` items of every class, the first ``count % 10``
classes one more. train/ and val/ draw disjoint items of Fashion-MNIST's training set, test/ from
its test set. Deterministic: one ``--seed`` gives the same files byte for byte (PNGs without
metadata). The set is written into a temporary folder beside ``out`` and renamed when complete,
so an interrupted run leaves no half data set under ``out``.

``--squash N`` writes the same canvases (same seed: same items, layouts and manifest) resized to
N x N, bicubic: the baseline of a fixed-size model that squashes every image to a square.
"""

from __future__ import annotations

import argparse
import gzip
import io
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from vitpipe.data.fashion_mnist import DEBIAN_DIR, FASHION_MNIST
from vitpipe.errors import ConfigError
from vitpipe.export.staging import staged_folder
from vitpipe.run.csvfiles import dict_csv_text

MAX_ASPECT = 3.0  # canvases span W/H in [1/MAX_ASPECT, MAX_ASPECT]
SOURCE_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
MANIFEST = "manifest.csv"
FIELDS = ("split", "path", "label", "source_split", "source_index", "height", "width", "top", "left", "item_size")


@dataclass(frozen=True)
class AspectConfig:
    """Counts per split (items over all classes), canvas short side in pixels, background grey level."""

    out: str
    train: int = 2000
    val: int = 500
    test: int = 500
    seed: int = 0
    short_side: int = 28
    background: int = 0
    source_dir: str = DEBIAN_DIR
    overwrite: bool = False
    squash: int | None = None  # N: every canvas resized to N x N afterwards (the squash baseline of the same items)

    def __post_init__(self) -> None:
        for name in ("train", "val", "test"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name}={getattr(self, name)}: expected a count >= 0")
        if self.train < 1:
            raise ConfigError(f"--train={self.train}: the image folder needs at least one training image")
        if self.short_side < 4:
            raise ConfigError(f"--short-side={self.short_side}: expected an int >= 4 (pixels)")
        if self.squash is not None and self.squash < 4:
            raise ConfigError(f"--squash={self.squash}: expected an int >= 4 (pixels) or no --squash")
        if not 0 <= self.background <= 255:
            raise ConfigError(f"--background={self.background}: expected a grey level in 0..255")


def class_folder(label: int) -> str:
    """``<label>_<name>``: sorted folder names give label order; '/' and ' ' are not kept ('T-shirt/top')."""
    name = FASHION_MNIST.class_names[label].replace("/", "-").replace(" ", "_")
    return f"{label}_{name}"


def read_idx(path: str) -> np.ndarray:
    """An idx file (LeCun's MNIST format, gzip'd) -> uint8 array: (N,) labels or (N, 28, 28) images."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, ndim = int.from_bytes(data[0:4], "big"), data[3]
    if magic >> 8 != 0x08:  # 0x08: unsigned byte
        raise ConfigError(f"{path}: not an unsigned-byte idx file (magic {magic:#x})")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_source(source_dir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train"|"test": (images (N, 28, 28), labels (N,))} from the gz idx files."""
    missing = [n for pair in SOURCE_FILES.values() for n in pair if not os.path.isfile(os.path.join(source_dir, n))]
    if missing:
        raise ConfigError(f"--source-dir={source_dir} lacks {', '.join(missing)}; install Debian's "
                          f"dataset-fashion-mnist ({DEBIAN_DIR}) or point --source-dir at the gz idx files")
    return {split: (read_idx(os.path.join(source_dir, im)), read_idx(os.path.join(source_dir, lb)))
            for split, (im, lb) in SOURCE_FILES.items()}


def per_class(count: int, num_classes: int) -> list[int]:
    """``count`` items as evenly over the classes as whole numbers allow (the first classes one more)."""
    return [count // num_classes + (c < count % num_classes) for c in range(num_classes)]


def choose(labels: np.ndarray, counts: list[list[int]], rng: np.random.Generator) -> list[list[int]]:
    """Disjoint class-balanced index lists, one per entry of ``counts`` (per-class counts), drawn
    from a seeded permutation of each class's items."""
    picked = [[] for _ in counts]
    for c in range(len(counts[0])):
        pool = rng.permutation(np.flatnonzero(labels == c))
        need = sum(n[c] for n in counts)
        if need > len(pool):
            raise ConfigError(f"class {c} has {len(pool)} source items, {need} were asked for; lower the counts")
        start = 0
        for out, n in zip(picked, counts):
            out += pool[start : start + n[c]].tolist()
            start += n[c]
    return [sorted(p) for p in picked]


def canvas_layout(rng: np.random.Generator, short: int) -> tuple[int, int, int, int]:
    """(height, width, top, left) of a canvas with log-uniform aspect in [1/3, 3] and the item's
    ``short`` x ``short`` square at a random place along the long side."""
    aspect = math.exp(rng.uniform(-math.log(MAX_ASPECT), math.log(MAX_ASPECT)))  # W / H
    long = min(max(round(short * max(aspect, 1 / aspect)), short), math.floor(short * MAX_ASPECT))
    offset = int(rng.integers(0, long - short + 1))
    return (short, long, 0, offset) if aspect >= 1 else (long, short, offset, 0)


def render(item: np.ndarray, layout: tuple[int, int, int, int], short: int, background: int) -> np.ndarray:
    """The (H, W) uint8 canvas with ``item`` (28, 28) scaled to ``short`` pixels at (top, left)."""
    h, w, top, left = layout
    canvas = np.full((h, w), background, dtype=np.uint8)
    if item.shape != (short, short):
        item = np.asarray(Image.fromarray(item).resize((short, short), Image.Resampling.BICUBIC))
    canvas[top : top + short, left : left + short] = item
    return canvas


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")  # no metadata: same pixels -> same bytes
    return buf.getvalue()


def plan(cfg: AspectConfig, source: dict) -> list[dict]:
    """One row per output image (the manifest), in a fixed order; all randomness from ``cfg.seed``."""
    rng = np.random.default_rng(cfg.seed)
    C = FASHION_MNIST.num_classes
    train_idx, val_idx = choose(source["train"][1], [per_class(cfg.train, C), per_class(cfg.val, C)], rng)
    (test_idx,) = choose(source["test"][1], [per_class(cfg.test, C)], rng)
    rows = []
    for split, src, indices in (("train", "train", train_idx), ("val", "train", val_idx), ("test", "test", test_idx)):
        for i in indices:
            label = int(source[src][1][i])
            h, w, top, left = canvas_layout(rng, cfg.short_side)
            path = f"{split}/{class_folder(label)}/{src}-{i:05d}.png"
            rows.append(dict(zip(FIELDS, (split, path, label, src, i, h, w, top, left, cfg.short_side), strict=True)))
    return rows


def make_aspect_data(cfg: AspectConfig, *, progress: bool = True) -> Path:
    """Write the data set (see the module docstring); returns ``out``."""
    out = Path(cfg.out)
    if out.exists() and not cfg.overwrite:
        raise ConfigError(f"--out={out} exists; pass --overwrite to replace it, or choose another folder")
    source = load_source(cfg.source_dir)  # checked before anything is written
    rows = plan(cfg, source)
    with staged_folder(out, overwrite=True) as tmp:  # checked above; a kill leaves the old set or none
        for split in ("train", "val", "test"):  # every class folder, even an empty one: the same classes
            for c in range(FASHION_MNIST.num_classes):
                (tmp / split / class_folder(c)).mkdir(parents=True)
        for r in tqdm(rows, desc=f"aspect data -> {out}", unit="img", disable=not progress):
            item = source[r["source_split"]][0][r["source_index"]]
            canvas = render(item, (r["height"], r["width"], r["top"], r["left"]), cfg.short_side, cfg.background)
            if cfg.squash:  # what resizing to a square does to a canvas, stored: the fixed path's baseline
                canvas = np.asarray(Image.fromarray(canvas).resize((cfg.squash, cfg.squash), Image.Resampling.BICUBIC))
            (tmp / r["path"]).write_bytes(png_bytes(canvas))
        write_manifest(tmp / MANIFEST, rows, FIELDS)
    return out


def data_set_parser(description: str, *, what: str) -> argparse.ArgumentParser:
    """The options every Fashion-MNIST-derived data set writer takes (``what``: what ``--train`` counts)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="folder to create (data.root of data=imagefolder)")
    p.add_argument("--train", type=int, default=2000, help=f"training {what}")
    p.add_argument("--val", type=int, default=500)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source-dir", default=DEBIAN_DIR, help="folder of Fashion-MNIST's gz idx files")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--no-progress", action="store_true")
    return p


def write_manifest(path: Path, rows: list[dict], fields) -> None:
    """``rows`` as a CSV with the header ``fields`` (inside a staged folder: renamed with it)."""
    Path(path).write_text(dict_csv_text(rows, list(fields)), encoding="utf-8")  # vitpipe's one CSV writer


def parse_args(argv=None) -> argparse.Namespace:
    p = data_set_parser(__doc__.split("\n")[0], what="images (all classes together)")
    p.add_argument("--short-side", type=int, default=28, help="canvas short side in pixels (the item's size)")
    p.add_argument("--background", type=int, default=0, help="canvas grey level 0..255")
    p.add_argument("--squash", type=int, default=None,
                   help="resize every canvas to N x N (the same items squashed: a baseline for native aspect)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = AspectConfig(out=args.out, train=args.train, val=args.val, test=args.test, seed=args.seed,
                           short_side=args.short_side, background=args.background, source_dir=args.source_dir,
                           overwrite=args.overwrite, squash=args.squash)
        out = make_aspect_data(cfg, progress=not args.no_progress)
    except ConfigError as e:
        print(f"make_aspect_data: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {cfg.train + cfg.val + cfg.test} images to {out} (manifest: {out / MANIFEST})")
    return 0
