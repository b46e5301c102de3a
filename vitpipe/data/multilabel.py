"""Multi-label image folders: a labels file (CSV) beside the images names each image's label set.

``data=imagefolder data.labels=labels.csv`` reads ``<data.root>/labels.csv`` (or an absolute path).
Two layouts, told apart by the header:

    path,labels[,split]                 labels: class names separated by ``;`` or ``|`` (empty: none)
    path[,split],<class>,<class>,...    one 0/1 column per class

``path`` is relative to ``data.root`` (absolute paths and ``..`` are refused: the file is data and
names images under the root only). Splits: an optional ``split`` column (``train``, ``val``,
``test``); rows without one, or a file without the column, are training rows, and a split with no
rows is carved from them as today's image folder does (``data.val_split``, ``data.test_split``,
seeded). Class names: the one-column layout's class columns in file order; the list layout's names
on training rows, sorted. A validation or test row naming a class no training row has is refused
(as a val/ class folder that train/ lacks), so are a repeated path, a split or cell value outside
the valid ones, and a row without a path, each in one line naming the file and line.

Targets are multi-hot float32 tensors (C,); batches (B, C).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vitpipe.data.images import load_image
from vitpipe.data.transforms import TransformedSubset
from vitpipe.errors import ConfigError

SPLIT_NAMES = ("train", "val", "test")
ON_EMPTY_LABELS = ("keep", "skip", "error")


def is_labels_file(labels) -> bool:
    """Whether ``data.labels`` names a labels file (rather than ``folders`` or ``none``)."""
    return isinstance(labels, str) and labels.lower().endswith(".csv")


def labels_path(root, labels: str) -> str:
    return labels if os.path.isabs(labels) else os.path.join(str(root), labels)


@dataclass(frozen=True)
class LabelRow:
    line: int  # 1-based line in the file (the header is line 1)
    path: str  # as written, relative to data.root
    split: str  # train | val | test
    labels: tuple[str, ...]  # class names


@dataclass(frozen=True)
class LabelsFile:
    """A parsed labels file: its rows and class names (see the module docstring)."""

    file: str
    rows: tuple[LabelRow, ...]
    class_names: tuple[str, ...]
    has_split: bool

    @classmethod
    def read(cls, file: str) -> LabelsFile:
        if not os.path.isfile(file):
            raise ConfigError(f"data.labels: {file} does not exist; write a CSV with a header "
                              "path,labels (labels separated by ; or |) or path,<class>,<class>,... (0/1 columns)")
        with open(file, newline="", encoding="utf-8-sig") as f:
            table = [(n, row) for n, row in enumerate(csv.reader(f), start=1) if any(c.strip() for c in row)]
        if not table:
            raise ConfigError(f"{file} is empty; expected a header path,labels or path,<class>,...")
        header = [h.strip() for h in table[0][1]]
        if "path" not in header:
            raise ConfigError(f"{file}: header {','.join(header)} has no path column; expected path,labels[,split] "
                              "or path[,split],<class>,<class>,...")
        dup = sorted({h for h in header if header.count(h) > 1})
        if dup or "" in header:
            raise ConfigError(f"{file}: header column(s) {', '.join(dup) or '(empty)'} repeated or unnamed; "
                              "name each column once")
        class_cols = [h for h in header if h not in ("path", "split", "labels")]
        if "labels" in header and class_cols:
            raise ConfigError(f"{file}: header has a labels column and other columns ({', '.join(class_cols)}); "
                              "use path,labels[,split] or path[,split],<class>,... (0/1 columns), not both")
        if "labels" not in header and not class_cols:
            raise ConfigError(f"{file}: header {','.join(header)} names no labels column and no class columns")
        rows = tuple(_row(file, n, dict(zip(header, cells)), len(cells) == len(header), class_cols)
                     for n, cells in table[1:])
        _check_paths(file, rows)
        names = tuple(class_cols) if class_cols else _train_names(file, rows)
        return cls(file=file, rows=rows, class_names=names, has_split="split" in header)

    def split_rows(self, split: str) -> list[LabelRow]:
        return [r for r in self.rows if r.split == split]

    def targets(self, rows: list[LabelRow]) -> Tensor:
        """(N, C) float32 multi-hot targets of ``rows``."""
        index = {name: c for c, name in enumerate(self.class_names)}
        out = torch.zeros(len(rows), len(self.class_names))
        for i, r in enumerate(rows):
            out[i, [index[name] for name in r.labels]] = 1.0
        return out


def _row(file: str, n: int, cells: dict, complete: bool, class_cols: list[str]) -> LabelRow:
    where = f"{file} line {n}"
    if not complete:
        raise ConfigError(f"{where} has a different number of cells than the header; one cell per column")
    path = cells["path"].strip()
    if not path:
        raise ConfigError(f"{where} has no path; every row names one image (relative to data.root)")
    if os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
        raise ConfigError(f"{where}: path {path!r} leaves data.root; paths are relative to data.root, without ..")
    split = cells.get("split", "").strip() or "train"
    if split not in SPLIT_NAMES:
        raise ConfigError(f"{where}: split={split!r}; valid: {', '.join(SPLIT_NAMES)} (empty: train)")
    if not class_cols:
        text = cells["labels"].replace("|", ";")
        labels = tuple(dict.fromkeys(s.strip() for s in text.split(";") if s.strip()))
        return LabelRow(n, path, split, labels)
    bad = [(c, cells[c].strip()) for c in class_cols if cells[c].strip() not in ("0", "1")]
    if bad:
        raise ConfigError(f"{where}: column {bad[0][0]} holds {bad[0][1]!r}; class columns hold 0 or 1")
    return LabelRow(n, path, split, tuple(c for c in class_cols if cells[c].strip() == "1"))


def _check_paths(file: str, rows: tuple[LabelRow, ...]) -> None:
    first: dict[str, int] = {}
    for r in rows:
        key = os.path.normpath(r.path)
        if key in first:
            raise ConfigError(f"{file} line {r.line} names {r.path} again (first on line {first[key]}); "
                              "one row per image, all its labels in that row")
        first[key] = r.line


def _train_names(file: str, rows: tuple[LabelRow, ...]) -> tuple[str, ...]:
    names = sorted({name for r in rows if r.split == "train" for name in r.labels})
    if not names:
        raise ConfigError(f"{file}: no training row has a label; the classes are the labels of the training rows")
    known = set(names)
    for r in rows:
        unknown = [name for name in r.labels if name not in known]
        if unknown:
            shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
            raise ConfigError(f"{file} line {r.line} ({r.split}) names class {unknown[0]!r}, which no training row "
                              f"has ({len(names)} classes: {shown}); fix the label or add training images of it")
    return tuple(names)


class MultiLabelImages(Dataset):
    """``(PIL RGB image, multi-hot float32 (C,))`` per file; ``samples`` is ``[(path, row)]``,
    ``targets`` the (N, C) multi-hot matrix."""

    def __init__(self, paths: list[str], targets: Tensor, classes: list[str]) -> None:
        if len(paths) != len(targets):
            raise ValueError(f"{len(paths)} paths but {len(targets)} targets")
        self.paths, self.targets, self.classes = list(paths), targets.float(), classes
        self.samples = list(zip(self.paths, range(len(self.paths))))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return load_image(self.paths[i]), self.targets[i]

    def subset(self, indices) -> MultiLabelImages:
        idx = [int(i) for i in indices]
        return MultiLabelImages([self.paths[i] for i in idx], self.targets[idx], self.classes)


class MultiLabelSubset(TransformedSubset):
    """``TransformedSubset`` that keeps the multi-hot target (the base class makes labels ints)."""

    def __getitem__(self, i: int):
        image, target = self.base[i if self.indices is None else int(self.indices[i])]
        return self.transform(image), target


def multilabel_targets(ds: Dataset) -> Tensor:
    """(N, C) targets of a prepared multi-label split, read without loading images."""
    base = getattr(ds, "base", ds)
    targets = getattr(base, "targets", None)
    if not isinstance(targets, Tensor) or targets.ndim != 2:
        raise ConfigError(f"{type(ds).__name__} holds no multi-hot targets; module.task=multilabel needs "
                          "data=imagefolder with data.labels=<labels file>.csv")
    indices = getattr(ds, "indices", None)
    return targets if indices is None else targets[torch.as_tensor(indices, dtype=torch.long)]


def balanced_pos_weight(targets: Tensor) -> Tensor:
    """(C,) ``negatives / positives`` per class of (N, C) targets (1 for a class without positives):
    BCE's ``pos_weight`` that weighs each class's positives as much as its negatives."""
    pos = targets.sum(0)
    neg = len(targets) - pos
    return torch.where(pos > 0, neg / pos.clamp(min=1), torch.ones_like(pos))
