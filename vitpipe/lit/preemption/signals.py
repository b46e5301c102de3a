"""Which signal is stopping the run, and Ctrl-C made to stop it the way SIGTERM does.

On SIGTERM (what schedulers send before killing a job) Lightning finishes the current batch, on every
DDP rank (it broadcasts the stop), and raises ``SIGTERMException``. Ctrl-C (SIGINT) is relayed as
SIGTERM so it stops the same way; pressed again before that boundary, it stops at once without saving
(``SecondInterrupt``). submitit's requeue signal is taken over the same way (``requeue``). Handlers are
installed per stage, after Lightning registers its own SIGTERM handler, and only in the main thread.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from lightning.pytorch.trainer.states import TrainerFn

from vitpipe.lit.preemption.requeue import SUBMITIT_SIGNAL, DeferredRequeue

_NOT_CAUGHT = object()


class SecondInterrupt(BaseException):
    """Ctrl-C pressed again before the first one reached a batch boundary: stop now, save nothing.

    Not a ``KeyboardInterrupt``: Lightning turns that into ``sys.exit(1)``; this one reaches
    ``vitpipe.tasks.cli``, which exits 130 like any Ctrl-C.
    """


class Interrupts:
    """Our SIGINT (and submitit's signal) handlers for one stage; ``signal``: the one stopping it, or None."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.requeue = DeferredRequeue()
        self._previous_sigint = _NOT_CAUGHT
        self._trainer = None

    def catch(self, trainer) -> None:
        if self._previous_sigint is not _NOT_CAUGHT or threading.current_thread() is not threading.main_thread():
            return
        self.signal, self._trainer = None, trainer
        self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        self.requeue.take_over(self._on_requeue_signal)

    def release(self) -> None:
        if self.signal != SUBMITIT_SIGNAL:
            self.requeue.give_back()
        if self._previous_sigint is _NOT_CAUGHT:
            return
        previous = self._previous_sigint
        self._previous_sigint = _NOT_CAUGHT
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)

    def _on_sigint(self, signum, frame) -> None:
        if self.signal == signal.SIGINT:  # pressed twice: stop now, without saving
            self.release()
            raise SecondInterrupt("Ctrl-C pressed twice: stopped at once, nothing saved")
        self.signal = signal.SIGINT
        if self._trainer is None or self._trainer.is_global_zero:
            fitting = self._trainer is not None and self._trainer.state.fn == TrainerFn.FITTING
            what = "and saving last.ckpt " if fitting else ""
            print(f"\nvitpipe: SIGINT: stopping at the end of this batch {what}(Ctrl-C again: stop now, "
                  "without saving)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # Lightning's pre-emption path: batch boundary, all ranks

    def _on_requeue_signal(self, signum, frame) -> None:
        if self.signal is not None:
            return  # already stopping
        self.signal = signum
        if self._trainer is None or self._trainer.is_global_zero:
            print(f"\nvitpipe: {signal.Signals(signum).name} from SLURM (time limit or pre-emption ahead): stopping "
                  "at the end of this batch, saving last.ckpt, then submitit requeues the job", file=sys.stderr,
                  flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
