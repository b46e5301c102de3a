"""Checkpoints that survive crashes, kills, interrupts, full disks and pre-emption.

- ``AtomicCheckpointIO``: Lightning's checkpoint writer through ``vitpipe.run.files.atomic_write``
  (temporary file, fsync, rename): a kill during a save leaves the previous file intact.
- ``BestAndLastCheckpoint``: Lightning's ``ModelCheckpoint`` (best k by a metric) whose
  ``last.ckpt`` is always the newest state: after every epoch and every N steps if asked.
- ``PreemptionCheckpoint``: on SIGTERM (what schedulers send before killing a job) or Ctrl-C,
  Lightning finishes the current batch and raises ``SIGTERMException``; this callback then writes
  ``last.ckpt`` at that batch boundary (only while fitting), so ``ckpt_path=last`` continues from
  the exact step. Every checkpoint it is part of holds each rank's global random generators; on
  resume it restores them, says where it continues, removes stale temporary files, and hides
  Lightning's "dataloader is not resumable" warning where vitpipe's data state makes it wrong.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from vitpipe.data.resume import RNG_KEY, rank_rng_state, restores_position, rng_state, set_rng_state
from vitpipe.run.files import atomic_write, remove_stale_temp_files


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


_NOT_CAUGHT = object()
# Lightning's training_epoch_loop warns so on a mid-epoch restart from a loader without state_dict
NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable"


class SecondInterrupt(BaseException):
    """Ctrl-C pressed again before the first one reached a batch boundary: stop now, save nothing.

    Not a ``KeyboardInterrupt``: Lightning turns that into ``sys.exit(1)``; this one reaches
    ``vitpipe.tasks.cli``, which exits 130 like any Ctrl-C.
    """


class PreemptionCheckpoint(L.Callback):
    """Stops and resumes.

    - SIGTERM while fitting: ``last.ckpt`` at the batch boundary (Lightning stops there).
    - Ctrl-C (SIGINT) is relayed as SIGTERM, so it stops the same way, on every DDP rank (Lightning
      broadcasts the stop); a second Ctrl-C stops at once without saving.
    - SLURM through submitit (``hydra/launcher=slurm``): submitit's handler of its warning signal
      (USR2, ``signal_delay_s`` before the time limit) requeues the job and exits at once, mid-batch,
      saving nothing. It is deferred: the signal stops the run like SIGTERM (``last.ckpt`` at the
      batch boundary), and ``vitpipe.tasks.cli`` then calls submitit's handler, which requeues the job with
      the same config; ``ckpt_path=auto`` resumes it from that ``last.ckpt``.
    - The ``SIGTERMException`` that ends the run carries ``vitpipe_signal``, ``vitpipe_stage`` and
      ``vitpipe_checkpoint`` (the path written, or None: nothing is saved outside fit), which
      ``vitpipe.tasks.cli`` turns into one line and the exit status 128 + signal.
    - Resume: prints the path, epoch and step it continues from; at start and on resume, removes
      the temporary files that killed saves left in the checkpoint directories.
    - Random streams: every checkpoint gets ``rng_states``, the global generators (torch, CUDA,
      numpy, Python) of every rank, gathered into the one file rank 0 writes (a collective, as
      Lightning's saves are). A resumed fit gives each rank its own back in ``on_train_start``: after
      everything the resume itself does (loading, setting up the loaders) and right before the
      loop's next batch, the point where the saving run stood. Drop path, dropout and mixup then
      draw what they would have drawn. A checkpoint without them (older, or another world size)
      resumes with fresh streams and says so in one line.
    - A mid-epoch resume whose checkpoint holds the data module's ResumeState (the sampler skips the
      trained batches, augmentation is seeded by step: vitpipe.data.resume) continues exactly, so
      Lightning's "dataloader is not resumable ... unreliable results" is wrong there: it is ignored
      from on_train_start to the first batch, where Lightning's loop restart emits it. Without that
      state (a data module with no ResumeState, an older checkpoint) the warning stays.
    """

    def __init__(self, filename: str = "last.ckpt") -> None:
        self.filename = filename
        self._signal: int | None = None  # the signal that is stopping the current stage
        self._previous_sigint = _NOT_CAUGHT
        self._trainer: L.Trainer | None = None
        self._exact_resume = False  # set by on_load_checkpoint, consumed by on_train_start
        self._rng_state: dict | None = None  # this rank's saved generators, restored in on_train_start
        self._quiet: warnings.catch_warnings | None = None
        self._requeue = None  # submitit's handler of its requeue signal, deferred to after the save

    # ---- Ctrl-C: installed after Lightning registers its SIGTERM handler (before on_*_start) ----

    def on_train_start(self, trainer, pl_module) -> None:
        self._catch_sigint(trainer)
        if self._rng_state is not None:
            set_rng_state(self._rng_state)
            self._rng_state = None
        if self._exact_resume and self._quiet is None:
            self._quiet = warnings.catch_warnings()
            self._quiet.__enter__()
            warnings.filterwarnings("ignore", message=NOT_RESUMABLE, category=PossibleUserWarning)
        self._exact_resume = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._unquiet()

    def on_train_end(self, trainer, pl_module) -> None:
        self._unquiet()

    def _unquiet(self) -> None:
        if self._quiet is not None:
            quiet, self._quiet = self._quiet, None
            quiet.__exit__(None, None, None)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._catch_sigint(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self._catch_sigint(trainer)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._catch_sigint(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._unquiet()
        self._release_sigint()

    def _catch_sigint(self, trainer) -> None:
        if self._previous_sigint is not _NOT_CAUGHT or threading.current_thread() is not threading.main_thread():
            return
        self._signal, self._trainer = None, trainer
        self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        if self._requeue is None and _is_submitit_requeue(signal.getsignal(SUBMITIT_SIGNAL)):
            self._requeue = signal.signal(SUBMITIT_SIGNAL, self._on_requeue_signal)

    def _release_sigint(self) -> None:
        if self._requeue is not None and self._signal != SUBMITIT_SIGNAL and \
                threading.current_thread() is threading.main_thread():
            signal.signal(SUBMITIT_SIGNAL, self._requeue)  # not signalled: submitit's handler as it was
            self._requeue = None
        if self._previous_sigint is _NOT_CAUGHT:
            return
        previous = self._previous_sigint
        self._previous_sigint = _NOT_CAUGHT
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)

    def _on_sigint(self, signum, frame) -> None:
        if self._signal == signal.SIGINT:  # pressed twice: stop now, without saving
            self._release_sigint()
            raise SecondInterrupt("Ctrl-C pressed twice: stopped at once, nothing saved")
        self._signal = signal.SIGINT
        if self._trainer is None or self._trainer.is_global_zero:
            fitting = self._trainer is not None and self._trainer.state.fn == TrainerFn.FITTING
            what = "and saving last.ckpt " if fitting else ""
            print(f"\nvitpipe: SIGINT: stopping at the end of this batch {what}(Ctrl-C again: stop now, "
                  "without saving)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # Lightning's pre-emption path: batch boundary, all ranks

    def _on_requeue_signal(self, signum, frame) -> None:
        if self._signal is not None:
            return  # already stopping
        self._signal = signum
        if self._trainer is None or self._trainer.is_global_zero:
            print(f"\nvitpipe: {signal.Signals(signum).name} from SLURM (time limit or pre-emption ahead): stopping "
                  "at the end of this batch, saving last.ckpt, then submitit requeues the job", file=sys.stderr,
                  flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    # ---- the stop ----------------------------------------------------------------------------

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._unquiet()
        self._release_sigint()
        if not isinstance(exception, SIGTERMException):
            return
        exception.vitpipe_signal = int(self._signal or signal.SIGTERM)
        exception.vitpipe_stage = trainer.state.fn.value if trainer.state.fn else "?"
        exception.vitpipe_checkpoint = None
        exception.vitpipe_step = trainer.global_step
        if self._signal == SUBMITIT_SIGNAL and self._requeue is not None:
            handler, self._requeue = self._requeue, None
            signal.signal(SUBMITIT_SIGNAL, handler)
            exception.vitpipe_requeue = lambda: handler(SUBMITIT_SIGNAL, None)  # vitpipe.tasks.cli calls it last
        if trainer.state.fn != TrainerFn.FITTING:
            return  # testing/validating: there is no training state to save
        path = _checkpoint_dir(trainer) / self.filename
        # the full state (optimizer, loops), to resume; collective under DDP: every rank got the SIGTERM broadcast
        trainer.save_checkpoint(path, weights_only=False)
        exception.vitpipe_checkpoint = str(path)  # the CLI names it in the stop message

    # ---- resume --------------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[RNG_KEY] = _rng_states_of_all_ranks(trainer)

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            dirs = {Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
            for d in dirs | {_checkpoint_dir(trainer), Path(trainer.default_root_dir)}:
                remove_stale_temp_files(d)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._exact_resume = restores_position(trainer.datamodule, checkpoint)
        self._rng_state, fresh = rank_rng_state(checkpoint.get(RNG_KEY), trainer.global_rank, trainer.world_size)
        if not trainer.is_global_zero:
            return
        path = trainer.ckpt_path
        if path:
            remove_stale_temp_files(Path(path).parent)  # the interrupted run's directory
        print(f"vitpipe: resuming from {path} at epoch {checkpoint.get('epoch')}, "
              f"global step {checkpoint.get('global_step')}", flush=True)
        if fresh:
            print(f"vitpipe: {fresh}: the random streams (drop path, dropout, mixup) start fresh, so the run "
                  "continues but not bit-identically to one that never stopped", flush=True)


SUBMITIT_SIGNAL = signal.SIGUSR2  # submitit's --signal (time limit / pre-emption warning)


def _is_submitit_requeue(handler) -> bool:
    """True for submitit's handler that requeues the job and exits (installed in every submitit job)."""
    return getattr(handler, "__name__", "") == "checkpoint_and_try_requeue" and \
        type(getattr(handler, "__self__", None)).__module__.startswith("submitit")


def _rng_states_of_all_ranks(trainer) -> list[dict]:
    """Every rank's ``rng_state()``, rank 0 first; a collective under DDP (every rank dumps the
    checkpoint that rank 0 writes, as Lightning's ``save_checkpoint`` requires)."""
    mine = rng_state()
    dist = torch.distributed
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [mine]
    states: list = [None] * trainer.world_size
    dist.all_gather_object(states, mine)
    return states


def _checkpoint_dir(trainer) -> Path:
    cb = trainer.checkpoint_callback
    return Path(cb.dirpath) if cb is not None and cb.dirpath else Path(trainer.default_root_dir) / "checkpoints"
