"""Real faults on real runs: kill -9, Ctrl-C, SIGTERM during test, stale temp files, the umask, a
full disk, FSDP checkpoints. The subprocess runs are shared by a module fixture and run side by side.

The uninterrupted, Ctrl-C'd and kill -9'd runs train the same tiny model for 2 epochs of 4 steps
with ``last.ckpt`` also written every 3 steps (3, 4 = end of epoch 0, 6, 8), drawing from every
global generator a real run draws from (``RANDOM``: drop path from torch's, mixup/cutmix from numpy's),
so "the same weights as an uninterrupted run" holds only if a resume restores those streams too. ``WaitAtStep`` holds a
run at a step until the test has signalled it from outside, so each signal lands at a known step.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from test_scale import RANDOM, TINY, _last, _net  # the resume tests' settings and readers

from vitpipe.tasks.cli import EXIT_DISK_FULL, run_cli
from vitpipe.tasks.train import train

ROOT = Path(__file__).resolve().parents[1]
COMMON = [*TINY, "logger=none", "trainer.max_epochs=2", "trainer.limit_train_batches=4", "data.batch_size=16",
          "trainer.deterministic=true", *RANDOM, "callbacks.model_checkpoint.last_every_n_train_steps=3",
          # the rest of the recipes' stochastic defaults: an EMA of the weights (fmnist_vit's DeiT settings
          # name it) and random erasing, so an exact resume must restore the EMA copy and the erasing draws too
          "module.ema_decay=0.9", "data.random_erasing=0.25"]
UMASK = 0o027  # neither mkstemp's 0600 nor the usual 0644: the files must follow it


class WaitAtStep(L.Callback):
    """After optimizer step ``step``: touch ``marker``, then wait (up to 2 min) for a signal."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, Path(marker)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        self.marker.touch()
        deadline = time.monotonic() + 120
        while not trainer.received_sigterm and time.monotonic() < deadline:  # a kill -9 ends it here
            time.sleep(0.02)


def _popen(*args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, umask=UMASK)


