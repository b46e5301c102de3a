"""Multi-label evaluation files: ``predictions.csv`` (one sigmoid score per class and the true label set
per image), its per-class report, and per-class thresholds tuned on a split (``thresholds.json``).

predictions.csv (written and read by vitpipe.report.predictions, beside the multi-class rows) columns:
``index``, ``path`` (when the data has files), ``labels`` (the true label set, names joined by ``;``),
``predicted`` (the classes with score >= threshold, joined by ``;``), then per class
``score:<name>`` (sigmoid, every digit of the float64) and ``true:<name>`` (0/1, the unambiguous form of ``labels``).
Every multi-label score the module logs (mAP, per-class AP, F1) can be recomputed from this file alone.

report/ (``write_multilabel_report``, from predictions.csv alone): report.md, per_class.csv, pr_curves.png
(``pr_curves``), co_occurrence.csv / .png (``co_occurrence`` of the true and the predicted label sets) and
label_errors.png (``confident_label_errors``: the highest-scoring absent and lowest-scoring present labels).

thresholds.json (beside the checkpoint, like calibration.json): ``{"thresholds": {class: t}, the
checkpoint's identity (vitpipe.report.calibration.checkpoint_identity), "fitted_on": split, "f1": {class:
F1 at t}}``; each t maximises that class's F1 on the split it was fitted on. predict and serve apply it
to the checkpoint it names only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vitpipe.report.predictions import PREDICTIONS_FILE, read_multilabel_predictions
from vitpipe.run.csvfiles import csv_text, read_csv, read_csv_dicts, write_csv
from vitpipe.run.files import atomic_write_text
from vitpipe.run.jsonfiles import read_json

THRESHOLDS_FILE = "thresholds.json"


# --------------------------------------------------------------------------- per-class report


def per_class_scores(scores: np.ndarray, target: np.ndarray, thresholds) -> dict[str, np.ndarray]:
    """Per class: ``ap`` (sklearn's average precision; NaN without positives), ``f1``, ``precision``,
    ``recall`` at ``thresholds`` (a float or (C,)), ``support`` (positives)."""
    from sklearn.metrics import average_precision_score, f1_score, precision_score, recall_score

    pred = (scores >= np.asarray(thresholds, dtype=np.float64)).astype(int)
    c = target.shape[1]
    ap = np.array([average_precision_score(target[:, k], scores[:, k]) if target[:, k].any() else math.nan
                   for k in range(c)])
    at = dict(average=None, zero_division=0, labels=list(range(c)))
    return {"ap": ap, "f1": f1_score(target, pred, **at), "precision": precision_score(target, pred, **at),
            "recall": recall_score(target, pred, **at), "support": target.sum(0)}


PR_CLASSES = 5  # the PR figure shows every class up to 2 x this many, else the k lowest and k highest AP
NUM_LABEL_ERRORS = 8  # tiles per gallery row kind: confident false positives, confident missed labels


def operating_point(predicted: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """(recall, precision) of the boolean ``predicted`` against 0/1 ``target`` (same shape), counted over
    every entry; precision 1 when nothing is predicted (the end point of sklearn's PR curve)."""
    tp = int((predicted & (target == 1)).sum())
    n_pred, positives = int(predicted.sum()), int((target == 1).sum())
    return (tp / positives if positives else 0.0), (tp / n_pred if n_pred else 1.0)


def pr_curves(scores: np.ndarray, target: np.ndarray, thresholds, names: list[str],
              k: int = PR_CLASSES) -> list[dict]:
    """The curves of the PR figure: per class with positives (all when at most 2k, else the k lowest and k
    highest AP, lowest first), then the micro average over every (image, class) pair. Each curve:
    ``name``, ``class`` (index; None for micro), ``precision``/``recall`` (sklearn's precision_recall_curve),
    ``ap`` (average_precision_score), ``point`` (recall, precision) of ``score >= thresholds`` (a float or (C,))."""
    from sklearn.metrics import average_precision_score, precision_recall_curve

    t = np.broadcast_to(np.asarray(thresholds, dtype=np.float64), (scores.shape[1],))
    pred = scores >= t  # (N, C)
    with_pos = [c for c in range(scores.shape[1]) if target[:, c].any()]
    ap = {c: float(average_precision_score(target[:, c], scores[:, c])) for c in with_pos}
    order = sorted(with_pos, key=lambda c: (ap[c], c))
    shown = order if len(order) <= 2 * k else order[:k] + order[-k:]
    curves = []
    for c in shown:
        p, r, _ = precision_recall_curve(target[:, c], scores[:, c])
        curves.append({"name": names[c], "class": c, "precision": p, "recall": r, "ap": ap[c],
                       "point": operating_point(pred[:, c], target[:, c])})
    if target.any():
        p, r, _ = precision_recall_curve(target.ravel(), scores.ravel())
        curves.append({"name": "micro average", "class": None, "precision": p, "recall": r,
                       "ap": float(average_precision_score(target.ravel(), scores.ravel())),
                       "point": operating_point(pred, target)})
    return curves


def co_occurrence(multi_hot: np.ndarray) -> np.ndarray:
    """(C, C) counts of images holding both classes (``M.T @ M``); the diagonal is each class's count."""
    m = np.asarray(multi_hot, dtype=np.int64)
    return m.T @ m


def co_occurrence_csv(true: np.ndarray, pred: np.ndarray, names: list[str]) -> str:
    """Both matrices in one table: ``matrix`` (true | predicted), ``class`` (row), one column per class."""
    return csv_text(([kind, n] + [int(v) for v in row] for kind, m in (("true", true), ("predicted", pred))
                     for n, row in zip(names, m.tolist())), ["matrix", "class"] + list(names))


def read_co_occurrence(path: Path) -> dict[str, np.ndarray]:
    """co_occurrence.csv -> {"true": (C, C), "predicted": (C, C)} int64."""
    rows = read_csv(path)[1:]
    return {kind: np.array([[int(v) for v in r[2:]] for r in rows if r[0] == kind], dtype=np.int64)
            for kind in ("true", "predicted")}


def confident_label_errors(scores: np.ndarray, target: np.ndarray, n: int = NUM_LABEL_ERRORS
                           ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(row, class) pairs: the n highest scores among absent labels (target 0: false positives, most
    confident first) and the n lowest among present ones (target 1: missed labels, most confident miss
    first). Equal scores go by row, then class, ascending."""
    rows, cols = np.indices(scores.shape)
    rows, cols, s, t = rows.ravel(), cols.ravel(), scores.ravel(), target.ravel()

    def pick(mask: np.ndarray, key: np.ndarray) -> list[tuple[int, int]]:
        r, c, k = rows[mask], cols[mask], key[mask]
        order = np.lexsort((c, r, k))[:n]  # last key is primary
        return [(int(r[i]), int(c[i])) for i in order]

    return pick(t == 0, -s), pick(t == 1, s)


def _image_or_none(image, index: int) -> np.ndarray | None:
    try:
        return image(index)
    except (OSError, ValueError):  # a file gone or unreadable since eval: no tile image
        return None


def write_multilabel_report(run_dir: Path, *, threshold, metrics: dict[str, float] | None = None,
                            split: str = "test", image=None, num_errors: int = NUM_LABEL_ERRORS,
                            pr_classes: int = PR_CLASSES, threshold_source: str | None = None) -> dict[str, Path]:
    """``<run_dir>/report/`` from ``<run_dir>/predictions.csv`` alone: report.md, per_class.csv and
    co_occurrence.csv, pr_curves.png, co_occurrence.png and, when ``image`` (index -> uint8 (H, W[, 3])
    or None) gives the images, label_errors.png. report.md shows mAP (macro, micro) recomputed, the logged
    metrics beside them, a per-class AP / F1 table (lowest AP first) and the figures.

    threshold: a float, or (C,) per-class thresholds, at which F1, the operating points and the predicted
    co-occurrence are taken; threshold_source: where per-class ones came from (shown in report.md).
    Returns {figure name: PNG path}."""
    from vitpipe.report.figures import co_occurrence_figure, label_errors_figure, pr_figure, save_figure
    from vitpipe.report.markdown import escape

    run_dir = Path(run_dir)
    names, scores, target = read_multilabel_predictions(run_dir / PREDICTIONS_FILE)
    t = np.broadcast_to(np.asarray(threshold, dtype=np.float64), (len(names),))
    per_class = len(set(t.tolist())) > 1
    per = per_class_scores(scores, target, t)
    out = run_dir / "report"
    write_csv(out / "per_class.csv", ([n] + [f"{float(per[m][k]):.6g}" for m in ("ap", "f1", "precision", "recall")]
                                      + [int(per["support"][k])] for k, n in enumerate(names)),
              ["class", "ap", "f1", "precision", "recall", "support"])
    pred = (scores >= t).astype(np.int64)
    true_co, pred_co = co_occurrence(target), co_occurrence(pred)
    atomic_write_text(out / "co_occurrence.csv", co_occurrence_csv(true_co, pred_co, names))

    at = ("per-class thresholds" + (f" ({threshold_source})" if threshold_source else "") if per_class
          else f"sigmoid >= {float(t[0]) if len(t) else 0.5:g}")
    figures = {"pr_curves": pr_figure(pr_curves(scores, target, t, names, pr_classes), at=at),
               "co_occurrence": co_occurrence_figure(true_co, pred_co, names, at=at)}
    false_pos, missed = confident_label_errors(scores, target, num_errors)
    gallery_note = None
    if image is None:
        gallery_note = "the evaluated data keeps no images to show (no image files)"
    else:
        index = _read_index(run_dir / PREDICTIONS_FILE)  # row -> index in the evaluated data set
        pixels = {r: _image_or_none(image, index[r]) for r in sorted({r for r, _ in false_pos + missed})}
        if pixels and all(p is None for p in pixels.values()):
            gallery_note = "the evaluated images could not be read"
    if gallery_note is None:

        def tile(r: int, c: int) -> dict:
            return {"row": r, "index": index[r], "class_name": names[c], "score": float(scores[r, c]),
                    "labels": [n for n, v in zip(names, target[r]) if v]}

        figures["label_errors"] = label_errors_figure([tile(*p) for p in false_pos], [tile(*p) for p in missed],
                                                      lambda r: pixels.get(r))
    else:
        (out / "label_errors.png").unlink(missing_ok=True)  # an earlier report's gallery would be taken for this one's
    paths = {name: save_figure(fig, out / f"{name}.png") for name, fig in figures.items()}

    valid = ~np.isnan(per["ap"])
    lines = [f"# Evaluation report: {split} split (multi-label)", "",
             f"Run directory `{run_dir.name}`. Recomputed from [predictions.csv](../{PREDICTIONS_FILE}); "
             f"F1, precision and recall at {at}.", "", "| metric | value |", "|---|---|",
             f"| images | {len(target)} |",
             f"| mAP (macro) | {float(per['ap'][valid].mean()) if valid.any() else math.nan:.4f} |",
             f"| mAP (micro) | {_micro_ap(target, scores):.4f} |"]
    lines += [f"| {k} (logged) | {v:.4f} |" for k, v in sorted((metrics or {}).items())]
    lines += ["", "## Per-class AP (lowest first; all columns: [per_class.csv](per_class.csv))", "",
              "| class | AP | F1 | precision | recall | support |", "|---|---|---|---|---|---|"]
    order = sorted(range(len(names)), key=lambda k: (-math.inf if math.isnan(per["ap"][k]) else per["ap"][k]))
    lines += [f"| {escape(names[k])} | {per['ap'][k]:.3f} | {per['f1'][k]:.3f} | {per['precision'][k]:.3f} | "
              f"{per['recall'][k]:.3f} | {int(per['support'][k])} |" for k in order]
    shown = (f"the {pr_classes} lowest and {pr_classes} highest AP classes" if int(valid.sum()) > 2 * pr_classes
             else "every class with positives")
    lines += ["", "## Precision-recall curves", "",
              f"Per class ({shown}) and the micro average over every (image, class) pair, AP in the legend; "
              f"the dot on each curve is its operating point at {at}.", "",
              "![precision-recall curves](pr_curves.png)", "",
              "## Label co-occurrence", "",
              "Images holding both labels: true label sets (left; the diagonal is each class's support) and "
              f"predicted ones at {at} (right). Counts: [co_occurrence.csv](co_occurrence.csv).", "",
              "![label co-occurrence](co_occurrence.png)", "",
              "## Most confident label errors", ""]
    if gallery_note is None:
        lines += [f"Top: the {len(false_pos)} highest scores among absent labels (false positives); bottom: the "
                  f"{len(missed)} lowest among present labels (missed labels). Each tile: the class, its score "
                  "and the image's true label set.", "", "![most confident label errors](label_errors.png)"]
    else:
        lines += [f"Gallery skipped: {gallery_note}."]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return paths


def _read_index(path: Path) -> list[int]:
    """predictions.csv's ``index`` column: each row's index in the evaluated data set."""
    return [int(r["index"]) for r in read_csv_dicts(path)]


# --------------------------------------------------------------------------- thresholds


def best_f1_thresholds(scores: np.ndarray, target: np.ndarray, default: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Per class the threshold t maximising F1 of ``score >= t`` on these images, and that F1.

    F1 only changes at the class's own scores, so those are the candidates (ties go to the highest); the
    threshold returned is midway between the best score and the next lower one (half the best when
    none is lower): the same F1 on these images, and a score recomputed in another batch or precision
    does not flip across it. A class without positives keeps ``default`` (its F1 is 0 whatever t)."""
    from sklearn.metrics import precision_recall_curve

    c = target.shape[1]
    thresholds, f1s = np.full(c, default, dtype=np.float64), np.zeros(c)
    for k in range(c):
        if not target[:, k].any():
            continue
        p, r, t = precision_recall_curve(target[:, k], scores[:, k])  # t ascending; p, r have one more entry
        f1 = np.where(p[:-1] + r[:-1] > 0, 2 * p[:-1] * r[:-1] / np.maximum(p[:-1] + r[:-1], 1e-300), 0.0)
        best = len(f1) - 1 - int(np.argmax(f1[::-1]))  # the highest threshold among the best
        below = scores[:, k][scores[:, k] < t[best]]
        thresholds[k] = float((t[best] + below.max()) / 2 if len(below) else t[best] / 2)
        f1s[k] = float(f1[best])
    return thresholds, f1s


def write_thresholds(directory: Path, names: list[str], thresholds, f1, *, identity: dict, fitted_on: str) -> Path:
    """``<directory>/thresholds.json`` (atomically): per-class thresholds, the checkpoint they belong to."""
    record = {"thresholds": {n: float(t) for n, t in zip(names, thresholds)}, "f1": {n: float(v) for n, v in zip(names, f1)},
              **identity, "fitted_on": fitted_on}
    path = Path(directory) / THRESHOLDS_FILE
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    return path


def _micro_ap(target: np.ndarray, scores: np.ndarray) -> float:
    from sklearn.metrics import average_precision_score

    return float(average_precision_score(target.ravel(), scores.ravel())) if len(target) else math.nan


def find_thresholds(ckpt_path: Path, checkpoint: dict, names: list[str]) -> tuple[Tensor | None, str | None]:
    """The (C,) thresholds of a thresholds.json beside the checkpoint fitted on exactly this checkpoint
    and these classes, and a line saying where they came from or why they were passed over; (None, None)
    when there is no file."""
    from vitpipe.errors import ConfigError
    from vitpipe.report.calibration import checkpoint_identity

    path = Path(ckpt_path).parent / THRESHOLDS_FILE
    if not path.is_file():
        return None, None
    try:
        record = read_json(path)  # bounded: a file nested 1,000 deep is one line, not a RecursionError
        table = record["thresholds"]
        values = [float(table[n]) for n in names]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read {path} ({type(e).__name__}: {e}); it needs a threshold per class "
                          f"({', '.join(names[:3])}...); fix or remove it") from None
    if not all(0.0 <= v <= 1.0 and math.isfinite(v) for v in values):
        raise ConfigError(f"{path}: thresholds must be probabilities in [0, 1]; fix or remove it")
    identity = checkpoint_identity(ckpt_path, checkpoint)
    mine = {k: record.get(k) for k in identity}
    if mine != identity:
        return None, f"{path} is not applied: it was fitted on {mine}, not {identity}"
    return torch.tensor(values, dtype=torch.float64), f"per-class thresholds from {path}"
