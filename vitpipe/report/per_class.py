"""Per-class precision, recall, F1 and support, and the confusion matrix, from (target, pred) pairs.

torchmetrics computes them (``average=None``: one value per class); a class that is never
predicted has precision 0, one that never occurs has recall 0 and support 0.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from torchmetrics.functional.classification import (
    multiclass_confusion_matrix,
    multiclass_f1_score,
    multiclass_precision,
    multiclass_recall,
)

from vitpipe.run.csvfiles import write_csv


def per_class_metrics(target: Tensor, pred: Tensor, num_classes: int) -> dict[str, Tensor]:
    """{"precision", "recall", "f1": (C,) float, "support": (C,) int64} for labels in [0, C)."""
    kw = {"num_classes": num_classes, "average": None}
    return {
        "precision": multiclass_precision(pred, target, **kw),
        "recall": multiclass_recall(pred, target, **kw),
        "f1": multiclass_f1_score(pred, target, **kw),
        "support": torch.bincount(target, minlength=num_classes),
    }


def confusion_counts(target: Tensor, pred: Tensor, num_classes: int) -> Tensor:
    """(C, C) int64: row = true class, column = predicted class."""
    return multiclass_confusion_matrix(pred, target, num_classes=num_classes).long()


def row_normalise(counts: Tensor) -> Tensor:
    """Each row divided by its sum (the per-class recall on the diagonal); empty rows stay 0."""
    counts = counts.double()
    return counts / counts.sum(1, keepdim=True).clamp(min=1)


def write_per_class(path: Path, metrics: dict[str, Tensor], class_names: list[str]) -> Path:
    rows = ([c, name, *(f"{float(metrics[k][c]):.6g}" for k in ("precision", "recall", "f1")), int(metrics["support"][c])]
            for c, name in enumerate(class_names))
    return write_csv(path, rows, ["class", "name", "precision", "recall", "f1", "support"])


def write_confusion(path: Path, counts: Tensor, class_names: list[str]) -> Path:
    """Counts as CSV: header ``true\\pred, <names>``, one row per true class."""
    return write_csv(path, ([name, *row] for name, row in zip(class_names, counts.tolist())), ["true\\pred", *class_names])
