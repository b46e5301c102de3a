"""Loggers: logger=wandb without a login stops in one line before the run directory exists, and every
logger is told whether the run failed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning
import pytest
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from vitpipe.run.info import finish_loggers

ROOT = Path(__file__).resolve().parents[1]


def no_login_env(home: Path, **extra: str) -> dict[str, str]:
    """A user who never ran `wandb login`: no WANDB_* variables, an empty home (no ~/.netrc, no settings)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in ("NETRC", "XDG_CONFIG_HOME")}
    return {**env, "HOME": str(home), "OMP_NUM_THREADS": "1", **extra}


def test_wandb_without_login_is_one_line_before_the_run_dir_exists(tmp_path):
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "debug=fast", "logger=wandb",
                        f"hydra.run.dir={run}", f"paths.log_dir={tmp_path}/logs"], cwd=tmp_path,
                       env=no_login_env(tmp_path / "home"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "vitpipe: error: logger.wandb: no W&B API key found (WANDB_API_KEY, ~/.netrc); run `wandb login`, "
        "or set WANDB_MODE=offline to log offline (`wandb sync` uploads the run later)"], r.stderr[-2000:]
    assert not run.exists() and not (tmp_path / "wandb").exists()


CHECK = textwrap.dedent("""
    import sys
    from hydra import compose, initialize_config_dir
    from vitpipe.errors import ConfigError
    from vitpipe.config.checks import check_wandb_login

    with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
        cfg = compose("train", overrides=sys.argv[2:])
    try:
        check_wandb_login(cfg)
        print("ok")
    except ConfigError as e:
        print(e)
""")


@pytest.mark.slow  # 7 subprocesses of ~9 s (wandb.init itself): .ci/run runs it after the default suite
@pytest.mark.parametrize("overrides, env, passes", [
    (["logger=wandb"], {}, False),
    (["logger=[csv,wandb]"], {}, False),
    (["logger=wandb"], {"WANDB_MODE": "offline"}, True),
    (["logger=wandb"], {"WANDB_MODE": "disabled"}, True),
    (["logger=wandb", "logger.wandb.offline=true"], {}, True),
    (["logger=wandb"], {"WANDB_API_KEY": "0123456789abcdef" * 2 + "01234567"}, True),  # 40 characters
    (["logger=csv"], {}, True),
], ids=["no-key", "no-key-with-csv", "WANDB_MODE-offline", "WANDB_MODE-disabled", "logger-offline", "api-key",
        "no-wandb"])