def _finish(p: subprocess.Popen, timeout: float = 600):
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _wait_for(marker: Path, p: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if p.poll() is not None:
            raise AssertionError(f"run ended (rc {p.returncode}) before step marker {marker.name}:\n"
                                 + p.stderr.read()[-3000:])
        assert time.monotonic() < deadline, f"no {marker.name} after {timeout} s"
        time.sleep(0.05)


def _held_at(step: int, marker: Path) -> list[str]:
    return ["+callbacks.wait._target_=test_faults.WaitAtStep", f"+callbacks.wait.step={step}",
            f"+callbacks.wait.marker={marker}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One uninterrupted run, one Ctrl-C'd at step 5 and one kill -9'd at step 7, then both resumed."""
    tmp = tmp_path_factory.mktemp("faults")
    r = {"tmp": tmp}
    full = _popen(*COMMON, f"hydra.run.dir={tmp / 'full'}")
    runs_dir = {k: tmp / k / "logs" / "debug" / "runs" for k in ("int", "kill")}
    int_a = _popen(*COMMON, f"paths.log_dir={tmp / 'int' / 'logs'}", f"hydra.run.dir={runs_dir['int'] / 'a'}",
                   *_held_at(5, tmp / "int.step5"))
    kill_a = _popen(*COMMON, f"paths.log_dir={tmp / 'kill' / 'logs'}", f"hydra.run.dir={runs_dir['kill'] / 'a'}",
                    *_held_at(7, tmp / "kill.step7"))
    _wait_for(tmp / "int.step5", int_a)
    int_a.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends
    _wait_for(tmp / "kill.step7", kill_a)
    kill_a.kill()  # SIGKILL: no handler runs, nothing is saved
    r["int_a"], r["kill_a"] = _finish(int_a), _finish(kill_a)
    r["int_last"], r["kill_last"] = _last(runs_dir["int"] / "a"), _last(runs_dir["kill"] / "a")

    # temp files a killed save leaves: the resumed run removes those whose writer is gone
    ckpt_dir = runs_dir["kill"] / "a" / "checkpoints"
    host = socket.gethostname()
    r["stale"] = [ckpt_dir / ".last.ckpt.tmp-xyz", ckpt_dir / f".last.ckpt.tmp-{host}-{kill_a.pid}-abcd1234"]
    r["live"] = ckpt_dir / f".last.ckpt.tmp-{host}-{os.getpid()}-live0001"  # a save in progress: kept
    for p in [*r["stale"], r["live"]]:
        p.write_bytes(b"half a checkpoint")

    int_b = _popen(*COMMON, f"paths.log_dir={tmp / 'int' / 'logs'}", f"hydra.run.dir={runs_dir['int'] / 'b'}",
                   "ckpt_path=last")
    kill_b = _popen(*COMMON, f"paths.log_dir={tmp / 'kill' / 'logs'}", f"hydra.run.dir={runs_dir['kill'] / 'b'}",
                    "ckpt_path=last")
    r["full"], r["int_b"], r["kill_b"] = _finish(full), _finish(int_b), _finish(kill_b)
    for k in ("full", "int_b", "kill_b"):
        assert r[k].returncode == 0, f"{k}: {r[k].stderr[-3000:]}"
    r["full_dir"], r["int_b_dir"], r["kill_b_dir"] = tmp / "full", runs_dir["int"] / "b", runs_dir["kill"] / "b"
    r["kill_ckpt_dir"] = ckpt_dir
    return r


def _equal_weights(a: dict, b: dict, *, ema: bool = False) -> list[str]:
    """Names of the network tensors, and of the EMA copy's where the run keeps one, that differ
    (torch.equal: bit for bit); ``ema=True``: the runs must keep an EMA copy."""
    wa, wb = a["state_dict"], b["state_dict"]
    assert wa.keys() == wb.keys() and _net(a), sorted(wa)[:5]
    assert not ema or any(k.startswith("ema.") for k in wa), f"no EMA copy in {sorted(wa)[:5]}"
    return [k for k in wa if not torch.equal(wa[k], wb[k])]


@pytest.mark.slow  # the shared interrupted CLI runs (~40 s): .ci/run runs it after the default suite
def test_ctrl_c_saves_last_at_the_interrupted_step_and_resumes_to_the_same_weights(runs):
    a = runs["int_a"]
    assert a.returncode == 128 + signal.SIGINT, a.stderr[-3000:]  # 130, as a shell reports Ctrl-C
    assert runs["int_last"]["global_step"] == 5  # mid-way through epoch 1, not the step-3/4 save
    stop = [line for line in a.stderr.splitlines() if line.startswith("vitpipe: stopped")]
    assert len(stop) == 1 and "SIGINT at global step 5" in stop[0] and "ckpt_path=last" in stop[0], a.stderr[-2000:]
    assert "Traceback" not in a.stderr
    assert "resuming from" in runs["int_b"].stdout and "global step 5" in runs["int_b"].stdout
    full, resumed = _last(runs["full_dir"]), _last(runs["int_b_dir"])
    assert full["global_step"] == resumed["global_step"] == 8
    assert _equal_weights(full, resumed, ema=True) == []


@pytest.mark.slow  # the shared interrupted CLI runs (~40 s): .ci/run runs it after the default suite
def test_kill_9_mid_epoch_resumes_from_the_last_saved_step(runs):
    assert runs["kill_a"].returncode == -signal.SIGKILL
    assert runs["kill_last"]["global_step"] == 6  # the every-3-steps save, mid-way through epoch 1
    out = runs["kill_b"].stdout
    assert "vitpipe: resuming from" in out and "at epoch 1, global step 6" in out, out[-2000:]
    assert _last(runs["kill_b_dir"])["global_step"] == 8
    for d in (runs["kill_ckpt_dir"], runs["kill_b_dir"] / "checkpoints"):
        left = [p.name for p in d.glob(".*.tmp-*") if p != runs["live"]]
        assert left == [], f"temp files left in {d}: {left}"


@pytest.mark.slow  # the shared interrupted CLI runs (~40 s): .ci/run runs it after the default suite
def test_stale_temp_files_are_removed_on_resume_and_a_live_writers_file_is_kept(runs):
    assert runs["stale"] and not any(p.exists() for p in runs["stale"])
    assert runs["live"].exists()  # its writer (this pytest process) is alive: maybe a save in progress


@pytest.mark.slow  # the shared interrupted CLI runs (~40 s): .ci/run runs it after the default suite
def test_resume_from_a_step_checkpoint_equals_an_uninterrupted_run(runs):
    assert _equal_weights(_last(runs["full_dir"]), _last(runs["kill_b_dir"]), ema=True) == []


@pytest.mark.slow  # the shared interrupted CLI runs (~40 s): .ci/run runs it after the default suite
def test_checkpoints_and_run_files_follow_the_umask(runs):
    files = [runs["full_dir"] / "checkpoints" / "last.ckpt", runs["full_dir"] / "config.yaml",
             runs["int_b_dir"].parent / "a" / "checkpoints" / "last.ckpt"]  # the last one: the Ctrl-C save
    modes = [oct(p.stat().st_mode & 0o777) for p in files]
    assert modes == [oct(0o666 & ~UMASK)] * len(files)  # 0o640


# ---- in process: a finished run whose best epoch came first, then SIGTERM during its test -------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_last_ckpt_holds_the_final_step_when_the_best_epoch_was_earlier_and_a_stop_in_test_claims_nothing(
        cfg_factory, capsys, signum):
    # monitor=step, mode=min: the first epoch is the best for sure (with val/acc it is chance)
    cfg = cfg_factory("debug=fast", "logger=none", "trainer.max_epochs=3", "callbacks.model_checkpoint.monitor=step",
                      "callbacks.model_checkpoint.mode=min", "callbacks.progress_bar.refresh_rate=1000",
                      "+callbacks.kill._target_=fault_injection.SignalAtStep", "+callbacks.kill.stage=test",
                      "+callbacks.kill.step=0", f"+callbacks.kill.signum={int(signum)}")
    with pytest.raises(SystemExit) as stop:
        run_cli(train, cfg)
    ckpts = Path(cfg.paths.output_dir) / "checkpoints"
    best, last = torch.load(ckpts / "epoch_000.ckpt", weights_only=True), torch.load(ckpts / "last.ckpt",
                                                                                      weights_only=True)
    assert best["global_step"] == 2 and sorted(p.name for p in ckpts.iterdir()) == ["epoch_000.ckpt", "last.ckpt"]
    assert last["global_step"] == 6 and last["epoch"] == 2  # 3 epochs x 2 steps: the final state

    assert stop.value.code == 128 + signum
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("vitpipe: stopped")]
    want = f"vitpipe: stopped by {signum.name} during test; no checkpoint was written by the stop"
    assert lines == [want], err[-2000:]


