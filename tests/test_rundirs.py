"""One directory per run, whatever the timing; ``ckpt_path=last`` says which run it took and passes
over runs that are still being written. Real runs through ``scripts/train.py``."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from user_shell import SHORT_TRAIN, fresh_checkout, popen, run, run_dir_of

from vitpipe.errors import ConfigError
from vitpipe.run.dirs import is_live, live, unique_dir
from vitpipe.run.paths import resolve_ckpt_path


def test_unique_dir_claims_each_name_once(tmp_path):
    base = str(tmp_path / "runs" / "2026-01-01_00-00-00")
    got = [unique_dir(base) for _ in range(3)]
    assert got == [base, base + "_1", base + "_2"]
    assert all((tmp_path / "runs" / name).is_dir() for name in ("2026-01-01_00-00-00", "2026-01-01_00-00-00_2"))


def test_two_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    """Two real runs at once. So that the test does not depend on their timing, every second-named
    folder of the next two minutes is taken beforehand (as a run started in that second would have):
    each run must claim a name of its own (`<time>_1`, `<time>_2`), never write into a taken one."""
    home = fresh_checkout(tmp_path / "work")
    runs = home / "logs" / "train" / "runs"
    start = datetime.now()
    taken = {(start + timedelta(seconds=s)).strftime("%Y-%m-%d_%H-%M-%S") for s in range(120)}
    for name in taken:
        (runs / name).mkdir(parents=True)
    procs = [popen(["python", "scripts/train.py", *SHORT_TRAIN], home) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    dirs = [run_dir_of(out) for out, _ in outs]
    assert dirs[0] != dirs[1]
    for d in dirs:
        assert d.parent == runs and d.name not in taken and d.name.rsplit("_", 1)[0] in taken, d
        assert json.loads((d / "metrics.json").read_text())["test/acc"] >= 0
        assert (d / "checkpoints" / "last.ckpt").is_file()
        rows = list(csv.DictReader((d / "csv" / "metrics.csv").open()))
        assert [r["step"] for r in rows if r["test/acc"]] == ["2"]  # one run's rows only: one test, at step 2
        assert len([r for r in rows if r["val/acc"]]) == 1
        assert "config.yaml" in {p.name for p in d.iterdir()}
    assert all(not any((runs / name).iterdir()) for name in taken)  # the taken folders stay untouched


def _hold(run_dir) -> subprocess.Popen:
    """Another process holding run_dir's live mark, as a training run does."""
    code = ("import sys, time; from vitpipe.run.dirs import live\n"
            "with live(sys.argv[1]):\n    print('held', flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_last_passes_over_a_live_run_and_names_what_it_took(tmp_path, capsys):
    import torch

    logs = tmp_path / "logs" / "train"
    done, sweep_job, running = logs / "runs" / "a", logs / "multiruns" / "s" / "0", logs / "runs" / "b"
    for i, run_dir in enumerate((done, sweep_job, running)):
        (run_dir / "checkpoints").mkdir(parents=True)
        torch.save({"state_dict": {}}, run_dir / "checkpoints" / "last.ckpt")
        t = time.time() + i  # a older than the sweep job, the live run newest
        import os

        os.utime(run_dir / "checkpoints" / "last.ckpt", (t, t))
    (sweep_job.parent / "multirun.yaml").write_text("{}\n")
    holder = _hold(running)
    try:
        assert is_live(running) and not is_live(done)
        got = resolve_ckpt_path("last", log_dir=logs, which="last")
        assert got == sweep_job / "checkpoints" / "last.ckpt"
        said = capsys.readouterr().out
        assert f"-> run {sweep_job}, job 0 of the sweep {sweep_job.parent}" in said
        assert f"passed over 1 run(s) still running, newest {running}" in said
        (sweep_job / "checkpoints" / "last.ckpt").unlink()
        assert resolve_ckpt_path("last", log_dir=logs, which="last") == done / "checkpoints" / "last.ckpt"
        (done / "checkpoints" / "last.ckpt").unlink()
        with pytest.raises(ConfigError, match=r"every run under .* is still running"):
            resolve_ckpt_path("last", log_dir=logs, which="last")
    finally:
        holder.kill()
        holder.wait()
    assert not is_live(running)  # a killed process leaves no live mark behind
    assert resolve_ckpt_path("last", log_dir=logs, which="last") == running / "checkpoints" / "last.ckpt"


@pytest.mark.slow  # 8-25 s of subprocesses: .ci/run runs it after the default suite
def test_a_training_run_is_live_until_its_process_ends(tmp_path):
    """A real run, stopped mid-training: while it trains `last` does not fork it; after kill -9 it does."""
    home = fresh_checkout(tmp_path / "work")
    first = run(["python", "scripts/train.py", *SHORT_TRAIN], home, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    finished = run_dir_of(first.stdout)
    p = popen(["python", "scripts/train.py", "trainer.max_epochs=50",
               "callbacks.model_checkpoint.last_every_n_train_steps=1"], home)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            newer = [d for d in (home / "logs" / "train" / "runs").iterdir()
                     if d != finished and (d / "checkpoints" / "last.ckpt").is_file()]
            if newer:
                break
            assert p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("the second run wrote no checkpoint in time")
        (busy,) = newer
        assert is_live(busy)
        resumed = run(["python", "scripts/train.py", "ckpt_path=last", "train=false", "test=false"], home)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        said = f"ckpt_path=last -> run {finished} (classifier); passed over 1 run(s) still running, newest {busy}"
        assert said in resumed.stdout
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    assert not is_live(busy)
    with live(finished):  # this process's own mark does not hide a run from itself
        assert not is_live(finished)


def test_ckpt_path_auto_resumes_the_run_directorys_own_checkpoint_and_starts_fresh_without_one(cfg_factory, capsys):
    """The default ckpt_path=auto: a run directory without a checkpoint trains from step 0 and says so;
    the same directory run again (a requeued SLURM job, a rerun into a fixed hydra.run.dir) continues
    from its last.ckpt, also from one the pre-emption save wrote mid-epoch (Lightning's version counter
    would have put the resumed run's state in last-v1.ckpt beside it); ckpt_path=null there is refused
    rather than writing a second run beside it."""
    import signal

    import torch

    from vitpipe.tasks.cli import run_cli
    from vitpipe.tasks.train import train

    tiny = ["debug=fast", "logger=none", "test=false", "trainer.limit_val_batches=1",
            "callbacks.progress_bar.refresh_rate=1000", "trainer.limit_train_batches=2"]
    cfg = cfg_factory(*tiny, "trainer.max_epochs=1", "+callbacks.kill._target_=fault_injection.SignalAtStep",
                      "+callbacks.kill.step=1")
    assert cfg.ckpt_path == "auto"
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as stop:  # SIGTERM after step 1 of 2: last.ckpt from the pre-emption save
        run_cli(train, cfg)
    assert stop.value.code == 128 + signal.SIGTERM
    out = capsys.readouterr().out
    assert f"ckpt_path=auto: no checkpoint in {cfg.paths.output_dir} yet; training from the start" in out
    assert torch.load(last, weights_only=True)["global_step"] == 1

    train(cfg_factory(*tiny, "trainer.max_epochs=1"))  # the same run directory again, as a requeued job
    out = capsys.readouterr().out
    assert f"ckpt_path=auto: this run directory holds {last}; resuming from it" in out
    assert f"resuming from {last} at epoch 0, global step 1" in out
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in last.parent.iterdir()) == ["epoch_000.ckpt", "last.ckpt"]

    train(cfg_factory(*tiny, "trainer.max_epochs=2"))  # asked for one more epoch: from the end of epoch 0
    assert f"resuming from {last} at epoch 0, global step 2" in capsys.readouterr().out
    assert torch.load(last, weights_only=True)["global_step"] == 4

    # ckpt_path=null into that directory would train afresh beside it (Lightning names the new files
    # last-v1.ckpt, leaving last.ckpt stale): refused in one line before anything trains
    with pytest.raises(ConfigError, match=r"ckpt_path=null, but .* already holds last.ckpt of an earlier run"):
        train(cfg_factory(*tiny, "trainer.max_epochs=1", "ckpt_path=null"))
    assert torch.load(last, weights_only=True)["global_step"] == 4
    assert sorted(p.name for p in last.parent.iterdir()) == ["epoch_000.ckpt", "last.ckpt"]
