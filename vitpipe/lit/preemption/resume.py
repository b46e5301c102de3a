"""Around a resume: where it continues (printed), the temporary files killed saves left (removed), and
Lightning's "dataloader is not resumable" warning where it is wrong (ignored).

A mid-epoch resume whose checkpoint holds the data module's ResumeState (the sampler skips the trained
batches, augmentation is seeded by step: ``vitpipe.data.resume``) continues exactly, so Lightning's
"dataloader is not resumable ... unreliable results" is wrong there: it is ignored from
``on_train_start`` to the first batch, where Lightning's loop restart emits it. Without that state (a
data module with no ResumeState, an older checkpoint) the warning stays.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from lightning.pytorch.utilities.warnings import PossibleUserWarning

from vitpipe.run.files import remove_stale_temp_files

# Lightning's training_epoch_loop warns so on a mid-epoch restart from a loader without state_dict
NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable"


def checkpoint_dir(trainer) -> Path:
    cb = trainer.checkpoint_callback
    return Path(cb.dirpath) if cb is not None and cb.dirpath else Path(trainer.default_root_dir) / "checkpoints"


def clean_checkpoint_dirs(trainer) -> None:
    """Remove the temporary files of killed saves from every checkpoint directory of ``trainer`` (rank 0)."""
    dirs = {Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    for d in dirs | {checkpoint_dir(trainer), Path(trainer.default_root_dir)}:
        remove_stale_temp_files(d)


def announce(trainer, checkpoint: dict, fresh: str | None) -> None:
    """Rank 0, a fit loading ``checkpoint``: clean the interrupted run's directory and say where it continues."""
    path = trainer.ckpt_path
    if path:
        remove_stale_temp_files(Path(path).parent)  # the interrupted run's directory
    print(f"vitpipe: resuming from {path} at epoch {checkpoint.get('epoch')}, "
          f"global step {checkpoint.get('global_step')}", flush=True)
    if fresh:
        print(f"vitpipe: {fresh}: the random streams (drop path, dropout, mixup) start fresh, so the run "
              "continues but not bit-identically to one that never stopped", flush=True)


class QuietExactResume:
    """Ignores ``NOT_RESUMABLE`` from ``start`` (on_train_start) until ``stop`` (the first batch, the end)."""

    def __init__(self) -> None:
        self._quiet: warnings.catch_warnings | None = None

    def start(self) -> None:
        if self._quiet is None:
            self._quiet = warnings.catch_warnings()
            self._quiet.__enter__()
            warnings.filterwarnings("ignore", message=NOT_RESUMABLE, category=PossibleUserWarning)

    def stop(self) -> None:
        if self._quiet is not None:
            quiet, self._quiet = self._quiet, None
            quiet.__exit__(None, None, None)