class CtrlCTwice(L.Callback):
    """At optimizer step ``step``: Ctrl-C twice, before the first one reaches the batch boundary."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)  # let the handler run in between


def test_ctrl_c_twice_stops_at_once_without_saving(cfg_factory, capsys):
    cfg = cfg_factory("debug=fast", "logger=none", "test=false", "callbacks.progress_bar.refresh_rate=1000",
                      "+callbacks.twice._target_=test_faults.CtrlCTwice", "+callbacks.twice.step=1")
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stop:
        run_cli(train, cfg)
    assert stop.value.code == 128 + signal.SIGINT
    assert "vitpipe: interrupted by SIGINT (pressed twice" in capsys.readouterr().err
    assert not list((Path(cfg.paths.output_dir) / "checkpoints").glob("*.ckpt"))  # step 1 of 2: nothing saved
    assert signal.getsignal(signal.SIGINT) is before  # the handler is given back


# ---- a full disk ------------------------------------------------------------------------------------


@pytest.mark.slow  # the shared interrupted CLI runs (~40 s): .ci/run runs it after the default suite
def test_full_disk_names_the_path_in_one_line_and_the_earlier_checkpoint_still_loads(runs, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    size = (runs["full_dir"] / "checkpoints" / "last.ckpt").stat().st_size  # the same tiny model (RANDOM's depth)
    # room for epoch 0's best and last (2 checkpoints) and the run's small files, not for a third
    quota = 2 * size + 64 * 1024
    assert 3 * size > quota
    mnt = tmp_path / "small"
    mnt.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={quota}", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        r = _finish(_popen("debug=fast", *RANDOM, "logger=none", "test=false", "trainer.max_epochs=2",
                           "callbacks.model_checkpoint.monitor=step", "callbacks.model_checkpoint.mode=min",
                           "callbacks.progress_bar.refresh_rate=1000", f"hydra.run.dir={mnt / 'run'}"))
        ckpts = mnt / "run" / "checkpoints"
        assert r.returncode == EXIT_DISK_FULL, r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        lines = [x for x in r.stderr.splitlines() if x.startswith("vitpipe:")]
        assert len(lines) == 1, r.stderr[-3000:]
        assert f"No space left on device writing {ckpts / 'last.ckpt'}; earlier checkpoints are intact" in lines[0]
        assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 2  # epoch 0's, whole
        assert sorted(p.name for p in ckpts.iterdir()) == ["epoch_000.ckpt", "last.ckpt"]  # no temp file
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# ---- FSDP: full state dicts go through the atomic plugin --------------------------------------------


def test_fsdp_trainer_keeps_the_atomic_checkpoint_plugin(cfg_factory, tmp_path, monkeypatch):
    from hydra.utils import instantiate

    from vitpipe.lit.checkpointing import AtomicCheckpointIO

    cfg = cfg_factory("trainer=fsdp")
    assert [p["_target_"] for p in cfg.trainer.plugins] == ["vitpipe.lit.checkpointing.AtomicCheckpointIO"]
    assert cfg.trainer.strategy.state_dict_type == "full"
    # Lightning's accelerator connector hands the plugin to the strategy (FSDP itself needs GPUs)
    strategy = instantiate(cfg.trainer.strategy)
    strategy.checkpoint_io = instantiate(cfg.trainer.plugins[0])
    assert isinstance(strategy.checkpoint_io, AtomicCheckpointIO)
    path = tmp_path / "last.ckpt"
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, path)

    def dying_save(obj, f, *a, **k):
        f.write(b"half")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        strategy.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


# ---- Lightning's "dataloader is not resumable" warning on a vitpipe resume --------------------------

NOT_RESUMABLE = "dataloader is not resumable"  # Lightning's training_epoch_loop, on a mid-epoch restart


def _not_resumable(record) -> list[str]:
    return [str(w.message) for w in record if NOT_RESUMABLE in str(w.message)]


def test_step_checkpoint_resume_has_no_not_resumable_warning_and_stays_exact(cfg_factory, recwarn, capsys):
    """Stopped by SIGTERM at step 5 (mid-way through epoch 1 of 4-step epochs) and resumed: vitpipe's
    data state starts the loader after the epoch's first batch, so Lightning's "not resumable ...
    unreliable results" is wrong there and not shown, and the weights equal an uninterrupted run's bit
    for bit. So do they stopped at step 4, the end of epoch 0: there the uninterrupted run makes the
    next epoch's loader iterator after the save, the resumed one before restoring its generators.
    The step-5 checkpoint without vitpipe's data state keeps the warning; without the random
    generators' state the resumed run says in one line that its random streams start fresh."""
    quiet = ["callbacks.progress_bar.refresh_rate=1000", "callbacks.model_checkpoint.last_every_n_train_steps=null"]
    common = [*COMMON, *quiet]
    # each run directory is read at once: paths.output_dir resolves against the config composed last
    full = cfg_factory(*common, sub="full")
    full_dir = Path(full.paths.output_dir)
    train(full)
    final = _last(full_dir)
    assert final["global_step"] == 8
    for step in (5, 4):
        stopped = cfg_factory(*common, "+callbacks.kill._target_=fault_injection.SignalAtStep",
                              f"+callbacks.kill.step={step}", sub=f"stopped{step}")
        stopped_dir = Path(stopped.paths.output_dir)
        with pytest.raises(SystemExit) as stop:
            run_cli(train, stopped)
        assert stop.value.code == 128 + signal.SIGTERM
        ckpt = stopped_dir / "checkpoints" / "last.ckpt"
        saved = torch.load(ckpt, weights_only=True)
        assert saved["global_step"] == step and saved["epoch"] == 1
        assert saved["DigitsDataModule"]["batches_done_in_epoch"] == step - 4  # vitpipe's position in the epoch

        recwarn.clear()
        capsys.readouterr()
        resumed = cfg_factory(*common, f"ckpt_path={ckpt}", sub=f"resumed{step}")
        resumed_dir = Path(resumed.paths.output_dir)
        train(resumed)
        assert _not_resumable(recwarn) == [] and "start fresh" not in capsys.readouterr().out
        assert resumed_dir != full_dir and _last(resumed_dir)["global_step"] == 8
        assert _equal_weights(final, _last(resumed_dir)) == [], f"stopped at step {step}"
        if step == 5:
            step5 = saved

    bare = Path(cfg_factory(*common, sub="bare").paths.output_dir) / "no_data_state.ckpt"
    bare.parent.mkdir(parents=True)
    # as from a data path without ResumeState and an older vitpipe
    torch.save({k: v for k, v in step5.items() if k not in ("DigitsDataModule", "rng_states")}, bare)
    recwarn.clear()
    train(cfg_factory(*common, f"ckpt_path={bare}", sub="bare"))
    assert len(_not_resumable(recwarn)) == 1
    fresh = [line for line in capsys.readouterr().out.splitlines() if "start fresh" in line]
    assert fresh == ["vitpipe: the checkpoint holds no random-generator state: the random streams (drop path, "
                     "dropout, mixup) start fresh, so the run continues but not bit-identically to one that "
                     "never stopped"]
    assert _equal_weights(final, _last(bare.parent)) != []  # the streams did start elsewhere


@pytest.mark.slow  # the shared interrupted CLI runs (~40 s): .ci/run runs it after the default suite
def test_resumed_cli_runs_print_no_not_resumable_warning(runs):
    """The Ctrl-C'd (step 5) and kill -9'd (step 6) runs resume mid-epoch through scripts/train.py,
    exactly (the tests above): Lightning's warning that they would not is not printed."""
    for k in ("int_b", "kill_b"):
        assert NOT_RESUMABLE not in runs[k].stderr + runs[k].stdout, runs[k].stderr[-2000:]
