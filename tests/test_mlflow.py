"""logger=mlflow: a tiny run read back with MLflow's own client holds metrics.json's final values, the
config as params and the run's files as artifacts, in a store inside the run directory."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytest.importorskip("mlflow")


def test_a_run_logged_to_mlflow_reads_back_as_metrics_json_and_config(cfg_factory, monkeypatch):
    from mlflow.tracking import MlflowClient

    from vitpipe.run.mlflow_logger import flatten
    from vitpipe.tasks.train import train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = cfg_factory("debug=fast", "logger=[csv,mlflow]", "model.dim=48", "module.optimizer.lr=0.00123")
    metrics = train(cfg)
    run_dir = Path(cfg.paths.output_dir)
    assert json.loads((run_dir / "metrics.json").read_text()) == metrics
    assert (run_dir / "mlflow.db").is_file() and not Path("mlruns").exists()  # the run's own store, not ./mlruns

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("vitpipe")
    assert Path(experiment.artifact_location.removeprefix("file://")) == run_dir.resolve() / "mlartifacts"
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == cfg.task_name
    # the latest value of every key is metrics.json's (train/val/test metrics and vitpipe's time/*)
    assert {k: run.data.metrics[k] for k in metrics} == metrics
    # every value the CSV logger wrote, MLflow got too, at the same step
    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {k for row in rows for k, v in row.items() if v and k not in ("epoch", "step")}
    assert {"train/loss_step", "val/acc", "test/acc"} <= logged <= set(run.data.metrics), logged
    for key in logged:
        expected = [(int(r["step"]), pytest.approx(float(r[key]))) for r in rows if r[key]]
        got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        if key in metrics:  # and metrics.json's final value once more, at the last step
            got.remove((cfg.trainer.limit_train_batches, metrics[key]))
        assert sorted(got) == expected, key

    params = run.data.params
    assert params["model.dim"] == "48" and float(params["module.optimizer.lr"]) == pytest.approx(0.00123)
    assert params["data._target_"] == cfg.data._target_ and params["seed"] == str(cfg.seed)
    stored = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    assert params == flatten(stored)  # config.yaml, flattened to the command line's dotted keys

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"metrics.json", "config.yaml"} <= artifacts
    local = Path(client.download_artifacts(run.info.run_id, "metrics.json", dst_path=str(run_dir / "dl")))
    assert json.loads(local.read_text()) == metrics


def test_a_run_without_an_mlflow_logger_never_imports_mlflow(cfg_factory, monkeypatch):
    """mlflow is an extra: a venv without it (the wheel's plain install) trains with the default loggers."""
    import sys

    from vitpipe.tasks.train import train

    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow...` now raises ImportError
    metrics = train(cfg_factory("debug=fast", "logger=csv"))
    assert metrics["test/acc"] >= 0 and not any(m.startswith("mlflow.") for m in sys.modules if sys.modules[m])


def test_tracking_uri_wins_over_the_local_store(tmp_path, monkeypatch):
    from vitpipe.run.mlflow_logger import mlflow_logger

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    assert mlflow_logger(save_dir=str(tmp_path / "run"), tracking_uri=shared)._tracking_uri == shared
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared)
    assert mlflow_logger(save_dir=str(tmp_path / "run"))._tracking_uri == shared
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    local = mlflow_logger(save_dir=str(tmp_path / "run"))
    assert local._tracking_uri == f"sqlite:///{(tmp_path / 'run' / 'mlflow.db').resolve()}"
    assert local._artifact_location == (tmp_path / "run" / "mlartifacts").resolve().as_uri()


def test_flatten_spells_keys_as_the_command_line_does():
    from vitpipe.run.mlflow_logger import flatten

    assert flatten({"model": {"dim": 32, "pos": None}, "tags": ["a", "b"], "empty": {}, "lr": 1e-3}) == {
        "model.dim": "32", "model.pos": "null", "tags.0": "a", "tags.1": "b", "empty": "{}", "lr": "0.001"}
