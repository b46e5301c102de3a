"""hydra/launcher=slurm: the job shape derived from the trainer, the checks before submission, and
(marked ``slurm``) real jobs on the one-node cluster of tests/cluster/slurm.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from vitpipe.launcher_check import launcher_problem

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
