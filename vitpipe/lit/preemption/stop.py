"""What the ``SIGTERMException`` that ends a stopped run carries for ``vitpipe.tasks.cli``, which turns it
into one line and the exit status 128 + signal (and, for a SLURM requeue, calls ``vitpipe_requeue`` last).

    vitpipe_signal      the signal that stopped the run (SIGTERM, SIGINT relayed, submitit's USR2)
    vitpipe_stage       the Trainer stage it stopped (fit, validate, test, predict)
    vitpipe_checkpoint  the path of the last.ckpt written, or None (nothing is saved outside fit)
    vitpipe_step        the global step it stopped at
    vitpipe_requeue     submitit's deferred requeue, only when its signal stopped the run
"""

from __future__ import annotations

import signal


def mark_stop(exception: BaseException, trainer, signum: int | None) -> None:
    """Stamp ``exception`` with the stop's signal, stage and step; no checkpoint yet."""
    exception.vitpipe_signal = int(signum or signal.SIGTERM)
    exception.vitpipe_stage = trainer.state.fn.value if trainer.state.fn else "?"
    exception.vitpipe_checkpoint = None
    exception.vitpipe_step = trainer.global_step


def mark_saved(exception: BaseException, path) -> None:
    exception.vitpipe_checkpoint = str(path)  # the CLI names it in the stop message


def mark_requeue(exception: BaseException, requeue) -> None:
    exception.vitpipe_requeue = requeue  # vitpipe.tasks.cli calls it last
