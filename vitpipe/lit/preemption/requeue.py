"""submitit's SLURM requeue, deferred until ``last.ckpt`` is saved.

Under ``hydra/launcher=slurm`` submitit installs, in every job, a handler of its warning signal (USR2,
``signal_delay_s`` before the time limit) that requeues the job and exits at once, mid-batch, saving
nothing. ``DeferredRequeue`` takes that handler out of the signal while a stage runs, so the signal
stops the run like SIGTERM instead; ``vitpipe.tasks.cli`` calls the held handler last, after the save,
and the requeued job (same config) resumes from that ``last.ckpt`` with ``ckpt_path=auto``.
"""

from __future__ import annotations

import signal
import threading

SUBMITIT_SIGNAL = signal.SIGUSR2  # submitit's --signal (time limit / pre-emption warning)


def is_submitit_requeue(handler) -> bool:
    """True for submitit's handler that requeues the job and exits (installed in every submitit job)."""
    return getattr(handler, "__name__", "") == "checkpoint_and_try_requeue" and \
        type(getattr(handler, "__self__", None)).__module__.startswith("submitit")


class DeferredRequeue:
    """Holds submitit's handler while ours is installed on ``SUBMITIT_SIGNAL``."""

    def __init__(self) -> None:
        self.handler = None  # submitit's, while deferred

    def take_over(self, ours) -> None:
        """Install ``ours`` in place of submitit's handler, when submitit installed one (main thread only)."""
        if self.handler is None and is_submitit_requeue(signal.getsignal(SUBMITIT_SIGNAL)):
            self.handler = signal.signal(SUBMITIT_SIGNAL, ours)

    def give_back(self) -> None:
        """Not signalled: submitit's handler as it was."""
        if self.handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(SUBMITIT_SIGNAL, self.handler)
            self.handler = None

    def release(self):
        """Signalled: submitit's handler back on its signal, and a call that requeues (for the CLI to make last)."""
        handler, self.handler = self.handler, None
        signal.signal(SUBMITIT_SIGNAL, handler)
        return lambda: handler(SUBMITIT_SIGNAL, None)