def test_wandb_login_check_reads_what_wandb_init_reads(tmp_path, overrides, env, passes):
    r = subprocess.run([sys.executable, "-c", CHECK, str(ROOT / "conf"), *overrides],
                       env=no_login_env(tmp_path / "home", **env), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.strip()
    assert (out == "ok") if passes else ("run `wandb login`, or set WANDB_MODE=offline" in out), out


class _Recorder(CSVLogger):
    statuses: list[str] = []

    def finalize(self, status: str) -> None:
        type(self).statuses.append(status)


def test_finish_loggers_passes_the_status_on(tmp_path, monkeypatch):
    import wandb

    finished = []
    monkeypatch.setattr(wandb, "run", object())  # a run in progress
    monkeypatch.setattr(wandb, "finish", lambda exit_code=None, **kw: finished.append(exit_code))
    _Recorder.statuses = []
    loggers = [_Recorder(tmp_path), WandbLogger(offline=True, save_dir=str(tmp_path))]
    finish_loggers(loggers, "failed")
    finish_loggers(loggers, "success")
    assert _Recorder.statuses == ["failed", "success"] and finished == [1, 0]


@pytest.mark.parametrize("fails", [True, False])
def test_train_tells_the_loggers_whether_it_failed(cfg_factory, monkeypatch, fails):
    from vitpipe.tasks.train import train

    def fit(self, *args, **kwargs):
        if fails:
            raise RuntimeError("the run broke")

    statuses = []
    monkeypatch.setattr(lightning.Trainer, "fit", fit)
    monkeypatch.setattr(CSVLogger, "finalize", lambda self, status: statuses.append(status))
    cfg = cfg_factory("debug=fast", "logger=csv", "test=false")
    if fails:
        with pytest.raises(RuntimeError, match="the run broke"):
            train(cfg)
    else:
        train(cfg)
    assert statuses == ["failed" if fails else "success"]


def test_the_login_check_leaves_wandbs_settings_to_wandb_init(cfg_factory, monkeypatch):
    """The check must not create wandb's process singleton: it freezes the environment of that
    moment, and a later wandb.init (WANDB_MODE=offline after a disabled check) would not log."""
    wandb_setup = pytest.importorskip("wandb.sdk.wandb_setup")
    from vitpipe.config.checks import check_wandb_login

    monkeypatch.setattr(wandb_setup, "_singleton", None)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    check_wandb_login(cfg_factory("debug=fast", "logger=[csv,wandb]"))
    assert wandb_setup._singleton is None


def test_a_failure_before_fit_finishes_the_loggers_as_failed(cfg_factory, monkeypatch):
    """The loggers exist from the start of train(); a failure building the data or model, or reading
    the checkpoint to resume, still closes them as failed."""
    import vitpipe.tasks.train
    from vitpipe.errors import ConfigError

    def build(cfg, **_):  # train passes the data module it checked first (dm=)
        raise ConfigError("data.root=/nowhere: no such folder")

    statuses = []
    monkeypatch.setattr(vitpipe.tasks.train, "build_from_config", build)
    monkeypatch.setattr(CSVLogger, "finalize", lambda self, status: statuses.append(status))
    with pytest.raises(ConfigError, match="no such folder"):
        vitpipe.tasks.train.train(cfg_factory("debug=fast", "logger=csv", "test=false"))
    assert statuses == ["failed"]


class _Broken(CSVLogger):
    def finalize(self, status: str) -> None:
        raise OSError(28, "No space left on device")


def test_a_logger_that_cannot_finish_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    import wandb

    def finish(exit_code=None):
        raise ConnectionError("wandb is down")

    monkeypatch.setattr(wandb, "run", object())
    monkeypatch.setattr(wandb, "finish", finish)
    _Recorder.statuses = []
    # neither stops the others from finishing, nor masks the run's own outcome by raising
    finish_loggers([_Broken(tmp_path), WandbLogger(offline=True, save_dir=str(tmp_path)), _Recorder(tmp_path)], "failed")
    assert _Recorder.statuses == ["failed"]
    assert capsys.readouterr().err.splitlines() == [
        "vitpipe: warning: logger _Broken did not finish (status failed): No space left on device",
        "vitpipe: warning: logger WandbLogger did not finish (status failed): wandb is down"]


@pytest.mark.parametrize("how", ["nan-loss", "sigterm", "success"])
def test_wandb_records_the_runs_exit_code(cfg_factory, wandb_offline, how):
    """End to end, in wandb's own record of an offline run: a run that stops on a NaN loss or is
    pre-empted (SIGTERM, what Ctrl-C is relayed as) is finished with exit code 1 (wandb shows it as
    failed), a run that completes with 0."""
    wandb = pytest.importorskip("wandb")
    from vitpipe.lit.nonfinite import NonFiniteLossError
    from vitpipe.tasks.train import train

    stop = {"nan-loss": ["+callbacks.nan._target_=fault_injection.NaNLossOnRank", "+callbacks.nan.rank=0",
                         "+callbacks.nan.step=1"],
            "sigterm": ["+callbacks.kill._target_=fault_injection.SignalAtStep", "+callbacks.kill.step=1"],
            "success": []}[how]
    cfg = cfg_factory("debug=fast", "logger=[csv,wandb]", "test=false", "trainer.limit_train_batches=2", *stop)
    if how == "success":
        train(cfg)
    else:
        with pytest.raises(NonFiniteLossError if how == "nan-loss" else SystemExit):
            train(cfg)
    assert wandb.run is None
    (log,) = (Path(cfg.paths.output_dir) / "wandb").glob("offline-run-*/logs/debug.log")
    assert f"got exitcode: {0 if how == 'success' else 1}" in log.read_text()
