"""hydra/launcher=slurm: the job shape derived from the trainer, the checks before submission, and
(marked ``slurm``) real jobs on the one-node cluster of tests/cluster/slurm.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from vitpipe.config.launcher import launcher_problem

ROOT = Path(__file__).resolve().parents[1]


def launcher(cfg) -> dict:
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


@pytest.mark.parametrize("trainer, extra, tasks, gpus, nodes", [
    ("cpu", [], 1, None, 1),
    ("ddp_cpu", [], 2, None, 1),
    ("gpu", [], 1, 1, 1),
    ("default", [], 1, 1, 1),
    ("ddp", ["trainer.devices=4", "trainer.num_nodes=2"], 4, 4, 2),
])
def test_the_slurm_job_shape_follows_every_trainer(cfg_factory, trainer, extra, tasks, gpus, nodes):
    cfg = cfg_factory("hydra/launcher=slurm", f"trainer={trainer}", *extra)
    job = launcher(cfg)
    assert (job["tasks_per_node"], job["gpus_per_node"], job["nodes"]) == (tasks, gpus, nodes)
    assert 0 < job["signal_delay_s"] < job["timeout_min"] * 60


@pytest.mark.parametrize("timeout_min, delay", [(1440, 120), (10, 120), (2, 30), (1, 15)])
def test_the_default_signal_delay_stays_inside_the_time_limit(cfg_factory, timeout_min, delay):
    cfg = cfg_factory("hydra/launcher=slurm", "trainer=cpu", f"hydra.launcher.timeout_min={timeout_min}")
    assert launcher(cfg)["signal_delay_s"] == delay


def test_a_job_shape_that_cannot_work_is_refused_before_submission(cfg_factory, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")  # as on a login node
    cfg = cfg_factory("hydra/launcher=slurm", "trainer=ddp")  # devices: -1
    assert "trainer.devices=-1" in launcher_problem(cfg) and "trainer.devices=4" in launcher_problem(cfg)
    cfg = cfg_factory("hydra/launcher=slurm", "trainer=cpu", "hydra.launcher.timeout_min=1",
                      "hydra.launcher.signal_delay_s=120")
    assert "signal_delay_s=120" in launcher_problem(cfg) and "60 s" in launcher_problem(cfg)
    cfg = cfg_factory("hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2")
    assert launcher_problem(cfg) is None
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "sbatch, which is not on PATH" in launcher_problem(cfg)


# --------------------------------------------------------------------------- a real cluster

TINY = ["trainer=cpu", "debug=fast", "trainer.limit_val_batches=1", "test=false",
        "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=0",
        "callbacks.progress_bar.refresh_rate=1000", "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=1"]
ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT / "tests")}


@pytest.fixture(scope="session")
def slurm():
    """The one-node cluster of tests/cluster/slurm.sh (started if needed; left running for the next
    test run, `tests/cluster/slurm.sh stop` stops it). Skips where it cannot run."""
    if os.geteuid() != 0:
        pytest.skip("the SLURM daemons need root (tests/cluster/slurm.sh start)")
    r = subprocess.run(["bash", str(ROOT / "tests/cluster/slurm.sh"), "start"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 3:
        pytest.skip(f"no SLURM here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    conf = subprocess.run(["bash", str(ROOT / "tests/cluster/slurm.sh"), "env"], capture_output=True, text=True,
                          check=True).stdout.strip().removeprefix("export SLURM_CONF=")
    return {"SLURM_CONF": conf}


def sweep(slurm, tmp_path, *overrides, timeout=240, background=False):
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "-m", "hydra/launcher=slurm", *TINY, *overrides]
    env = {**os.environ, **ENV, **slurm}
    if background:
        return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def squeue(slurm) -> list[tuple[str, str]]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, **slurm}).stdout
    return [tuple(line.split()) for line in out.splitlines() if line.strip()]


def weights(run_dir: Path) -> dict:
    import torch

    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}


def local_run(tmp_path, name, *overrides):
    r = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), *TINY[:-2], *overrides,
                        f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path, env={**os.environ, **ENV},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp_path / name


@pytest.mark.slurm
def test_a_sweep_of_two_jobs_runs_through_slurm_and_writes_its_summary(slurm, tmp_path):
    r = sweep(slurm, tmp_path, "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Submitit 'slurm' sweep output dir" in r.stdout + r.stderr
    summary = (tmp_path / "sweep" / "summary.csv").read_text().splitlines()
    assert len(summary) == 3 and all(row.endswith(",done") for row in summary[1:]), summary
    for job in (0, 1):  # each job ran as a SLURM job, in its own numbered directory
        assert (tmp_path / "sweep" / str(job) / "checkpoints" / "last.ckpt").is_file()
    assert list((tmp_path / "sweep" / ".submitit").glob("*_0/*_0_log.out"))


@pytest.mark.slurm
def test_a_two_task_job_gets_ranks_0_and_1_and_trains_as_one_process(slurm, tmp_path):
    common = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "data.shuffle=false", "data.augment=false",
              "trainer.deterministic=true"]
    r = sweep(slurm, tmp_path, *common, "trainer=ddp_cpu", "data.batch_size=8", f"hydra.sweep.dir={tmp_path / 'ddp'}")
    assert r.returncode == 0, r.stderr[-3000:]
    logs = "".join(p.read_text() for p in (tmp_path / "ddp" / ".submitit").glob("*/*_log.err"))
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in logs and "GLOBAL_RANK: 1, MEMBER: 2/2" in logs
    one = local_run(tmp_path, "one", *common, "data.batch_size=16")
    a, b = weights(tmp_path / "ddp" / "0"), weights(one)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.slurm
def test_a_cancelled_job_is_reported_and_the_other_jobs_finish(slurm, tmp_path):
    proc = sweep(slurm, tmp_path, "trainer.max_epochs=1,2000", "+callbacks.pace._target_=pace.Pace",
                 "+callbacks.pace.seconds=0.05", f"hydra.sweep.dir={tmp_path / 'sweep'}", background=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not any(j.endswith("_1") and s == "RUNNING" for j, s in squeue(slurm)):
            time.sleep(1)
        job = next(j for j, s in squeue(slurm) if j.endswith("_1"))
        time.sleep(3)
        subprocess.run(["scancel", job], env={**os.environ, **slurm}, check=True, timeout=30)
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert f"SLURM job {job} ended CANCELLED without a result" in err
    assert "1 of 2 job(s) finished" in err and "Traceback" not in err
    rows = (tmp_path / "sweep" / "summary.csv").read_text().splitlines()
    assert rows[1].endswith(",done") and rows[2].endswith(",cancelled"), rows


# pre-emption: the job runs paced (0.4 s per step: long enough to be interrupted, the numbers unchanged)
# with drop path and mixup/cutmix on, so an exact resume needs the random generators' state too
RANDOM = ["model.depth=2", "model.drop_path_rate=0.1", "module.mixup={mixup_alpha:0.8,cutmix_alpha:1.0}"]
LONG = ["trainer.max_epochs=1", "trainer.limit_train_batches=120", "data.batch_size=8", "trainer.deterministic=true",
        *RANDOM]
PACED = ["+callbacks.pace._target_=pace.Pace", "+callbacks.pace.seconds=0.4"]


def _job_logs(sweep_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((sweep_dir / ".submitit").glob("*/*_log.*")))


def _restarts(slurm, job_id: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30,
                         env={**os.environ, **slurm}).stdout
    found = [int(w.split("=")[1]) for w in out.split() if w.startswith("Restarts=")]
    return found[0] if found else -1


def _assert_resumed_to_the_uninterrupted_weights(tmp_path, sweep_dir: Path) -> str:
    logs = _job_logs(sweep_dir)
    resumed = [ln for ln in logs.splitlines() if "vitpipe: resuming from" in ln]
    assert len(resumed) >= 1 and "ckpt_path=auto: this run directory holds" in logs, logs[-4000:]
    step = int(resumed[0].rsplit("global step", 1)[1])
    assert 0 < step < 120, resumed
    reference = local_run(tmp_path, "uninterrupted", *LONG)
    a, b = weights(sweep_dir / "0"), weights(reference)
    assert [k for k in a if not __import__("torch").equal(a[k], b[k])] == [], "not bit-identical"
    return resumed[0]


@pytest.mark.slurm
def test_a_job_at_its_time_limit_saves_is_requeued_and_resumes_to_the_same_weights(slurm, tmp_path):
    """timeout_min=1: SLURM sends submitit's USR2 15 s before the limit; vitpipe finishes the batch,
    writes last.ckpt, then lets submitit requeue the job, which resumes with ckpt_path=auto."""
    sweep_dir = tmp_path / "sweep"
    r = sweep(slurm, tmp_path, *LONG, *PACED, "hydra.launcher.timeout_min=1", f"hydra.sweep.dir={sweep_dir}",
              timeout=420)
    assert r.returncode == 0, r.stderr[-3000:] + _job_logs(sweep_dir)[-3000:]
    logs = _job_logs(sweep_dir)
    assert "Caught signal SIGUSR2" in logs and "timed-out" in logs, logs[-3000:]
    _assert_resumed_to_the_uninterrupted_weights(tmp_path, sweep_dir)


@pytest.mark.slurm
def test_scontrol_requeue_mid_run_resumes_to_the_same_weights(slurm, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = sweep(slurm, tmp_path, *LONG, *PACED, f"hydra.sweep.dir={sweep_dir}", background=True)
    try:
        last = sweep_dir / "0" / "checkpoints"
        deadline = time.time() + 180
        while time.time() < deadline and not (sweep_dir.exists() and "ckpt_path=auto" in _job_logs(sweep_dir)):
            time.sleep(1)
        time.sleep(15)  # some steps into the epoch
        (job,) = [j for j, s in squeue(slurm) if s == "RUNNING"]
        subprocess.run(["scontrol", "requeue", job], env={**os.environ, **slurm}, check=True, timeout=30)
        out, err = proc.communicate(timeout=420)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:] + _job_logs(sweep_dir)[-3000:]
    assert _restarts(slurm, job) == 1
    assert not last.joinpath("last-v1.ckpt").exists()
    _assert_resumed_to_the_uninterrupted_weights(tmp_path, sweep_dir)
