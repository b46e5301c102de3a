"""Checkpoints that survive crashes, kills, interrupts, full disks and pre-emption.

- ``atomic_write`` / ``AtomicCheckpointIO``: write to a temporary file in the same directory,
  fsync, then rename over the target. A kill during a save leaves the previous file intact
  (rename is atomic on POSIX), never a truncated file under the real name; a failed write
  (a full disk) removes its temporary file and raises ``DiskFullError`` naming the path. Files
  get the permissions the user's umask gives (``mkstemp`` alone would make them 0600).
- ``remove_stale_temp_files``: the temporary files (and ``temp_dir_beside`` folders) of writes
  whose process was killed.
- ``BestAndLastCheckpoint``: Lightning's ``ModelCheckpoint`` (best k by a metric) whose
  ``last.ckpt`` is always the newest state: after every epoch and every N steps if asked.
- ``PreemptionCheckpoint``: on SIGTERM (what schedulers send before killing a job) or Ctrl-C,
  Lightning finishes the current batch and raises ``SIGTERMException``; this callback then writes
  ``last.ckpt`` at that batch boundary (only while fitting), so ``ckpt_path=last`` continues from
  the exact step. Every checkpoint it is part of holds each rank's global random generators; on
  resume it restores them, says where it continues, removes stale temporary files, and hides
  Lightning's "dataloader is not resumable" warning where vitpipe's data state makes it wrong.
- ``SignalAtStep``: sends a real signal to the own process at a given step, to rehearse a kill.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from vitpipe.data.resume import RNG_KEY, rank_rng_state, restores_position, rng_state, set_rng_state

_FULL = (errno.ENOSPC, errno.EDQUOT)
STALE_AFTER_S = 3600  # a temporary file of another host older than this is no save in progress


class DiskFullError(OSError):
    """A write failed for lack of space; its temporary file is gone and the old file untouched."""

    def __init__(self, code: int, path: Path) -> None:
        super().__init__(code, os.strerror(code), str(path))


def disk_full_cause(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT error in ``exc``'s chain (torch's writer wraps it), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _umask() -> int:
    try:  # Linux reports it without changing it (os.umask can only set, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_prefix(name: str) -> str:
    # the writer's host and pid in the name: a later run can tell a killed save from a running one
    return f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-"


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path.name))
        os.fchmod(fd, 0o666 & ~_umask())  # teammates read checkpoints as they read the user's other files
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        full = disk_full_cause(e)
        if full is not None:
            raise DiskFullError(full.errno, path) from e
        raise
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory to make a rename durable: after a power cut the directory entry
    points at the new file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


_TEMP_NAME = re.compile(r"\..+\.tmp-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+")


def _writer_may_be_alive(p: Path) -> bool:
    m = _TEMP_NAME.fullmatch(p.name)
    if m is None:
        return False  # an older vitpipe's temp name: no host/pid, and no running version writes it
    if m["host"] != socket.gethostname():
        return time.time() - p.stat().st_mtime < STALE_AFTER_S
    pid = int(m["pid"])
    if pid == os.getpid():
        return False  # this process calls between its own saves
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def temp_dir_beside(path: Path) -> Path:
    """A new empty folder beside ``path``, named as ``atomic_write`` names its temporary files (so a
    killed writer's folder is found by ``remove_stale_temp_files``), with the user's umask."""
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_temp_prefix(path.name)))
    tmp.chmod(0o777 & ~_umask())
    return tmp


def remove_stale_temp_files(directory, name: str | None = None) -> list[Path]:
    """Delete the ``.<name>.tmp-*`` files in ``directory`` whose writer was killed mid-save.

    With ``name``: only those of writes to ``directory/name``, folders (``temp_dir_beside``) included,
    and only under the names this module gives them: ``directory`` may be any folder of the user's.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for p in directory.glob(".*.tmp-*" if name is None else f".{glob.escape(name)}.tmp-*"):
        try:
            if name is not None and not _TEMP_NAME.fullmatch(p.name):
                continue
            if p.is_file() and not _writer_may_be_alive(p):
                p.unlink()
                removed.append(p)
            elif name is not None and p.is_dir() and not p.is_symlink() and not _writer_may_be_alive(p):
                shutil.rmtree(p)
                removed.append(p)
        except FileNotFoundError:
            pass  # its writer finished (renamed it) meanwhile
    return removed


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
    writes it, so its bookkeeping (``last_model_path``, loggers) stays as Lightning keeps it.

    No version counter: Lightning writes ``last-v1.ckpt`` when it finds a ``last.ckpt`` it did not
    write itself, e.g. the one ``PreemptionCheckpoint`` saved before a requeue, which left the
    resumed run's newest state beside a stale ``last.ckpt`` (a fresh run never shares its directory
    with another: ``vitpipe.train`` refuses ``ckpt_path=null`` into a run directory with checkpoints).
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
        if n and trainer.global_step % n == 0:
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
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


_NOT_CAUGHT = object()
# Lightning's training_epoch_loop warns so on a mid-epoch restart from a loader without state_dict
NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable"


class SecondInterrupt(BaseException):
    """Ctrl-C pressed again before the first one reached a batch boundary: stop now, save nothing.

    Not a ``KeyboardInterrupt``: Lightning turns that into ``sys.exit(1)``; this one reaches
    ``vitpipe.cli``, which exits 130 like any Ctrl-C.
    """


class PreemptionCheckpoint(L.Callback):
    """Stops and resumes.

    - SIGTERM while fitting: ``last.ckpt`` at the batch boundary (Lightning stops there).
    - Ctrl-C (SIGINT) is relayed as SIGTERM, so it stops the same way, on every DDP rank (Lightning
      broadcasts the stop); a second Ctrl-C stops at once without saving.
    - SLURM through submitit (``hydra/launcher=slurm``): submitit's handler of its warning signal
      (USR2, ``signal_delay_s`` before the time limit) requeues the job and exits at once, mid-batch,
      saving nothing. It is deferred: the signal stops the run like SIGTERM (``last.ckpt`` at the
      batch boundary), and ``vitpipe.cli`` then calls submitit's handler, which requeues the job with
      the same config; ``ckpt_path=auto`` resumes it from that ``last.ckpt``.
    - The ``SIGTERMException`` that ends the run carries ``vitpipe_signal``, ``vitpipe_stage`` and
      ``vitpipe_checkpoint`` (the path written, or None: nothing is saved outside fit), which
      ``vitpipe.cli`` turns into one line and the exit status 128 + signal.
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
            exception.vitpipe_requeue = lambda: handler(SUBMITIT_SIGNAL, None)  # vitpipe.cli calls it last
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
