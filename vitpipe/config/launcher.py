"""The SLURM launcher's job shape, and checks of a multirun's launcher before Hydra hands it any job.

``conf/hydra/launcher/slurm.yaml`` derives the job from the trainer: one SLURM task per training
process (``slurm_tasks``), GPUs only where the trainer uses them (``slurm_gpus``), and a warning
signal early enough to save before the time limit (``slurm_signal_delay``). A launcher that cannot
start jobs from here, or a job shape that cannot work, stops the command with one line (exit 2)
before anything is submitted, instead of a traceback from inside the plugin or a job that fails
on the cluster hours later.
"""

from __future__ import annotations

import shutil
import sys

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

EXIT_CONFIG = 2
MAX_SIGNAL_DELAY_S = 120  # submitit's default warning time before the limit


def slurm_tasks(devices) -> int:
    """SLURM tasks per node: one per training process (Lightning's SLURMEnvironment gives each its rank).
    ``devices: -1`` / ``auto`` (all visible GPUs) cannot be counted from the login node: 1 here, and
    ``launcher_problem`` refuses it before submission."""
    try:
        return max(int(devices), 1)
    except (TypeError, ValueError):
        return 1


def slurm_gpus(accelerator, devices) -> int | None:
    """GPUs per node: none asked for when the trainer runs on CPU, else one per task."""
    return None if str(accelerator) == "cpu" else slurm_tasks(devices)


def slurm_signal_delay(timeout_min) -> int:
    """Seconds before the time limit that SLURM sends submitit's warning signal: 120 s, or a quarter
    of a shorter limit (a delay at or beyond the limit would fire the moment the job starts)."""
    return int(min(MAX_SIGNAL_DELAY_S, float(timeout_min) * 60 / 4))


def register_resolvers() -> None:
    for name, fn in (("slurm_tasks", slurm_tasks), ("slurm_gpus", slurm_gpus),
                     ("slurm_signal_delay", slurm_signal_delay)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _slurm_problem(config: DictConfig) -> str | None:
    import importlib.util

    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        return ("hydra/launcher=slurm needs hydra-submitit-launcher, which is not installed; "
                "pip install 'vitpipe[sweeps]' (or hydra-submitit-launcher)")
    if shutil.which("sbatch") is None:
        return ("hydra/launcher=slurm submits each job with SLURM's sbatch, which is not on PATH here; "
                "run the command on a SLURM login node (or drop hydra/launcher=slurm to run the jobs here one by one)")
    trainer = config.get("trainer") or {}
    devices = trainer.get("devices", 1)
    if str(trainer.get("accelerator", "auto")) != "cpu" and str(devices) in ("-1", "auto"):
        return (f"trainer.devices={devices} (all visible GPUs) cannot be counted before the job reaches its node; "
                "give the GPUs per node, e.g. trainer.devices=4 (one SLURM task per GPU)")
    launcher = config.hydra.launcher
    timeout_min, delay = launcher.get("timeout_min"), launcher.get("signal_delay_s")
    if timeout_min is not None and delay is not None and float(delay) >= float(timeout_min) * 60:
        return (f"hydra.launcher.signal_delay_s={delay} is not below the time limit timeout_min={timeout_min} "
                f"({float(timeout_min) * 60:.0f} s): the pre-emption signal would arrive at once; "
                f"use a delay below {float(timeout_min) * 60:.0f} s or leave it to its default")
    return None


def launcher_problem(config: DictConfig) -> str | None:
    """Why ``hydra.launcher`` cannot launch these jobs from here, or None."""
    target = str((config.hydra.get("launcher") or {}).get("_target_", ""))
    if target.endswith(("submitit_launcher.SlurmLauncher", "vitpipe_slurm.launcher.SlurmLauncher")):
        return _slurm_problem(config)
    return None


class LauncherCheck(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        problem = launcher_problem(config)
        if problem:
            print(f"vitpipe: error: {problem}", file=sys.stderr)
            sys.exit(EXIT_CONFIG)
