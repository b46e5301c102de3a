"""Sweep summaries: one row per Hydra multirun job (its overrides and final metrics).

Written into the sweep directory after every job (so a crash mid-sweep keeps what finished) and at
the end; ``scripts/sweep_report.py <sweep_dir>`` rebuilds them from the job folders alone:

    summary.csv   every job's overrides and metrics (floats shortened: overrides to 3 significant
                  digits, 1.04e-03; metrics to 4)
    summary.md    the settings every job shared, then the table of what varied, then (a sweep over
                  ``seed``) each metric's mean +- sample standard deviation over the seeds of each
                  setting of the other overrides, then the figures
    summary_seeds.csv  that table, where ``seed`` varies
    summary.png   the metric per job; each bar is labelled "#<job> <the overrides that vary>"
    optuna_*.png  Optuna sweeps only (vitpipe.sweep.optuna): history, slices, importances
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vitpipe.run.csvfiles import dict_csv_text
from vitpipe.run.files import atomic_write_text
from vitpipe.run.jsonfiles import read_json

SLURM_STATE = ".slurm_state"  # hydra_plugins/vitpipe_slurm: the SLURM state of a job that left no result
METRIC_ORDER = ("val/acc_best", "test/acc", "test/acc_top5", "test/loss", "val/cider_best", "test/bleu4", "test/cider")


def collect_jobs(sweep_dir: str | Path) -> list[dict]:
    """Rows {job, <override keys>..., <metrics>..., status} for each numbered job folder."""
    rows = []
    for job in sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
        row = {"job": int(job.name)}
        for o in overrides or []:
            key, _, value = o.partition("=")
            row[key.lstrip("+~")] = value
        metrics_file = job / "metrics.json"
        if metrics_file.is_file():
            row.update({k: v for k, v in read_json(metrics_file).items() if not _bookkeeping(k)})
            row["status"] = "done"
        elif (job / SLURM_STATE).is_file():  # written by vitpipe's SLURM launcher: CANCELLED, TIMEOUT, ...
            row["status"] = (job / SLURM_STATE).read_text().strip().lower() or "incomplete"
        else:
            row["status"] = "incomplete"
        rows.append(row)
    return rows


def _bookkeeping(metric: str) -> bool:
    """metrics.json keys that are not results: the final learning rates (LearningRateMonitor's
    ``lr-AdamW``, ``lr-AdamW/pg3`` per layer-decay group) and Lightning's ``_step``/``_epoch`` copies
    of a metric logged both ways (``train/loss`` holds it)."""
    return metric.startswith("lr-") or metric.endswith(("_step", "_epoch"))


def split_columns(rows: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """(varying overrides, fixed overrides, metrics): what the sweep varied comes first."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    metrics = [k for k in METRIC_ORDER if k in keys] + sorted(k for k in keys if "/" in k and k not in METRIC_ORDER)
    params = [k for k in keys if k not in metrics and k not in ("job", "status")]
    varying = [p for p in params if len({str(r.get(p)) for r in rows}) > 1]
    return varying, [p for p in params if p not in varying], metrics


def fmt(value, digits: int = 4) -> str:
    """A readable number: ``digits`` significant digits, scientific below 0.01 or from 1e5 (1.038e-03).

    Strings that hold a float (overrides such as ``lr=0.001038445306856572``) are shortened too;
    ints, words and flags stay as they are.
    """
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        if not any(c in value for c in ".eE") or not math.isfinite(number):
            return value  # an int, or inf / nan: already short
        value = number
    if isinstance(value, bool) or not isinstance(value, float):
        return "" if value is None else str(value)
    if value == 0 or not math.isfinite(value):
        return str(value)
    if 1e-2 <= abs(value) < 1e5:
        return f"{value:.{digits}g}"
    return f"{value:.{digits - 1}e}"


