"""Multi-label evaluation files: ``predictions.csv`` (one sigmoid score per class and the true label set
per image), its per-class report, and per-class thresholds tuned on a split (``thresholds.json``).

predictions.csv columns: ``index``, ``path`` (when the data has files), ``labels`` (the true label set,
names joined by ``;``), ``predicted`` (the classes with score >= threshold, joined by ``;``), then per
class ``score:<name>`` (sigmoid, every digit of the float64) and ``true:<name>`` (0/1, the unambiguous form of ``labels``).
Every multi-label score the module logs (mAP, per-class AP, F1) can be recomputed from this file alone.

thresholds.json (beside the checkpoint, like calibration.json): ``{"thresholds": {class: t}, the
checkpoint's identity (vitpipe.report.calibration.checkpoint_identity), "fitted_on": split, "f1": {class:
F1 at t}}``; each t maximises that class's F1 on the split it was fitted on. predict and serve apply it
to the checkpoint it names only.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vitpipe.run.files import atomic_write_text

THRESHOLDS_FILE = "thresholds.json"


def is_multilabel(stored: dict | None) -> bool:
    """Whether a checkpoint's stored run config (``checkpoint["vitpipe_config"]``) trained ``module.task=multilabel``."""
    module = (stored or {}).get("module") if isinstance(stored, dict) else None
    return isinstance(module, dict) and module.get("task") == "multilabel"


@dataclass
class MultilabelPredictions:
    """Scores on N images sorted by ``index``: ``scores`` (N, C) sigmoid, ``target`` (N, C) 0/1."""

    index: Tensor  # (N,) int64
    target: Tensor  # (N, C) int64 multi-hot
    scores: Tensor  # (N, C) float64 sigmoid of the logits
    paths: list[str] | None = None
    threshold: float = 0.5

    @classmethod
    def from_logits(cls, index: Tensor, logits: Tensor, target: Tensor, paths=None, threshold: float = 0.5):
        order = index.argsort()
        return cls(index[order], target[order].round().long(), logits[order].double().sigmoid(),
                   [paths[i] for i in order.tolist()] if paths else None, threshold)

    def to_csv(self, class_names: list[str]) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["index"] + (["path"] if self.paths else []) + ["labels", "predicted"]
                   + [f"score:{n}" for n in class_names] + [f"true:{n}" for n in class_names])
        pred = self.scores >= self.threshold
        for k in range(len(self.index)):
            true = self.target[k].tolist()
            w.writerow([int(self.index[k])] + ([self.paths[k]] if self.paths else [])
                       + [";".join(n for n, t in zip(class_names, true) if t),
                          ";".join(n for n, p in zip(class_names, pred[k].tolist()) if p)]
                       + [repr(s) for s in self.scores[k].tolist()] + [int(t) for t in true])
        return buf.getvalue()

    def write(self, path: Path, class_names: list[str]) -> Path:
        atomic_write_text(Path(path), self.to_csv(class_names))
        return Path(path)


def read_multilabel_predictions(path: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """predictions.csv -> (class names, scores (N, C) float64, targets (N, C) int)."""
    with Path(path).open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        rows = list(reader)
    score_cols = [i for i, h in enumerate(header) if h.startswith("score:")]
    true_cols = [i for i, h in enumerate(header) if h.startswith("true:")]
    names = [header[i].removeprefix("score:") for i in score_cols]
    scores = np.array([[float(r[i]) for i in score_cols] for r in rows], dtype=np.float64).reshape(len(rows), -1)
    target = np.array([[int(r[i]) for i in true_cols] for r in rows], dtype=np.int64).reshape(len(rows), -1)
    return names, scores, target


def is_multilabel_file(path: Path) -> bool:
    with Path(path).open(newline="") as f:
        return any(h.startswith("score:") for h in next(csv.reader(f), []))


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


def write_multilabel_report(run_dir: Path, *, threshold: float, metrics: dict[str, float] | None = None,
                            split: str = "test") -> Path:
    """``<run_dir>/report/report.md`` and ``per_class.csv`` from ``<run_dir>/predictions.csv`` alone:
    mAP (macro, micro) recomputed, the logged metrics beside them, a per-class AP / F1 table (lowest AP first)."""
    from sklearn.metrics import average_precision_score

    from vitpipe.report.markdown import escape
    from vitpipe.report.predictions import PREDICTIONS_FILE

    run_dir = Path(run_dir)
    names, scores, target = read_multilabel_predictions(run_dir / PREDICTIONS_FILE)
    per = per_class_scores(scores, target, threshold)
    out = run_dir / "report"
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["class", "ap", "f1", "precision", "recall", "support"])
    for k, n in enumerate(names):
        w.writerow([n] + [f"{float(per[m][k]):.6g}" for m in ("ap", "f1", "precision", "recall")] + [int(per["support"][k])])
    atomic_write_text(out / "per_class.csv", buf.getvalue())
    valid = ~np.isnan(per["ap"])
    lines = [f"# Evaluation report: {split} split (multi-label)", "",
             f"Run directory `{run_dir.name}`. Recomputed from [predictions.csv](../{PREDICTIONS_FILE}); "
             f"F1, precision and recall at sigmoid >= {threshold:g}.", "", "| metric | value |", "|---|---|",
             f"| images | {len(target)} |",
             f"| mAP (macro) | {float(per['ap'][valid].mean()) if valid.any() else math.nan:.4f} |",
             f"| mAP (micro) | {float(average_precision_score(target.ravel(), scores.ravel())) if len(target) else math.nan:.4f} |"]
    lines += [f"| {k} (logged) | {v:.4f} |" for k, v in sorted((metrics or {}).items())]
    lines += ["", "## Per-class AP (lowest first; all columns: [per_class.csv](per_class.csv))", "",
              "| class | AP | F1 | precision | recall | support |", "|---|---|---|---|---|---|"]
    order = sorted(range(len(names)), key=lambda k: (-math.inf if math.isnan(per["ap"][k]) else per["ap"][k]))
    lines += [f"| {escape(names[k])} | {per['ap'][k]:.3f} | {per['f1'][k]:.3f} | {per['precision'][k]:.3f} | "
              f"{per['recall'][k]:.3f} | {int(per['support'][k])} |" for k in order]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return out / "report.md"


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
        record = json.loads(path.read_text())
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
