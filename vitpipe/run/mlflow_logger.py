"""``logger=mlflow``: Lightning's ``MLFlowLogger`` with a store that works offline, the run's config as
params and its result files as artifacts.

The store. MLflow 3 refuses its old file store (``./mlruns``: "in maintenance mode", unless
``MLFLOW_ALLOW_FILE_STORE=true``), which is what Lightning falls back to without a ``tracking_uri``.
So with ``logger.mlflow.tracking_uri=null`` and no ``MLFLOW_TRACKING_URI`` in the environment the
store is a SQLite file in the run directory, ``<run dir>/mlflow.db``, and the artifacts go beside it
(``<run dir>/mlartifacts``). One store per run, not one per log dir: a run directory stays
self-contained (moved or deleted with its record), and parallel sweep jobs or SLURM jobs on a
network file system never write one SQLite file at once (its locking is unreliable there, and two
first runs would both create its tables). Runs are compared in one place by pointing
``tracking_uri`` (or ``MLFLOW_TRACKING_URI``) at a server or a shared database.

What is logged (rank 0 only, as Lightning's loggers do): every metric the CSV logger gets, as it is
logged; the composed config, flattened to dotted keys (``model.dim``, ``module.optimizer.lr``: the
command-line spelling) with the values config.yaml holds, when the run starts; at the end, the final
metrics of metrics.json at the last step (so the run's latest values are metrics.json's) and the
run's files as artifacts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only

LOCAL_DB = "mlflow.db"
LOCAL_ARTIFACTS = "mlartifacts"
# what a train run writes beside its checkpoints (vitpipe.run.info: metrics.json, config.yaml;
# vitpipe.report.callback: predictions.csv, report/), logged as artifacts when present
RUN_FILES = ("metrics.json", "config.yaml", "predictions.csv", "report")
MAX_PARAM_LENGTH = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH (Lightning's own log_hyperparams cuts at 250)
PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch call


def mlflow_logger(save_dir: str, tracking_uri: str | None = None, experiment_name: str = "vitpipe",
                  run_name: str | None = None, artifact_location: str | None = None,
                  log_model: bool | str = False, tags: Mapping | None = None) -> MLFlowLogger:
    """An ``MLFlowLogger`` whose store is ``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else
    ``sqlite:///<save_dir>/mlflow.db`` with artifacts under ``<save_dir>/mlartifacts``.

    ``artifact_location`` is used when the experiment is created; for the local store it defaults to
    the run directory (MLflow's own default is ``./mlartifacts`` of the current directory)."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        root = Path(save_dir).resolve()
        root.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{root / LOCAL_DB}"
        artifact_location = artifact_location or (root / LOCAL_ARTIFACTS).as_uri()
    return MLFlowLogger(experiment_name=experiment_name, run_name=run_name, tracking_uri=uri,
                        tags=dict(tags) if tags else None, artifact_location=artifact_location,
                        log_model=log_model)


def _mlflow(loggers: Iterable) -> list[MLFlowLogger]:
    return [lg for lg in loggers or () if isinstance(lg, MLFlowLogger)]


def flatten(config: Mapping, prefix: str = "") -> dict[str, str]:
    """``{"model": {"dim": 32}}`` -> ``{"model.dim": "32"}``; lists by index (``tags.0``); None as ``null``."""
    out: dict[str, str] = {}
    items = config.items() if isinstance(config, Mapping) else enumerate(config)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (Mapping, list, tuple)) and v:
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = "null" if v is None else str(v)
    return out


@rank_zero_only
def log_config(loggers: Iterable, config: Mapping) -> None:
    """The run's config (as config.yaml stores it) as params of every MLflow run, flattened.

    mlflow is an extra: without an MLflow logger nothing is imported."""
    targets = list(_mlflow(loggers))
    if not targets:
        return
    from mlflow.entities import Param

    params = [Param(k, v[:MAX_PARAM_LENGTH]) for k, v in sorted(flatten(config).items())]
    for lg in targets:
        for i in range(0, len(params), PARAMS_PER_BATCH):
            lg.experiment.log_batch(run_id=lg.run_id, params=params[i:i + PARAMS_PER_BATCH])


@rank_zero_only
def log_outcome(loggers: Iterable, metrics: Mapping[str, float], step: int, run_dir: Path) -> None:
    """The final metrics (metrics.json's) at ``step``, the run's last, and the run's files as artifacts."""
    for lg in _mlflow(loggers):
        lg.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
        for name in RUN_FILES:
            path = Path(run_dir) / name
            if path.is_dir():
                lg.experiment.log_artifacts(lg.run_id, str(path), artifact_path=name)
            elif path.is_file():
                lg.experiment.log_artifact(lg.run_id, str(path))
