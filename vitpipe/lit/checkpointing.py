"""Checkpoints that survive crashes, kills, interrupts, full disks and pre-emption.

- ``AtomicCheckpointIO``: Lightning's checkpoint writer through ``vitpipe.run.files.atomic_write``
  (temporary file, fsync, rename): a kill during a save leaves the previous file intact.
- ``BestAndLastCheckpoint``: Lightning's ``ModelCheckpoint`` (best k by a metric) whose
  ``last.ckpt`` is always the newest state: after every epoch and every N steps if asked.
- ``PreemptionCheckpoint``: on SIGTERM (what schedulers send before killing a job) or Ctrl-C,
  Lightning finishes the current batch and raises ``SIGTERMException``; this callback then writes
  ``last.ckpt`` at that batch boundary (only while fitting), so ``ckpt_path=last`` continues from
  the exact step. Its parts (signals, SLURM requeue, what the CLI is told, random streams, resume)
  are the modules of ``vitpipe.lit.preemption``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitpipe.data.resume import restores_position
from vitpipe.lit.preemption.requeue import SUBMITIT_SIGNAL
from vitpipe.lit.preemption.resume import QuietExactResume, announce, checkpoint_dir, clean_checkpoint_dirs
from vitpipe.lit.preemption.rng import RandomStreams
from vitpipe.lit.preemption.signals import Interrupts
from vitpipe.lit.preemption.stop import mark_requeue, mark_saved, mark_stop
from vitpipe.run.files import atomic_write


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` through ``atomic_write``: a kill or a full disk never corrupts a checkpoint."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        protocols = get_filesystem(path).protocol
        if "file" not in (protocols if isinstance(protocols, tuple) else (protocols,)):
            return super().save_checkpoint(checkpoint, path, storage_options)  # remote stores: their own semantics
        atomic_write(Path(path), lambda f: torch.save(checkpoint, f))


class BestAndLastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` is always the newest state.

    Lightning 2.6 refreshes ``last.ckpt`` only when it saves a top-k checkpoint, so with
    ``save_top_k=1`` on ``val/acc`` a finished run's ``last.ckpt`` held its best epoch and
    ``ckpt_path=last`` silently retrained the epochs after it. Here ``last.ckpt`` is also written
    at the end of every training epoch and, with ``last_every_n_train_steps=N``, after every N-th
    optimizer step, whatever the monitored metric did. Lightning's own ``_save_last_checkpoint``
    writes it, so its bookkeeping (``last_model_path``, loggers) stays as Lightning keeps it. Each state is
    written once: an N-th step that ends an epoch is left to the epoch end (after validation and the best
    checkpoint), and these writes do not count as Lightning's save of the step, which would skip the best.

    No version counter: Lightning writes ``last-v1.ckpt`` when it finds a ``last.ckpt`` it did not
    write itself, e.g. the one ``PreemptionCheckpoint`` saved before a requeue, which left the
    resumed run's newest state beside a stale ``last.ckpt`` (a fresh run never shares its directory
    with another: ``vitpipe.tasks.train`` refuses ``ckpt_path=null`` into a run directory with checkpoints).
    """

    def __init__(self, *args, last_every_n_train_steps: int | None = None, **kwargs) -> None:
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)
        if self.save_last == "link":
            raise ValueError("save_last=link would point last.ckpt at an older checkpoint; use save_last=true")
        if last_every_n_train_steps is not None and last_every_n_train_steps < 0:
            raise ValueError(f"last_every_n_train_steps={last_every_n_train_steps}; use a positive int or null")
        self.last_every_n_train_steps = last_every_n_train_steps or 0
        self._last_written_step = 0  # nothing to save before the first step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        n = self.last_every_n_train_steps
        # the epoch's last batch: on_train_epoch_end writes last.ckpt once, after validation and the best
        if n and trainer.global_step % n == 0 and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._refresh_last(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)  # top-k (and last, when a top-k was saved)
        self._refresh_last(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._refresh_last(trainer)  # max_steps can end training mid-epoch

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self.save_last:
            self._last_written_step = trainer.global_step

    def _refresh_last(self, trainer) -> None:
        if (not self.save_last or trainer.fast_dev_run or trainer.sanity_checking
                or trainer.state.fn != TrainerFn.FITTING or self._last_written_step == trainer.global_step):
            return
        # Lightning skips every save at a step it has saved at (_last_global_step_saved): a last.ckpt of ours
        # must not count, or the validation that follows this step never writes the best checkpoint
        saved_step = self._last_global_step_saved
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self._last_global_step_saved = saved_step


class PreemptionCheckpoint(L.Callback):
    """Stops and resumes: on SIGTERM (what schedulers send before killing a job), Ctrl-C or SLURM's requeue
    warning, ``last.ckpt`` at the batch boundary (only while fitting), so ``ckpt_path=last`` (or ``auto``
    after a requeue) continues from the exact step with the same random streams.

    The Lightning hooks below only wire the parts of ``vitpipe.lit.preemption``, one per concern:
    ``Interrupts`` (which signal stops the run; Ctrl-C relayed as SIGTERM, twice: ``SecondInterrupt``),
    ``DeferredRequeue`` (submitit's handler, called after the save), ``stop`` (what the exception carries
    for the CLI), ``RandomStreams`` (every rank's generators) and ``resume`` (message, temporary-file
    clean-up, the quieted "not resumable" warning).
    """

    def __init__(self, filename: str = "last.ckpt") -> None:
        self.filename = filename
        self.interrupts = Interrupts()
        self.streams = RandomStreams()
        self.quiet = QuietExactResume()
        self._exact_resume = False  # set by on_load_checkpoint, consumed by on_train_start

    # ---- each stage: our handlers, installed after Lightning registers its SIGTERM handler ----

    def on_train_start(self, trainer, pl_module) -> None:
        self.interrupts.catch(trainer)
        self.streams.restore()
        if self._exact_resume:
            self.quiet.start()
        self._exact_resume = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.quiet.stop()

    def on_train_end(self, trainer, pl_module) -> None:
        self.quiet.stop()

    def on_validation_start(self, trainer, pl_module) -> None:
        self.interrupts.catch(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self.interrupts.catch(trainer)

    def on_predict_start(self, trainer, pl_module) -> None:
        self.interrupts.catch(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.quiet.stop()
        self.interrupts.release()

    # ---- the stop ----------------------------------------------------------------------------

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.quiet.stop()
        self.interrupts.release()
        if not isinstance(exception, SIGTERMException):
            return
        mark_stop(exception, trainer, self.interrupts.signal)
        if self.interrupts.signal == SUBMITIT_SIGNAL and self.interrupts.requeue.handler is not None:
            mark_requeue(exception, self.interrupts.requeue.release())
        if trainer.state.fn != TrainerFn.FITTING:
            return  # testing/validating: there is no training state to save
        path = checkpoint_dir(trainer) / self.filename
        # the full state (optimizer, loops), to resume; collective under DDP: every rank got the SIGTERM broadcast
        trainer.save_checkpoint(path, weights_only=False)
        mark_saved(exception, path)

    # ---- resume --------------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self.streams.save(trainer, checkpoint)

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            clean_checkpoint_dirs(trainer)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._exact_resume = restores_position(trainer.datamodule, checkpoint)
        fresh = self.streams.load(trainer, checkpoint)
        if trainer.is_global_zero:
            announce(trainer, checkpoint, fresh)
