"""Slows a real training run down (imported by subprocesses through PYTHONPATH=tests).

``+callbacks.pace._target_=pace.Pace +callbacks.pace.seconds=0.2`` sleeps after each training batch,
so that a SLURM test can signal, requeue or cancel a job mid-run. Sleeping changes no number the
run computes: the job's weights still equal an unpaced run's.
"""

from __future__ import annotations

import time

import lightning as L


class Pace(L.Callback):
    """``seconds`` after each training batch; from optimizer step ``slower_from`` on, ``slower_seconds``
    (a machine that gets slower mid-run, for the time-budget tests)."""

    def __init__(self, seconds: float, slower_from: int | None = None, slower_seconds: float = 0.0) -> None:
        self.seconds, self.slower_from, self.slower_seconds = float(seconds), slower_from, float(slower_seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        slower = self.slower_from is not None and trainer.global_step >= self.slower_from
        time.sleep(self.slower_seconds if slower else self.seconds)


class LrTrace(L.Callback):
    """Writes the first optimizer group's learning rate after every optimizer step to ``path`` (JSON:
    a list of [step, lr]) when training ends."""

    def __init__(self, path: str) -> None:
        self.path, self.trace = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not self.trace or self.trace[-1][0] != step:
            self.trace.append([step, trainer.optimizers[0].param_groups[0]["lr"]])

    def on_train_end(self, trainer, pl_module) -> None:
        import json

        with open(self.path, "w") as f:
            json.dump(self.trace, f)
