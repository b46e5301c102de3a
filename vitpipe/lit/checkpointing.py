"""Checkpoints that survive crashes, kills and pre-emption.

- ``AtomicCheckpointIO``: write to a temporary file in the same directory, fsync, then rename
  over the target. A kill during a save leaves the previous checkpoint intact (rename is atomic
  on POSIX), never a truncated file under the real name.
- ``PreemptionCheckpoint``: on SIGTERM (what schedulers send before killing a job, SLURM's
  pre-emption included) Lightning finishes the current batch and raises ``SIGTERMException``;
  this callback then writes ``last.ckpt`` at that batch boundary, so ``ckpt_path=last`` continues
  from the exact step (the data modules resume the epoch's order and augmentation exactly).
- ``SignalAtStep``: sends a real signal to the own process at a given step, to rehearse a kill.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` into ``.<name>.tmp-*`` next to the target, then ``os.replace``."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        protocols = get_filesystem(path).protocol
        if "file" not in (protocols if isinstance(protocols, tuple) else (protocols,)):
            return super().save_checkpoint(checkpoint, path, storage_options)  # remote stores: their own semantics

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class PreemptionCheckpoint(L.Callback):
    """Write a resumable ``last.ckpt`` when training is stopped by SIGTERM."""

    def __init__(self, filename: str = "last.ckpt") -> None:
        self.filename = filename
        self.saved_path: str | None = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != "fit":
            return
        cb = trainer.checkpoint_callback
        dirpath = Path(cb.dirpath) if cb is not None and cb.dirpath else Path(trainer.default_root_dir) / "checkpoints"
        path = dirpath / self.filename
        trainer.save_checkpoint(path)  # collective under DDP: every rank got the SIGTERM broadcast
        self.saved_path = str(path)
        rank_zero_info(f"SIGTERM at global step {trainer.global_step}: saved {path}; resume with ckpt_path=last")


class SignalAtStep(L.Callback):
    """Deliver ``signum`` to this process after optimizer step ``step`` (rehearse a pre-emption)."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM)) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), self.signum)
