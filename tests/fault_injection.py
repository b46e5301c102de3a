"""Faults injected into a real training run (imported by subprocesses through PYTHONPATH=tests).

``+callbacks.kill._target_=fault_injection.SignalAtStep +callbacks.kill.step=8`` sends a real signal
(SIGTERM unless ``signum``) to the training process after that optimizer step.

``+callbacks.nan._target_=fault_injection.NaNLossOnRank +callbacks.nan.rank=1 +callbacks.nan.step=1``
makes the network's output NaN for one training batch on one rank; ``dump_dir`` receives each
rank's final weights (``rank<r>.pt``), so a test can compare the ranks.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import torch


class NaNLossOnRank(L.Callback):
    def __init__(self, rank: int, step: int, dump_dir: str | None = None) -> None:
        self.rank, self.step, self.dump_dir, self._hook = rank, step, dump_dir, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.step:
            self._hook = pl_module.net.register_forward_hook(lambda m, i, out: out * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def on_train_end(self, trainer, pl_module) -> None:
        if self.dump_dir:
            Path(self.dump_dir).mkdir(parents=True, exist_ok=True)
            torch.save(pl_module.net.state_dict(), Path(self.dump_dir) / f"rank{trainer.global_rank}.pt")


class SignalAtStep(L.Callback):
    """Deliver ``signum`` to this process after optimizer step ``step`` (rehearse a pre-emption,
    a Ctrl-C or a ``kill -9``), or with ``stage=test`` after test batch ``step``."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM), stage: str = "train") -> None:
        if stage not in ("train", "test"):
            raise ValueError(f"stage={stage!r}; valid: train, test")
        self.step, self.signum, self.stage = step, int(signum), stage

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.stage == "train" and trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), self.signum)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.stage == "test" and batch_idx == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), self.signum)
