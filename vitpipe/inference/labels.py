"""What a classifier's probabilities are answered as: class names (and a class named by name or index),
the top-k ranking, and for a multi-label checkpoint the label set (every class whose sigmoid score is >=
its threshold) and the thresholds it is cut at. Predict's rows, serve's bodies and the demo's panels are built from these.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

from vitpipe.errors import ConfigError


def label_names(class_names, num_classes: int) -> list[str]:
    """The checkpoint's class names, or the indices as strings (with a one-line note) when it has none."""
    if class_names and len(class_names) == num_classes:
        return [str(n) for n in class_names]
    why = "stores no class names" if not class_names else f"stores {len(class_names)} class names for {num_classes} classes"
    print(f"vitpipe: note: the checkpoint {why}; labels are class indices", file=sys.stderr)
    return [str(i) for i in range(num_classes)]


def class_index(target, names, num_classes: int) -> int | None:
    """``target=`` as a class index: None stays None (the predicted class); a class name or an index in range."""
    if target is None:
        return None
    if isinstance(target, str) and names and target in [str(n) for n in names]:
        return [str(n) for n in names].index(target)
    if isinstance(target, str) and target.isdigit():
        target = int(target)
    if isinstance(target, int) and 0 <= target < num_classes:
        return target
    shown = ", ".join(map(str, (names or [])[:10])) + (", ..." if names and len(names) > 10 else "")
    raise ConfigError(f"target={target!r} is not a class of this checkpoint; use a class index 0..{num_classes - 1}"
                      + (f" or a name ({shown})" if names else ""))


def top_labels(probs: Tensor, names: list[str], topk: int) -> list[dict]:
    """``{"labels": [...], "probs": [...]}`` per row of probabilities (B, classes), most probable first:
    the ranking predict's rows write."""
    values, idx = probs.topk(min(topk, probs.shape[1]), dim=1)  # (B, k) each
    return [{"labels": [names[c] for c in i], "probs": v} for v, i in zip(values.tolist(), idx.tolist())]


def label_sets(scores: Tensor, names: list[str], thresholds: Tensor, topk: int) -> list[dict]:
    """Multi-label answers per row of sigmoid scores (B, classes): ``labels`` every class whose score is
    >= its threshold (``thresholds`` (classes,)), most probable first, ``probs`` their scores, ``topk``
    ``{"labels", "probs"}`` of the k highest scores whatever the thresholds. Predict's rows and serve's bodies."""
    above = scores.double() >= thresholds.double()  # (B, classes)
    out = []
    for row, keep, top in zip(scores.tolist(), above.tolist(), top_labels(scores, names, topk)):
        chosen = sorted((c for c, k in enumerate(keep) if k), key=lambda c: -row[c])
        out.append({"labels": [names[c] for c in chosen], "probs": [row[c] for c in chosen], "topk": top})
    return out


def class_thresholds(path: Path, checkpoint: dict, built, threshold: float | None) -> Tensor:
    """(classes,) thresholds of a multi-label checkpoint: ``threshold`` for all, else its thresholds.json
    (fitted on this checkpoint), else ``module.threshold``; one line on stderr says which file was used or passed over."""
    from vitpipe.report.multilabel import find_thresholds

    c = int(built.net.num_classes)
    if threshold is not None:
        return torch.full((c,), float(threshold), dtype=torch.float64)
    tuned, line = find_thresholds(path, checkpoint, label_names(built.class_names, c))
    if line:
        print(f"vitpipe: note: {line}", file=sys.stderr, flush=True)
    if tuned is not None:
        return tuned
    return torch.full((c,), float(built.module.hparams.get("threshold", 0.5)), dtype=torch.float64)
