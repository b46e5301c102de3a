"""The plots Optuna users know, for a finished (or running) Optuna sweep, from its job folders alone.

hydra-optuna-sweeper keeps its study in memory (``storage: null``), so the study is rebuilt here from
what each job wrote: the search space from the job's ``.hydra/hydra.yaml`` (``hydra.sweeper.params``),
each trial's parameters from its overrides and its value from ``metrics.json``
(``optuna.trial.create_trial`` + ``study.add_trial``). Then, beside summary.png:

    optuna_history.png      optuna.visualization.matplotlib.plot_optimization_history
    optuna_slice.png        optuna.visualization.matplotlib.plot_slice
    optuna_importance.png   parameter importances (mean decrease in impurity of a random forest), from
                            MIN_TRIALS_FOR_IMPORTANCE finished trials on

The sweeper pins optuna < 3; with 2.10, plot_param_importances and plot_parallel_coordinate fail on
today's matplotlib/numpy, so the importances are computed by optuna and drawn with plain matplotlib.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import yaml
from matplotlib.figure import Figure

MIN_TRIALS_FOR_IMPORTANCE = 5  # a random forest on fewer points ranks noise


def sweeper_config(sweep_dir: Path) -> dict | None:
    """``hydra.sweeper`` of the first job that recorded it, if that sweeper is Optuna's; else None."""
    for hydra_yaml in sorted(Path(sweep_dir).glob("*/.hydra/hydra.yaml")):
        sweeper = (yaml.safe_load(hydra_yaml.read_text()) or {}).get("hydra", {}).get("sweeper") or {}
        return sweeper if "optuna" in str(sweeper.get("_target_", "")).lower() else None
    return None


def rebuild_study(sweeper: dict, rows: list[dict], metric: str):
    """An in-memory optuna Study holding one COMPLETE trial per finished job."""
    import optuna
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_override

    parser = OverridesParser.create()
    space = {}
    for key, spec in (sweeper.get("params") or {}).items():
        dist = create_optuna_distribution_from_override(parser.parse_override(f"{key}={spec}"))
        if isinstance(dist, optuna.distributions.BaseDistribution):  # a fixed value is no search dimension
            space[key] = dist
    direction = sweeper.get("direction") or "minimize"
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not "A new study created in memory" per refresh
    study = optuna.create_study(direction=direction if isinstance(direction, str) else direction[0],
                                study_name=str(sweeper.get("study_name") or "sweep"))
    for row in rows:
        if not isinstance(row.get(metric), (int, float)) or not all(k in row for k in space):
            continue
        params = {k: _decode(row[k], d) for k, d in space.items()}
        with warnings.catch_warnings():  # "experimental" in optuna 2.10, stable since
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.add_trial(optuna.trial.create_trial(params=params, distributions=space, value=float(row[metric])))
    return study


def _decode(text: str, dist):
    """An override's string back to the distribution's value type (choices are the encoded strings)."""
    import optuna.distributions as od

    if isinstance(dist, od.CategoricalDistribution):
        return text if text in dist.choices else type(dist.choices[0])(text)
    if isinstance(dist, (od.IntUniformDistribution, od.IntLogUniformDistribution)):
        return int(float(text))
    return float(text)


def optuna_figures(sweep_dir: Path, rows: list[dict], metric: str) -> list[str]:
    """Write the Optuna plots for ``sweep_dir`` if it is an Optuna sweep; returns their file names."""
    sweeper = sweeper_config(sweep_dir)
    if sweeper is None:
        return []
    import matplotlib
    import optuna
    from optuna.visualization import matplotlib as ovm

    written = []
    # rc_context: optuna's plots switch pyplot to the ggplot style globally; keep that inside these two plots.
    # create_trial/add_trial are "experimental" in 2.10, and axes with one value warn
    with matplotlib.rc_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", UserWarning)
        study = rebuild_study(sweeper, rows, metric)
        if not study.trials:
            return []
        ax = ovm.plot_optimization_history(study, target_name=metric)
        written.append(_save(ax, sweep_dir / "optuna_history.png"))
        if study.trials[0].distributions:
            written.append(_save(ovm.plot_slice(study, target_name=metric), sweep_dir / "optuna_slice.png"))
    if len(study.trials) >= MIN_TRIALS_FOR_IMPORTANCE and study.trials[0].distributions:
        fig = importance_figure(study, metric)
        fig.savefig(sweep_dir / "optuna_importance.png", dpi=100)
        written.append("optuna_importance.png")
    return written


def importance_figure(study, metric: str) -> Figure:
    """Horizontal bars of ``get_param_importances`` (MeanDecreaseImpurity), most important on top."""
    from optuna.importance import MeanDecreaseImpurityImportanceEvaluator, get_param_importances

    importances = get_param_importances(study, evaluator=MeanDecreaseImpurityImportanceEvaluator(seed=0))
    names = list(importances)[::-1]
    fig = Figure(figsize=(6, 1.2 + 0.4 * len(names)), layout="constrained")
    ax = fig.add_subplot()
    bars = ax.barh(names, [importances[n] for n in names], color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", padding=2, fontsize=8)
    ax.set_xlim(0, 1.15)
    ax.set_xlabel(f"importance for {metric} (mean decrease in impurity, sums to 1)")
    ax.set_title(f"Parameter importances ({len(study.trials)} trials)", fontsize=10)
    return fig


def _save(axes, path: Path) -> str:
    """Save the figure of optuna's axes (an Axes or an array of them) and close it in pyplot."""
    import matplotlib.pyplot as plt
    import numpy as np

    ax = np.asarray(axes).ravel()[0]
    fig = ax.figure
    fig.set_layout_engine("constrained")  # optuna's default layout cuts long parameter names
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name
