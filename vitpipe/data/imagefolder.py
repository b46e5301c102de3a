"""The user's own images: ``root/train/<class>/*.jpg`` and optional ``root/val/``, ``root/test/``.

Classes are the visible folders of train/ in sorted order (their count is ``num_classes`` unless
the config gives it); val/ and test/ need the same class folders. Files are listed here, not by
torchvision's ImageFolder, whose ``os.walk(followlinks=True)`` follows a link such as
``train/cat/loop -> ..`` round and round (images of every class filed under cat, many times over).
A directory link is followed once, to a folder outside train/, val/ and test/ (class folders kept
on another disk); any other is refused in one line naming it. Image files are those of
``vitpipe.data.images.is_image_file``, read by ``open_image`` (upright by EXIF orientation, 16-bit
PNGs scaled to 8 bits). Every image is fully decoded before training (cached, so only new files
cost time on the next run): a broken one stops the run in setup() naming the file, or is left out
with a counted warning (``on_bad_image``). Other files are left out with a count.

Splits: without test/, a test split is held out of train/ first (``test_split``, a seeded
permutation as for ``val_split``; one line at the start says how many images); without val/, the
validation split then comes from the rest of train/ (``val_split``). The held-out images are never
trained or validated on, so ``test/*`` metrics are never the validation split's (which chose the best
checkpoint) under another name. ``test_split`` 0 or null (the constructor's default, and what a run
stored before this option holds) with no test/: no test split at all, so no ``test/*`` metrics.

Unlabeled images (``labels="none"``, for MAE pre-training): every image file anywhere under root,
flat or in nested folders of any meaning, one class (label 0, class name ``unlabeled``); the same
file rule, link rules and decode check apply, and the test and validation splits are carved out of
the whole set by ``test_split`` and ``val_split`` (folders named train/, val/ or test/ are just folders).

Multi-label images (``labels="<name>.csv"``): a labels file under root names each image and its
label set (vitpipe.data.multilabel: layouts, the split column, the checks); targets are multi-hot
(C,) floats; splits the file does not give are carved as above; the same decode check applies.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset

from vitpipe.data.base import ClassificationDataModule, DatasetInfo
from vitpipe.data.images import IMAGE_EXTENSIONS, find_bad_images, load_image
from vitpipe.data.multilabel import (
    ON_EMPTY_LABELS,
    LabelsFile,
    MultiLabelImages,
    MultiLabelSubset,
    is_labels_file,
    labels_path,
)
from vitpipe.data.splits import check_val_split, split_indices
from vitpipe.data.walk import SPLITS, LinkSafeWalk
from vitpipe.errors import ConfigError

ON_BAD_IMAGE = ("error", "skip")
LABELS = ("folders", "none")
UNLABELED = "unlabeled"  # the one class name of labels=none


def _class_dirs(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def train_classes(root) -> tuple[str, list[str]]:
    """``root/train`` and its class folders, sorted (ConfigError if it is missing or holds none)."""
    train = os.path.join(str(root), "train")
    if not os.path.isdir(train):
        raise ConfigError(f"imagefolder: {train} does not exist; put one folder of images per class there")
    classes = _class_dirs(train)
    if not classes:
        raise ConfigError(f"imagefolder: {train} holds no class folders; put one folder of images per class there")
    return train, classes


def _check_labels(labels: str) -> str:
    if labels not in LABELS and not is_labels_file(labels):
        raise ConfigError(f"data.labels={labels!r}; valid choices: folders (root/train/<class>/), "
                          "none (every image under root, unlabeled), or a labels file <name>.csv under data.root "
                          "(multi-label: vitpipe/data/multilabel.py)")
    return labels


class FolderImages(Dataset):
    """``(PIL RGB image, label)`` per file; ``samples`` is ``[(path, label)]``, ``targets`` the labels."""

    def __init__(self, samples: list[tuple[str, int]], classes: list[str]) -> None:
        self.samples, self.classes = samples, classes
        self.targets = [label for _, label in samples]

    def subset(self, indices) -> FolderImages:
        return FolderImages([self.samples[int(i)] for i in indices], self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        return load_image(path), label


class ImageFolderDataModule(ClassificationDataModule):
    """Images of any size, resized to the model's ``img_size`` (standard path only).

    num_classes: None (default) counts the class folders of ``root/train``; a number given must
    equal it. on_bad_image: what to do with a file that does not decode (zero bytes, truncated, not
    an image, a link that loops): ``error`` stops in setup() naming the first ones, ``skip`` leaves
    them out with a counted warning (with a labels file also a file it names that is missing).
    labels: ``folders``, ``none`` or a labels file ``<name>.csv`` (multi-label; its layout, splits
    and checks: vitpipe.data.multilabel); on_empty_labels: what a labels-file row without labels
    does: ``keep`` (an all-negative target; counted in a note), ``skip`` (counted) or ``error``.
    test_split: without ``root/test/``, the fraction in [0, 1) or count of train/'s images held out as
    the test split (seeded by ``seed``; conf/data/imagefolder.yaml: 0.1); None or 0: no test split.
    Other keyword args: see ClassificationDataModule. ImageNet statistics by default.
    """

    has_val_split = True  # root/val/, when present

    def __init__(self, *, num_classes: int | None = None, fast_path: bool = False, on_bad_image: str = "error",
                 test_split: float | int | None = None, labels: str = "folders", on_empty_labels: str = "keep",
                 **kwargs):  # fmt: skip
        info = DatasetInfo(
            name="imagefolder", num_classes=None, channels=3, native_size=None,
            mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
        )  # fmt: skip
        if kwargs.get("root") is None:
            raise ConfigError("data.root is required for imagefolder (a directory with train/<class>/ folders)")
        self.labels = _check_labels(labels)
        if labels == "none" and num_classes not in (None, 1):
            raise ConfigError(f"data.num_classes={num_classes} but data.labels=none gives one class (label 0); "
                              "leave data.num_classes out")
        if num_classes is None:
            num_classes = self.num_classes_of(dict(kwargs, labels=labels))
        super().__init__(info=info, num_classes=num_classes, fast_path=fast_path, **kwargs)
        if on_bad_image not in ON_BAD_IMAGE:
            raise ConfigError(f"data.on_bad_image={on_bad_image!r}: expected one of {', '.join(ON_BAD_IMAGE)}")
        self.on_bad_image = on_bad_image
        self.multilabel = is_labels_file(labels)  # batches carry multi-hot (B, C) float targets
        self._labels_file: LabelsFile | None = None
        if on_empty_labels not in ON_EMPTY_LABELS:
            raise ConfigError(f"data.on_empty_labels={on_empty_labels!r}: expected one of {', '.join(ON_EMPTY_LABELS)}")
        self.on_empty_labels = on_empty_labels
        if self.multilabel and (self.naflex is not None or self.sampler != "default"):
            what = "data.naflex.enabled=true" if self.naflex is not None else f"data.sampler={self.sampler}"
            raise ConfigError(f"{what} takes one class per image; data.labels={labels} gives label sets: "
                              f"drop {what.split('=')[0]}")
        self.test_split = None if test_split is None else check_val_split(test_split, "data.test_split")
        self._split_said = False
        self._listings: dict[str, tuple[str, list[tuple[str, int]], list[str]] | None] = {}

    @staticmethod
    def num_classes_of(data) -> int:
        """The class count of a data config whose ``num_classes`` is null: its train/ class folders
        (1 with ``labels: none``)."""
        labels = _check_labels(data.get("labels", "folders"))
        if labels == "none":
            return 1
        if is_labels_file(labels):
            return len(LabelsFile.read(labels_path(data["root"], labels)).class_names)
        return len(train_classes(data["root"])[1])

    def check(self) -> None:
        if self.labels == "none":
            if not os.path.isdir(self.root):
                raise ConfigError(f"imagefolder: {self.root} does not exist; data.labels=none reads every image under it")
            self.class_names = [UNLABELED]
            self._listing("train")  # the directory links, before anything is built
            return
        if self.multilabel:
            self._check_labels_file()
            return
        train, classes = train_classes(self.root)
        if len(classes) != self.num_classes:
            raise ConfigError(
                f"data.num_classes={self.num_classes} but {train} has {len(classes)} class folders; "
                f"set data.num_classes={len(classes)} or leave it out (null: counted from the folders)"
            )
        self.class_names = classes  # sorted folder names
        for split in ("val", "test"):
            path = os.path.join(self.root, split)
            if not os.path.isdir(path):
                continue
            theirs = _class_dirs(path)
            missing, extra = [c for c in classes if c not in theirs], [c for c in theirs if c not in classes]
            if missing or extra:
                lacks = f"lacks class folder(s) {', '.join(missing)}" if missing else ""
                has = f"has class folder(s) {', '.join(extra)} that train/ does not" if extra else ""
                raise ConfigError(
                    f"imagefolder: {path} {' and '.join(w for w in (lacks, has) if w)} ({len(classes)} classes in "
                    f"{train}); give {split}/ the class folders of train/, or remove {split}/"
                    + (" (val_split then takes validation images from train/)" if split == "val" else "")
                )
        for split in SPLITS:  # the files and directory links of every split, before anything is built
            self._listing(split)

    def _check_labels_file(self) -> LabelsFile:
        if self._labels_file is None:
            if not os.path.isdir(self.root):
                raise ConfigError(f"imagefolder: {self.root} does not exist; data.labels names images under it")
            found = LabelsFile.read(labels_path(self.root, self.labels))
            if len(found.class_names) != self.num_classes:
                raise ConfigError(f"data.num_classes={self.num_classes} but {found.file} names {len(found.class_names)} "
                                  f"classes; set data.num_classes={len(found.class_names)} or leave it out")
            self._labels_file = found
            self.class_names = list(found.class_names)
        return self._labels_file

    def prepare_data(self) -> None:
        """Under DDP this runs once before every rank's setup(): they then find the files decoded."""
        super().prepare_data()
        for split in SPLITS:
            self._load(split)

    def _has(self, split: str) -> bool:
        """Whether ``root/<split>/`` (with a labels file: rows of that split) is a split of its own
        (never with labels=none)."""
        if self.multilabel:
            return bool(self._check_labels_file().split_rows(split))
        return self.labels != "none" and os.path.isdir(os.path.join(self.root, split))

    def test_dataloader(self):
        """No test split (no test/, ``test_split`` 0): no loader, so a test loop has nothing to report."""
        ds = self._require(self.data_test, "test")
        return super().test_dataloader() if len(ds) else []

    def _setup_test(self) -> None:
        # the base class tests on the validation split when a data set has none: never here
        test = self._load("test")
        if test is None:
            test = (MultiLabelImages([], torch.zeros(0, self.num_classes), list(self.class_names)) if self.multilabel
                    else FolderImages([], list(self.class_names)))
        self.data_test = self._prepare(test, None, train=False)

    def _prepare(self, ds, indices, *, train: bool):
        if self.multilabel:  # standard path only (images vary in size); targets kept as (C,) floats
            return MultiLabelSubset(ds, indices, self.transform(train))
        return super()._prepare(ds, indices, train=train)

    def _load(self, split: str) -> FolderImages | None:
        """The split's images; without test/, train/ minus the held-out test split, and that split."""
        if split not in ("train", "test") or self._has("test"):
            return self._read(split)
        train = self._read("train")
        kept, held = self._held_out(len(train))
        if split == "test" and not len(held):
            return None
        return train.subset((held if split == "test" else kept).tolist())

    def _held_out(self, n: int):
        """(kept, held-out test) indices into train/'s n images; says once what was held out."""
        if self.test_split:
            kept, held = split_indices(n, self.test_split, self.seed, key="data.test_split")
        else:
            kept, held = torch.arange(n), torch.arange(0)
        if not self._split_said:
            self._split_said = True
            where = f"imagefolder: {self.root} has no test/"
            _note(f"{where}: {len(held)} of the {n} images of train/ are held out as the test split "
                  f"(data.test_split={self.test_split}, data.seed={self.seed}), never trained or validated on"
                  if len(held) else
                  f"{where} and data.test_split={self.test_split or 0} holds out none of its {n} images: no test split, "
                  "so no test/ metrics (add test/ or set data.test_split, e.g. 0.1)")
        return kept, held

    def _listing(self, split: str) -> tuple[str, list[tuple[str, int]], list[str]] | None:
        """``(folder, [(image file, label)], other files)`` of a split's folders (None: no such split),
        listed once per data module: check() lists every split, so a directory link that loops or
        repeats images is refused (ConfigError) before anything is built, and setup() reuses the list."""
        if split in self._listings:
            return self._listings[split]
        if self.labels == "none":  # one set, all of root: "train" is it, the splits are carved from it
            if split != "train":
                return None
            path, folders = self.root, [self.root]
        else:
            path = os.path.join(self.root, split)
            if not os.path.isdir(path):
                return None
            if self.class_names is None:
                self.check()
            folders = [os.path.join(path, name) for name in self.class_names]
        walk = LinkSafeWalk(self.root)
        samples = []
        for label, folder in enumerate(folders):
            files = walk.files(folder)
            if not files:
                raise ConfigError(f"imagefolder: {folder} holds no image files "
                                  f"({', '.join(IMAGE_EXTENSIONS)}); add images or remove the folder")  # fmt: skip
            samples += [(file, label) for file in files]
        self._listings[split] = (path, samples, walk.others)
        return self._listings[split]

    def _read(self, split: str) -> FolderImages | MultiLabelImages | None:
        if self.multilabel:
            return self._read_labels_file(split)
        if self.class_names is None:
            self.check()
        listing = self._listing(split)
        if listing is None:
            return None
        path, samples, others = listing
        if others:
            rank_zero_warn(f"skipped {len(others)} non-image files in {path}, "
                           f"e.g. {os.path.relpath(others[0], path)}")  # fmt: skip
        bad = find_bad_images([file for file, _ in samples], folder=path)
        if not bad:
            return FolderImages(samples, list(self.class_names))
        named = [f"{os.path.relpath(file, path)} ({why})" for file, why in list(bad.items())[:3]]
        if self.on_bad_image == "error":
            raise ConfigError(
                f"{len(bad)} unreadable images in {path}: {', '.join(named)}{', ...' if len(bad) > 3 else ''}; "
                "remove or replace them, or set data.on_bad_image=skip"
            )
        rank_zero_warn(f"skipped {len(bad)} unreadable images in {path}, e.g. {named[0]}")
        return FolderImages([s for s in samples if s[0] not in bad], list(self.class_names))


    def _read_labels_file(self, split: str) -> MultiLabelImages | None:
        """The rows of ``split`` as images with multi-hot targets, after the missing/bad/empty checks."""
        table = self._check_labels_file()
        rows = table.split_rows(split)
        if not rows:
            return None
        rows = self._empty_rows(table, split, rows)
        paths = [os.path.join(self.root, r.path) for r in rows]
        missing = [(r, p) for r, p in zip(rows, paths) if not os.path.isfile(p)]
        if missing:
            named = ", ".join(f"line {r.line} {r.path}" for r, _ in missing[:3]) + (", ..." if len(missing) > 3 else "")
            if self.on_bad_image == "error":
                raise ConfigError(f"{len(missing)} images named in {table.file} ({split}) are missing: {named}; "
                                  "fix the paths (relative to data.root), or set data.on_bad_image=skip")
            rank_zero_warn(f"skipped {len(missing)} missing images named in {table.file} ({split}), e.g. {named}")
        gone = {p for _, p in missing}
        bad = find_bad_images([p for p in paths if p not in gone], folder=self.root)
        if bad:
            named = [f"{os.path.relpath(file, self.root)} ({why})" for file, why in list(bad.items())[:3]]
            if self.on_bad_image == "error":
                raise ConfigError(f"{len(bad)} unreadable images named in {table.file} ({split}): {', '.join(named)}"
                                  f"{', ...' if len(bad) > 3 else ''}; remove or replace them, or set data.on_bad_image=skip")
            rank_zero_warn(f"skipped {len(bad)} unreadable images named in {table.file} ({split}), e.g. {named[0]}")
        keep = [i for i, p in enumerate(paths) if p not in gone and p not in bad]
        kept = [rows[i] for i in keep]
        return MultiLabelImages([paths[i] for i in keep], table.targets(kept), list(table.class_names))

    def _empty_rows(self, table: LabelsFile, split: str, rows: list) -> list:
        """``rows`` after data.on_empty_labels has dealt with those that name no label."""
        empty = [r for r in rows if not r.labels]
        if not empty:
            return rows
        named = ", ".join(f"line {r.line} {r.path}" for r in empty[:3]) + (", ..." if len(empty) > 3 else "")
        if self.on_empty_labels == "error":
            raise ConfigError(f"{len(empty)} rows of {table.file} ({split}) name no label: {named}; label them, or set "
                              "data.on_empty_labels=keep (all-negative targets) or skip")
        if self.on_empty_labels == "skip":
            rank_zero_warn(f"skipped {len(empty)} rows of {table.file} ({split}) without labels, e.g. {named}")
            return [r for r in rows if r.labels]
        _note(f"{len(empty)} of the {len(rows)} {split} images in {table.file} have no label: all-negative targets "
              "(data.on_empty_labels=keep; skip or error to change)")
        return rows


@rank_zero_only
def _note(line: str) -> None:
    print(f"vitpipe: note: {line}", file=sys.stderr, flush=True)
