"""Sweep reports (vitpipe.sweep.summary, scripts/sweep_report.py) from sweep folders built by hand with the files a
job writes (.hydra/overrides.yaml, .hydra/hydra.yaml, metrics.json): a 3-trial Optuna study, an 8-trial one
and a 4-job grid. The real multiruns are in test_scale.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from PIL import Image

from vitpipe.sweep.summary import collect_jobs, fmt, job_labels, split_columns, summary_figure, write_summary

ROOT = Path(__file__).resolve().parents[1]
OPTUNA_PARAMS = {"module.optimizer.lr": "interval(1e-4, 5e-3)", "module.optimizer.weight_decay": "interval(0.0, 0.1)",
                 "module.label_smoothing": "choice(0.0, 0.1)", "model.pos_embed": "choice(learned, sincos2d, rope2d)"}
FIXED = ["hparams_search=optuna", "trainer.max_epochs=3", "logger=none"]


def make_job(sweep: Path, num: int, overrides: list[str], metrics: dict | None, sweeper: dict) -> None:
    hydra_dir = sweep / str(num) / ".hydra"
    hydra_dir.mkdir(parents=True)
    (hydra_dir / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (hydra_dir / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"sweeper": sweeper, "mode": "MULTIRUN"}}))
    if metrics is not None:
        (sweep / str(num) / "metrics.json").write_text(json.dumps(metrics))


def optuna_sweep(root: Path, n: int) -> Path:
    """n trials with the 18-digit floats Optuna writes; the last trial of 8 is unfinished."""
    sweep = root / f"optuna{n}"
    sweeper = {"_target_": "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
               "direction": "maximize", "study_name": "vitpipe", "params": OPTUNA_PARAMS}
    for i in range(n):
        lr = 0.001038445306856572 * (1 + 0.37 * i)
        overrides = [f"module.optimizer.lr={lr!r}", f"module.optimizer.weight_decay={0.0137684495906 * (i + 1)!r}",
                     f"module.label_smoothing={(0.0, 0.1)[i % 2]}",
                     f"model.pos_embed={('learned', 'sincos2d', 'rope2d')[i % 3]}",
                     *FIXED]
        metrics = None if n > 3 and i == n - 1 else {"val/acc_best": 0.5 + 0.3 * (i % 3) / 3 + 0.01 * i,
                                                     "val/loss": 1.0 / (i + 1), "train/loss": 2.2907290458679}
        make_job(sweep, i, overrides, metrics, sweeper)
    return sweep


def grid_sweep(root: Path) -> Path:
    """4 jobs: 2 positional encodings x 2 learning rates; long keys (an experiment's overrides)."""
    sweep = root / "grid"
    sweeper = {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None}
    for i, (pe, lr) in enumerate([(p, lr) for p in ("learned", "sincos2d") for lr in ("0.001", "0.0003")]):
        make_job(sweep, i, [f"model.pos_embed={pe}", f"module.optimizer.lr={lr}", "experiment=fmnist_vit"],
                 {"val/acc_best": 0.8 + 0.01 * i, "test/acc": 0.79 + 0.01 * i}, sweeper)
    return sweep


def texts_outside(fig) -> list[str]:
    """Every visible, non-empty text whose drawn extent leaves the figure's box (1 px tolerance)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer, box = canvas.get_renderer(), fig.bbox
    undrawn = set()  # tick labels beyond the axis limits exist but are not drawn
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, sorted(ax.get_xlim())), (ax.yaxis, sorted(ax.get_ylim()))):
            undrawn |= {id(lab) for loc, lab in zip(axis.get_ticklocs(), axis.get_ticklabels())
                        if not lo - 1e-9 <= loc <= hi + 1e-9}
    out = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip() or id(t) in undrawn:
            continue
        e = t.get_window_extent(renderer)
        if e.x0 < box.x0 - 1 or e.y0 < box.y0 - 1 or e.x1 > box.x1 + 1 or e.y1 > box.y1 + 1:
            out.append(t.get_text())
    return out


def test_fmt_shortens_floats_and_keeps_everything_else():
    assert fmt("0.001038445306856572", 3) == "1.04e-03" and fmt(0.001038445306856572) == "1.038e-03"
    assert fmt("0.06221087710398319", 3) == "0.0622" and fmt(2.29072904586792) == "2.291"
    assert fmt(0.125) == "0.125" and fmt(123456.0) == "1.235e+05" and fmt(0.0) == "0.0"
    assert [fmt(v) for v in ("rope2d", "3", "1e-4", "False", None, 5, True)] == ["rope2d", "3", "1.000e-04",
                                                                                  "False", "", "5", "True"]


def test_optuna_3_trials_report(tmp_path):
    sweep = optuna_sweep(tmp_path, 3)
    rows = write_summary(sweep, "val/acc_best")
    varying, fixed, _ = split_columns(rows)
    assert varying == ["module.optimizer.lr", "module.optimizer.weight_decay", "module.label_smoothing",
                       "model.pos_embed"] and fixed == ["hparams_search", "trainer.max_epochs", "logger"]
    labels = job_labels(rows, varying)
    assert labels[0] == "#0 lr=1.04e-03 weight_decay=0.0138 label_smoothing=0.0 pos_embed=learned"
    fig = summary_figure(rows, varying, "val/acc_best", title="optuna3: val/acc_best per job")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == labels
    assert texts_outside(fig) == []
    csv = (sweep / "summary.csv").read_text().splitlines()
    assert csv[1].startswith("0,1.04e-03,0.0138,0.0,learned,optuna,3,none,") and "2.291" in csv[1]
    md = (sweep / "summary.md").read_text()
    assert "Every job: `hparams_search=optuna`, `trainer.max_epochs=3`, `logger=none`" in md
    assert "| 0 | 1.04e-03 | 0.0138 | 0.0 | learned |" in md and "0.001038445" not in md + "\n".join(csv)
    for png in ("summary.png", "optuna_history.png", "optuna_slice.png"):
        assert f"]({png})" in md and (sweep / png).stat().st_size > 5000
    assert not (sweep / "optuna_importance.png").exists()  # 3 trials: too few for importances
    with Image.open(sweep / "summary.png") as im:  # the saved picture is the measured figure
        assert im.size == tuple(round(v * 100) for v in fig.get_size_inches())


def test_optuna_study_rebuilt_and_importances(tmp_path):
    from vitpipe.sweep.optuna import rebuild_study, sweeper_config

    sweep = optuna_sweep(tmp_path, 8)
    rows = write_summary(sweep, "val/acc_best")
    study = rebuild_study(sweeper_config(sweep), rows, "val/acc_best")
    assert len(study.trials) == 7  # the unfinished job is left out
    assert study.best_trial.params["module.optimizer.lr"] == pytest.approx(0.001038445306856572 * (1 + 0.37 * 5))
    assert study.best_trial.params["model.pos_embed"] == "rope2d"
    assert study.best_value == pytest.approx(0.5 + 0.2 + 0.05)
    assert "![optuna_importance](optuna_importance.png)" in (sweep / "summary.md").read_text()
    assert (sweep / "optuna_importance.png").stat().st_size > 5000


def test_grid_4_jobs_report_and_script(tmp_path):
    sweep = grid_sweep(tmp_path)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_report.py"), str(sweep), "--metric", "test/acc"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = collect_jobs(sweep)
    varying, _, _ = split_columns(rows)
    labels = job_labels(rows, varying)
    assert labels == ["#0 pos_embed=learned lr=1.00e-03", "#1 pos_embed=learned lr=3.00e-04",
                      "#2 pos_embed=sincos2d lr=1.00e-03", "#3 pos_embed=sincos2d lr=3.00e-04"]
    assert texts_outside(summary_figure(rows, varying, "test/acc", title="grid: test/acc per job")) == []
    assert "| 3 | sincos2d | 3.00e-04 | 0.83 | 0.82 | done |" in r.stdout  # the table printed is summary.md
    assert not list(sweep.glob("optuna_*.png"))  # not an Optuna sweep


def test_the_fit_check_catches_labels_cut_off():
    """The extent check is not vacuous: a fixed 4-inch figure with one job's long label fails it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4, 2))
    ax = fig.add_subplot()
    ax.barh([0], [1.0])
    ax.set_yticks([0], ["#0 " + " ".join(f"param{i}=0.001038445306856572" for i in range(3))])
    assert texts_outside(fig)


def test_a_sweep_over_seeds_gets_mean_and_sample_std_per_setting(tmp_path):
    """pretrained=a,null x seed=0,1,2 (one job unfinished): summary.md and summary_seeds.csv give each
    setting's mean +- sample std over the seeds that finished, with those seeds named."""
    sweep = tmp_path / "seeds"
    sweeper = {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "params": None}
    accs = {("a", 0): 0.80, ("a", 1): 0.82, ("a", 2): 0.84, ("null", 0): 0.70, ("null", 1): 0.71, ("null", 2): None}
    for i, ((arm, seed), acc) in enumerate(accs.items()):
        make_job(sweep, i, [f"model.pretrained={arm}", f"seed={seed}", "experiment=mae_fmnist_finetune"],
                 None if acc is None else {"test/acc": acc, "time/fit_s": 100.0 + seed, "lr-AdamW": 1e-6,
                                           "lr-AdamW/pg2": 2e-6, "train/loss_step": 1.0}, sweeper)
    write_summary(sweep)
    md = (sweep / "summary.md").read_text()
    # a: mean 0.82, sample std 0.02; null: 0.705 +- 0.00707 (seeds 0 and 1 only); fit time 101 +- 1
    # the final learning rates and Lightning's _step copies are bookkeeping, not results: left out
    assert "| model.pretrained | seeds | test/acc | time/fit_s |" in md and "lr-AdamW" not in md and "_step" not in md
    assert "| a | 0,1,2 | 0.8200 +- 0.0200 | 101.0 +- 1.0 |" in md
    assert "| null | 0,1 | 0.7050 +- 0.0071 | 100.5 +- 0.7 |" in md
    rows = (sweep / "summary_seeds.csv").read_text().splitlines()
    assert rows[0] == "model.pretrained,seeds,test/acc,time/fit_s"
    assert rows[1].startswith("a,\"0,1,2\",0.82 0.02,")
    grid = grid_sweep(tmp_path)  # no seed column: no such table
    write_summary(grid)
    assert "over the seeds" not in (grid / "summary.md").read_text() and not (grid / "summary_seeds.csv").exists()
