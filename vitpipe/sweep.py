"""Sweep summaries: one row per Hydra multirun job (its overrides and final metrics).

Written as ``summary.csv``, ``summary.md`` and ``summary.png`` into the sweep directory, after
every job (so a crash mid-sweep keeps what finished) and at the end. ``scripts/sweep_report.py
<sweep_dir>`` rebuilds them from the job folders alone.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback

from vitpipe.runinfo import atomic_write_text

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
            row.update(json.loads(metrics_file.read_text()))
            row["status"] = "done"
        else:
            row["status"] = "incomplete"
        rows.append(row)
    return rows


def _columns(rows: list[dict]) -> tuple[list[str], list[str]]:
    keys = [k for r in rows for k in r]
    keys = list(dict.fromkeys(keys))
    metrics = [k for k in METRIC_ORDER if k in keys] + sorted(k for k in keys if "/" in k and k not in METRIC_ORDER)
    params = [k for k in keys if k not in metrics and k not in ("job", "status")]
    varying = [p for p in params if len({str(r.get(p)) for r in rows}) > 1]
    return varying + [p for p in params if p not in varying], metrics  # what the sweep varied comes first


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))


def write_summary(sweep_dir: str | Path, metric: str | None = None) -> list[dict]:
    """Write summary.csv / .md / .png for ``sweep_dir``; returns the rows."""
    sweep_dir = Path(sweep_dir)
    rows = collect_jobs(sweep_dir)
    if not rows:
        return rows
    params, metrics = _columns(rows)
    cols = ["job", *params, *metrics, "status"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(sweep_dir / "summary.csv", buf.getvalue())
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    atomic_write_text(sweep_dir / "summary.md", "\n".join(md) + "\n")
    metric = metric if metric in metrics else next(iter(metrics), None)
    if metric:
        _plot(rows, params, metric, sweep_dir / "summary.png")
    return rows


def _plot(rows: list[dict], params: list[str], metric: str, path: Path) -> None:
    from matplotlib.figure import Figure

    done = [r for r in rows if isinstance(r.get(metric), (int, float))]
    if not done:
        return
    varying = [p for p in params if len({str(r.get(p)) for r in rows}) > 1]
    labels = [", ".join(f"{p.split('.')[-1]}={r[p]}" for p in varying if p in r) or f"job {r['job']}" for r in done]
    fig = Figure(figsize=(max(4, 1.2 * len(done) + 2), 4), layout="constrained")
    ax = fig.add_subplot()
    bars = ax.bar(range(len(done)), [r[metric] for r in done], color="tab:blue")
    ax.bar_label(bars, fmt="%.3f")
    ax.set_xticks(range(len(done)), labels, rotation=20, ha="right")
    ax.set_ylabel(metric)
    ax.set_title(f"{path.parent.name}: {metric} per job")
    fig.savefig(path, dpi=100)


class SweepSummaryCallback(Callback):
    """Hydra callback: refresh the sweep summary after each job and at the end of the multirun."""

    def __init__(self, metric: str | None = None) -> None:
        self.metric = metric

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            write_summary(config.hydra.sweep.dir, self.metric or config.get("optimized_metric"))

    def on_multirun_end(self, config, **kwargs) -> None:
        rows = write_summary(config.hydra.sweep.dir, self.metric or config.get("optimized_metric"))
        if rows:
            print(f"vitpipe: sweep summary of {len(rows)} job(s) in {Path(config.hydra.sweep.dir) / 'summary.md'}")