def short_names(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix that tells each key apart: module.optimizer.lr -> lr."""
    names = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if sum(k == suffix or k.endswith("." + suffix) for k in keys) == 1:
                break
        names[key] = suffix
    return names


def job_labels(rows: list[dict], varying: list[str]) -> list[str]:
    """'#<job> name=value ...' with only the overrides that vary, floats to 3 significant digits."""
    names = short_names(varying)
    return [" ".join([f"#{r['job']}", *(f"{names[p]}={fmt(r[p], 3)}" for p in varying if p in r)]) for r in rows]


def write_summary(sweep_dir: str | Path, metric: str | None = None) -> list[dict]:
    """Write summary.csv / .md / .png (and an Optuna study's plots) for ``sweep_dir``; returns the rows."""
    sweep_dir = Path(sweep_dir)
    rows = collect_jobs(sweep_dir)
    if not rows:
        return rows
    varying, fixed, metrics = split_columns(rows)
    cols = ["job", *varying, *fixed, *metrics, "status"]
    atomic_write_text(sweep_dir / "summary.csv",  # overrides as cells a spreadsheet shows, never evaluates
                      dict_csv_text(({c: fmt(r.get(c), 4 if c in metrics else 3) for c in cols} for r in rows), cols))

    metric = metric if metric in metrics else next(iter(metrics), None)
    figures = []
    if metric:
        fig = summary_figure(rows, varying, metric, title=f"{sweep_dir.name}: {metric} per job")
        if fig is not None:
            fig.savefig(sweep_dir / "summary.png", dpi=100)
            figures.append("summary.png")
        from vitpipe.sweep.optuna import optuna_figures  # optuna only loads for Optuna sweeps

        figures += optuna_figures(sweep_dir, rows, metric)

    md = [f"# Sweep {sweep_dir.name}: {len(rows)} job(s)", ""]
    if fixed:
        md += ["Every job: " + ", ".join(f"`{p}={fmt(rows[0].get(p))}`" for p in fixed), ""]
    table = [c for c in cols if c not in fixed]  # the fixed ones are listed once above
    md += ["| " + " | ".join(table) + " |", "|" + "---|" * len(table)]
    md += ["| " + " | ".join(fmt(r.get(c), 4 if c in metrics else 3) for c in table) + " |" for r in rows]
    groups = over_seeds(rows, varying, metrics)
    if groups:
        others = [p for p in varying if p != "seed"]
        seed_cols = [*others, "seeds", *(m for m in metrics if any(m in g for g in groups))]
        cells = [{c: mean_std(g[c]) if c in metrics else g.get(c, "") for c in seed_cols} for g in groups]
        atomic_write_text(sweep_dir / "summary_seeds.csv",
                          dict_csv_text(({c: (" ".join(fmt(v, 4) for v in g[c][:2]) if c in metrics else g.get(c, ""))
                                          for c in seed_cols} for g in groups), seed_cols))  # mean std
        md += ["", "Mean +- sample standard deviation over the seeds (finished jobs only):", "",
               "| " + " | ".join(seed_cols) + " |", "|" + "---|" * len(seed_cols)]
        md += ["| " + " | ".join(row[c] for c in seed_cols) + " |" for row in cells]
    if figures:
        md += ["", *(f"![{Path(f).stem}]({f})" for f in figures)]
    atomic_write_text(sweep_dir / "summary.md", "\n".join(md) + "\n")
    return rows


def over_seeds(rows: list[dict], varying: list[str], metrics: list[str]) -> list[dict]:
    """Where ``seed`` varies: one row per setting of the other varying overrides (first-seen order),
    with ``seeds`` (the seeds that finished, "0,1,2") and, per metric, (mean, sample std, n) over them.
    Jobs that did not finish are left out; [] when ``seed`` does not vary."""
    if "seed" not in varying:
        return []
    others = [p for p in varying if p != "seed"]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("status") == "done":
            groups.setdefault(tuple(str(r.get(p, "")) for p in others), []).append(r)
    out = []
    for key, members in groups.items():
        g = {**dict(zip(others, key)), "seeds": ",".join(str(m.get("seed")) for m in members)}
        for metric in metrics:
            values = [float(m[metric]) for m in members if isinstance(m.get(metric), (int, float))]
            if values:
                g[metric] = (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0,
                             len(values))
        out.append(g)
    return out


def mean_std(cell) -> str:
    """(mean, std, n) -> '0.8123 +- 0.0040' ('0.8123' for one seed); '' for no value."""
    if not cell:
        return ""
    mean, std, n = cell
    shown = f"{mean:#.4g}" if 1e-2 <= abs(mean) < 1e5 else fmt(mean)  # trailing zeros kept: 0.8200
    if n == 1:
        return shown
    decimals = len(shown.partition(".")[2]) if "e" not in shown else None  # the std to the mean's last digit
    return f"{shown} +- {std:.{decimals}f}" if decimals is not None else f"{shown} +- {fmt(std, 2)}"


def summary_figure(rows: list[dict], varying: list[str], metric: str, *, title: str) -> Figure | None:
    """Horizontal bars, one per finished job, labelled by ``job_labels``; the figure is sized to its labels."""
    done = [r for r in rows if isinstance(r.get(metric), (int, float))]
    if not done:
        return None
    labels = job_labels(done, varying)
    fig = Figure(figsize=(6, 1.2 + 0.35 * len(done)), layout="constrained")
    ax = fig.add_subplot()
    values = [r[metric] for r in done]
    bars = ax.barh(range(len(done)), values, color="tab:blue")
    ax.bar_label(bars, labels=[fmt(v) for v in values], padding=2, fontsize=8)
    ax.set_yticks(range(len(done)), labels, fontsize=8)
    ax.invert_yaxis()  # job 0 on top, as in the table
    ax.set_xlabel(metric)
    ax.set_xlim(0, max(max(values), 1e-12) * 1.15)  # room for the value labels
    ax.set_title(title, fontsize=10)
    # widen the figure to the longest label (measured, not guessed) plus 4 inches of bars
    renderer = FigureCanvasAgg(fig).get_renderer()
    widest = max([t.get_window_extent(renderer).width for t in ax.get_yticklabels()]
                 + [ax.title.get_window_extent(renderer).width - 4 * fig.dpi])
    fig.set_size_inches(max(6.0, widest / fig.dpi + 4.5), fig.get_size_inches()[1])
    return fig


class SweepSummaryCallback(Callback):
    """Hydra callback: refresh the sweep summary after each job and at the end of the multirun."""

    def __init__(self, metric: str | None = None) -> None:
        self.metric = metric
        self._written_after: int | None = None  # jobs summarised by on_job_end (then the end adds nothing)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            rows = write_summary(config.hydra.sweep.dir, self.metric or config.get("optimized_metric"))
            self._written_after = len(rows)

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_jobs(sweep_dir) if sweep_dir.is_dir() else []
        if rows and len(rows) != self._written_after:  # e.g. jobs launched elsewhere (submitit): summarise here
            rows = write_summary(sweep_dir, self.metric or config.get("optimized_metric"))
        if rows:
            print(f"vitpipe: sweep summary of {len(rows)} job(s) in {sweep_dir / 'summary.md'}")
