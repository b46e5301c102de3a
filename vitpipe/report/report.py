"""``write_report(run_dir, ...)``: the ``report/`` folder of a run, drawn from its files alone.

Inputs are ``<run dir>/predictions.csv`` and ``<run dir>/history.csv`` (when the run trained);
outputs, in ``<run dir>/report/``: per_class.csv, confusion_matrix.csv, confusion_matrix.png,
calibration.png, curves.png, errors.png and report.md, which shows them with relative links, so
the folder reads on its own (GitHub, an editor preview, a notebook).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from vitpipe.report.attention_health import attention_health_figures
from vitpipe.report.calibration import N_BINS, expected_calibration_error, reliability_bins
from vitpipe.report.figures import (
    calibration_figure,
    confusion_figure,
    curves_figure,
    errors_figure,
    save_figure,
)
from vitpipe.report.history import HISTORY_FILE, read_history
from vitpipe.report.markdown import escape
from vitpipe.report.per_class import (
    confusion_counts,
    per_class_metrics,
    row_normalise,
    write_confusion,
    write_per_class,
)
from vitpipe.report.predictions import PREDICTIONS_FILE, read_predictions
from vitpipe.run.files import atomic_write_text

REPORT_DIR = "report"
NUM_ERRORS = 16
MD_CLASS_ROWS = 20  # report.md lists the classes with the lowest recall; per_class.csv has all


def write_report(run_dir: Path, class_names: list[str] | None = None, *, num_classes: int | None = None,
                 image: Callable[[int], np.ndarray | None] | None = None, metrics: dict[str, float] | None = None,
                 split: str = "test", title: str = "") -> dict[str, Path]:
    """Write ``<run_dir>/report/`` from ``<run_dir>/predictions.csv`` (and history.csv).

    class_names: one per class (default ``0..C-1`` with C = num_classes or the largest label + 1);
    image(index) -> the stored image of that test sample, for errors.png (None: panels empty);
    metrics: the run's logged metrics (e.g. ``test/acc``), shown beside the recomputed ones.
    Returns {figure name: PNG path}.
    """
    run_dir = Path(run_dir)
    out = run_dir / REPORT_DIR
    preds = read_predictions(run_dir / PREDICTIONS_FILE)
    c = len(class_names) if class_names else num_classes
    if c is None:
        c = int(max(preds.target.max(), preds.pred.max())) + 1 if len(preds.index) else 1
    names = [str(n) for n in class_names] if class_names else [str(i) for i in range(c)]

    per_class = per_class_metrics(preds.target, preds.pred, c)
    write_per_class(out / "per_class.csv", per_class, names)
    counts = confusion_counts(preds.target, preds.pred, c)
    write_confusion(out / "confusion_matrix.csv", counts, names)
    ece = expected_calibration_error(preds.prob, preds.correct, N_BINS)

    figures = {"confusion_matrix": confusion_figure(row_normalise(counts), names),
               "calibration": calibration_figure(reliability_bins(preds.prob, preds.correct, N_BINS), ece,
                                                 subtitle=title)}
    history = read_history(run_dir / HISTORY_FILE)
    if history:
        figures["curves"] = curves_figure(history)
    figures.update(attention_health_figures(run_dir))  # the run's attention_health.csv, when it has one
    wrong = (~preds.correct).nonzero()[:, 0]
    worst = wrong[preds.prob[wrong].argsort(descending=True)][:NUM_ERRORS].tolist()
    items = [{"index": int(preds.index[k]), "target_name": names[int(preds.target[k])],
              "pred_name": names[int(preds.pred[k])], "prob": float(preds.prob[k]),
              "prob_target": float(preds.prob_target[k])} for k in worst]
    figures["errors"] = errors_figure(items, image or (lambda i: None))
    paths = {name: save_figure(fig, out / f"{name}.png") for name, fig in figures.items()}

    summary = {
        "images": len(preds.index),
        "accuracy": preds.accuracy(),
        "balanced accuracy (mean recall)": float(per_class["recall"][per_class["support"] > 0].mean())
        if len(preds.index) else 0.0,
        "macro F1": float(per_class["f1"].mean()),
        f"ECE ({N_BINS} bins)": ece,
    }
    atomic_write_text(out / "report.md", _markdown(run_dir, split, title, summary, metrics or {}, per_class,
                                                   names, paths, history_present=bool(history)))
    return paths


def _markdown(run_dir, split, title, summary, metrics, per_class, names, paths, *, history_present) -> str:
    lines = [f"# Evaluation report: {split} split", ""]
    if title:
        lines += [title, ""]
    lines += [f"Run directory `{run_dir.name}`. Every number and picture here is recomputed from "
              f"[predictions.csv](../{PREDICTIONS_FILE})"
              + (f" and [history.csv](../{HISTORY_FILE})" if history_present else "") + ".", "",
              "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" if isinstance(v, int) else f"| {k} | {v:.4f} |" for k, v in summary.items()]
    lines += [f"| {k} (logged) | {v:.4f} |" for k, v in sorted(metrics.items())]
    if "curves" in paths:
        lines += ["", "## Training curves", "", "![training curves](curves.png)"]
    if "attention_health" in paths:
        lines += ["", "## Attention health", "", "Entropy and largest logit of each layer's attention on fixed "
                  "training images, from [attention_health.csv](../attention_health.csv) (vitpipe's "
                  "docs/attention-health.md).", "", "![attention entropy and logits](attention_health.png)"]
    lines += ["", "## Confusion matrix", "", "Rows: true class, normalised to 1 (the diagonal is each class's "
              "recall). Counts: [confusion_matrix.csv](confusion_matrix.csv).", "",
              "![confusion matrix](confusion_matrix.png)", "",
              "## Per-class metrics (lowest recall first; all classes: [per_class.csv](per_class.csv))", "",
              "| class | precision | recall | F1 | support |", "|---|---|---|---|---|"]
    support = per_class["support"]
    order = sorted(range(len(names)), key=lambda i: (float(per_class["recall"][i]), -int(support[i])))
    order = [i for i in order if support[i] > 0][:MD_CLASS_ROWS]
    lines += [f"| {escape(names[i])} | {float(per_class['precision'][i]):.3f} | "  # a name stays one cell
              f"{float(per_class['recall'][i]):.3f} | {float(per_class['f1'][i]):.3f} | {int(support[i])} |"
              for i in order]
    lines += ["", "## Calibration", "", "Top-1 confidence against accuracy in 15 equal-width bins; the expected "
              "calibration error (ECE) is the count-weighted mean gap.", "", "![reliability diagram](calibration.png)",
              "", "## Most confident mistakes", "", "![most confident mistakes](errors.png)", ""]
    return "\n".join(lines)
