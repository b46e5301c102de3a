"""Checks a multirun's launcher before Hydra hands it any job: a launcher that cannot start jobs on
this machine stops the command with one line (exit 2) instead of a traceback from inside the plugin."""

from __future__ import annotations

import shutil
import sys

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

EXIT_CONFIG = 2


def launcher_problem(config: DictConfig) -> str | None:
    """Why ``hydra.launcher`` cannot launch from here, or None."""
    target = str((config.hydra.get("launcher") or {}).get("_target_", ""))
    if target.endswith("submitit_launcher.SlurmLauncher") and shutil.which("sbatch") is None:
        return ("hydra/launcher=slurm submits each job with SLURM's sbatch, which is not on PATH here; "
                "run the command on a SLURM login node (or drop hydra/launcher=slurm to run the jobs here one by one)")
    return None


class LauncherCheck(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        problem = launcher_problem(config)
        if problem:
            print(f"vitpipe: error: {problem}", file=sys.stderr)
            sys.exit(EXIT_CONFIG)
