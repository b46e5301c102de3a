"""The report's figures, each drawn only from numbers that are saved beside it.

``matplotlib.figure.Figure`` objects through Agg (no pyplot, nothing global switched; see
vitpipe.viz.overlay). Every figure has a fixed size in inches at ``DPI``, so its pixel size is
known in advance (``*_size`` functions; the tests check the PNGs against them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from matplotlib.figure import Figure
from torch import Tensor

from vitpipe.run.files import save_figure  # noqa: F401 (the report writes its figures through it)

DPI = 100  # save_figure's default dpi: the PNGs are *_size x DPI pixels
CELL_NUMBERS_UP_TO = 20  # classes; beyond, per-cell numbers would be unreadable


def confusion_size(num_classes: int) -> tuple[float, float]:
    """Inches: grows with the class count so 100 names stay legible (6 pt), capped at 20."""
    side = min(20.0, max(6.0, 2.5 + 0.18 * num_classes))
    return side + 1.0, side  # + colour bar


def confusion_figure(norm: Tensor, class_names: Sequence[str]) -> Figure:
    """Row-normalised confusion matrix (C, C) (rows: true class, columns: prediction)."""
    c = norm.shape[0]
    fig = Figure(figsize=confusion_size(c), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(norm.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.04, label="fraction of the true class")
    names = [_short(n) for n in class_names]
    fontsize = 9 if c <= 20 else 7 if c <= 50 else 6
    step = max(1, math.ceil(c / 120))  # beyond ~120 classes label every k-th
    ticks = list(range(0, c, step))
    ax.set_xticks(ticks, [names[i] for i in ticks], rotation=90, fontsize=fontsize)
    ax.set_yticks(ticks, [names[i] for i in ticks], fontsize=fontsize)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(f"Confusion matrix, row-normalised ({c} classes)")
    if c <= CELL_NUMBERS_UP_TO:
        for i in range(c):
            for j in range(c):
                v = float(norm[i, j])
                if v >= 0.005:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if v > 0.5 else "black")
    return fig


CALIBRATION_SIZE = (6.0, 6.5)


def calibration_figure(bins: dict[str, Tensor], ece: float, *, subtitle: str = "") -> Figure:
    """Reliability diagram (Guo et al. 2017, fig. 1): accuracy per confidence bin against the
    diagonal, the gap shaded; below, how many predictions fall in each bin."""
    fig = Figure(figsize=CALIBRATION_SIZE, dpi=DPI, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    edges = bins["edges"].numpy()
    left, width = edges[:-1], np.diff(edges)
    count = bins["count"].numpy()
    acc, conf = bins["accuracy"].numpy(), bins["confidence"].numpy()
    filled = count > 0
    top.bar(left[filled], acc[filled], width=width[filled], align="edge", color="tab:blue",
            edgecolor="black", label="accuracy")
    top.bar(left[filled], (conf - acc)[filled], bottom=acc[filled], width=width[filled], align="edge",
            color="tab:red", alpha=0.3, edgecolor="tab:red", hatch="//", label="gap to confidence")
    top.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    top.set(xlim=(0, 1), ylim=(0, 1), ylabel="accuracy")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"Reliability diagram: ECE = {100 * ece:.2f}% ({len(count)} bins)"
                  + (f"\n{subtitle}" if subtitle else ""))
    bottom.bar(left, count, width=width, align="edge", color="gray", edgecolor="black")
    bottom.set(xlim=(0, 1), xlabel="top-1 confidence", ylabel="count")
    return fig


CURVES_SIZE = (11.0, 4.0)


def curves_figure(history: list[dict[str, float]]) -> Figure:
    """Loss and accuracy per epoch, train and val, from history.csv rows; a run without accuracy (an
    MAE pre-training) gets the loss panel alone."""
    shown = [what for what in ("loss", "acc") if any(f"{split}/{what}" in r for r in history for split in ("train", "val"))]
    shown = shown or ["loss"]
    width, height = CURVES_SIZE
    fig = Figure(figsize=(width * len(shown) / 2, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for ax, what in zip(axes, shown):
        for split, style in (("train", "-o"), ("val", "-s")):
            key = f"{split}/{what}"
            pts = [(r["epoch"], r[key]) for r in history if key in r]
            if pts:
                ax.plot(*zip(*pts), style, markersize=3, label=key)
        ax.set(xlabel="epoch", ylabel="accuracy" if what == "acc" else "loss")
        ax.set_title("Accuracy" if what == "acc" else "Loss")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    return fig


ERRORS_COLS = 4
ERRORS_PANEL = 2.4


def errors_size(num_images: int) -> tuple[float, float]:
    rows = max(1, math.ceil(num_images / ERRORS_COLS))
    return ERRORS_COLS * ERRORS_PANEL, rows * (ERRORS_PANEL + 0.3)


def errors_figure(items: list[dict], image: Callable[[int], np.ndarray | None]) -> Figure:
    """The most confident mistakes: each panel the stored image, its true and predicted class.

    items: dicts with ``index``, ``target_name``, ``pred_name``, ``prob`` (of the prediction),
    ``prob_target``; image(index) -> uint8 (H, W[, 3]) or None (drawn as an empty panel).
    """
    fig = Figure(figsize=errors_size(len(items)), dpi=DPI, layout="constrained")
    if not items:
        fig.text(0.5, 0.5, "no mistakes on this split", ha="center", va="center", fontsize=14)
        return fig
    axes = fig.subplots(max(1, math.ceil(len(items) / ERRORS_COLS)), ERRORS_COLS, squeeze=False).ravel()
    for ax, it in zip(axes, items):
        pixels = image(it["index"])  # uint8 (H, W) or (H, W, 3)
        if pixels is not None:
            ax.imshow(pixels, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        ax.set_title(f"true: {_short(it['target_name'], 18)} ({it['prob_target']:.2f})\n"
                     f"pred: {_short(it['pred_name'], 18)} ({it['prob']:.2f})", fontsize=8)
        ax.set_xlabel(f"#{it['index']}", fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in axes[len(items):]:
        ax.set_axis_off()
    return fig


# ---- multi-label figures (vitpipe.report.multilabel computes their data)

PR_SIZE = (8.0, 6.0)


def pr_figure(curves: list[dict], *, at: str = "") -> Figure:
    """Precision-recall curves (``vitpipe.report.multilabel.pr_curves``): one line per class, the micro
    average in black, AP in the legend, a dot at each curve's operating point (``at``: the threshold)."""
    fig = Figure(figsize=PR_SIZE, dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    if not curves:
        ax.text(0.5, 0.5, "no positive labels on this split", ha="center", va="center", fontsize=14)
    for i, cu in enumerate(curves):
        micro = cu["class"] is None
        color = "black" if micro else f"C{i % 10}"
        ax.step(cu["recall"], cu["precision"], where="post", color=color, linewidth=2.0 if micro else 1.2,
                linestyle="--" if micro else "-", label=f"{_short(cu['name'], 18)} (AP {cu['ap']:.3f})")
        ax.plot(*cu["point"], "o", color=color, markersize=8 if micro else 7, markeredgecolor="black")
    ax.set(xlim=(0, 1.01), ylim=(0, 1.02), xlabel="recall", ylabel="precision")
    ax.set_title("Precision-recall per class" + (f" (dots: operating point at {at})" if at else ""), fontsize=10)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(loc="lower left", fontsize=7, ncol=1 if len(curves) <= 11 else 2)
    return fig


def co_occurrence_size(num_classes: int) -> tuple[float, float]:
    """Inches: two matrices side by side, each as wide as the confusion matrix's."""
    side = min(14.0, max(4.5, 2.0 + 0.16 * num_classes))
    return 2 * side + 1.0, side + 0.6


def co_occurrence_figure(true: np.ndarray, pred: np.ndarray, class_names: Sequence[str], *, at: str = "") -> Figure:
    """Label co-occurrence counts (C, C): true label sets (left) and predicted ones (right), one colour scale."""
    c = true.shape[0]
    fig = Figure(figsize=co_occurrence_size(c), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, 2)
    vmax = max(1, int(true.max(initial=0)), int(pred.max(initial=0)))
    names = [_short(n) for n in class_names]
    fontsize = 9 if c <= 20 else 7 if c <= 50 else 6
    step = max(1, math.ceil(c / 80))
    ticks = list(range(0, c, step))
    for ax, m, title in ((axes[0], true, "true labels (diagonal: support)"),
                         (axes[1], pred, "predicted labels" + (f" at {at}" if at else ""))):
        im = ax.imshow(m, cmap="Blues", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_xticks(ticks, [names[i] for i in ticks], rotation=90, fontsize=fontsize)
        ax.set_yticks(ticks, [names[i] for i in ticks], fontsize=fontsize)
        ax.set_title(f"Co-occurrence, {title}", fontsize=10)
        if c <= CELL_NUMBERS_UP_TO:
            for i in range(c):
                for j in range(c):
                    if m[i, j]:
                        ax.text(j, i, str(int(m[i, j])), ha="center", va="center", fontsize=7,
                                color="white" if m[i, j] > vmax / 2 else "black")
    fig.colorbar(im, ax=list(axes), fraction=0.03, label="images with both labels")
    return fig


def label_errors_size(num_false_pos: int, num_missed: int) -> tuple[float, float]:
    rows = sum(max(1, math.ceil(n / ERRORS_COLS)) for n in (num_false_pos, num_missed))
    return ERRORS_COLS * ERRORS_PANEL, rows * (ERRORS_PANEL + 0.45) + 0.8


def label_errors_figure(false_pos: list[dict], missed: list[dict], image: Callable[[int], np.ndarray | None]) -> Figure:
    """Two galleries: the most confident false positives (top) and missed labels (bottom).

    items: dicts with ``row`` (passed to ``image``), ``index``, ``class_name``, ``score``, ``labels`` (the
    image's true label set); image(row) -> uint8 (H, W[, 3]) or None (an empty panel).
    """
    fig = Figure(figsize=label_errors_size(len(false_pos), len(missed)), dpi=DPI, layout="constrained")
    rows = [max(1, math.ceil(len(items) / ERRORS_COLS)) for items in (false_pos, missed)]
    subs = fig.subfigures(2, 1, height_ratios=rows)
    for sub, items, title, what in ((subs[0], false_pos, "Most confident false positives (label absent)", "absent"),
                                    (subs[1], missed, "Most confident missed labels (label present)", "present")):
        sub.suptitle(title, fontsize=10)
        axes = sub.subplots(max(1, math.ceil(len(items) / ERRORS_COLS)), ERRORS_COLS, squeeze=False).ravel()
        for ax, it in zip(axes, items):
            pixels = image(it["row"])
            if pixels is not None:
                ax.imshow(pixels, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            true = ";".join(it["labels"]) or "(none)"
            ax.set_title(f"{_short(it['class_name'], 18)}: {it['score']:.3f}\ntrue: {_short(true, 26)}", fontsize=8)
            ax.set_xlabel(f"#{it['index']}", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
        for ax in axes[len(items):]:
            ax.set_axis_off()
        if not items:
            axes[0].text(0.5, 0.5, f"no {what} labels", ha="center", va="center", fontsize=12,
                          transform=axes[0].transAxes)
    return fig


def _short(name: str, n: int = 14) -> str:
    name = str(name)
    return name if len(name) <= n else name[: n - 1] + "…"
