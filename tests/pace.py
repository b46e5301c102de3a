"""Slows a real training run down (imported by subprocesses through PYTHONPATH=tests).

``+callbacks.pace._target_=pace.Pace +callbacks.pace.seconds=0.2`` sleeps after each training batch,
so that a SLURM test can signal, requeue or cancel a job mid-run. Sleeping changes no number the
run computes: the job's weights still equal an unpaced run's.
"""

from __future__ import annotations

import time

import lightning as L


class Pace(L.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)
