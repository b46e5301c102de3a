"""When the run now starting began, for a time budget that holds the command's whole wall time.

A command typed in a shell (``python scripts/train.py ...``, ``vitpipe train ...``) spends its first
seconds starting Python, importing torch and composing the config before a run's code runs: about 6 s
on a 2-core CPU. ``typed_command()`` (entered by the script and console entry points only) makes the
first run of the process count from the process's own start, and each later run of the same process
(a multirun's next job) from the end of the one before. Code that calls ``train(cfg)`` itself (a
notebook, a test) has started long before, for its own reasons: its runs count from their call.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

_next_run_from: float | None = None  # time.monotonic() the next run counts from (None: from its own call)
# What a typed command spends after its run's last file: the interpreter tearing down the ~4,000 modules of the
# training stack (python -c "import vitpipe.tasks.train" exits 1.3 s after its last line on a 2-core AMD EPYC;
# a 20 s budget's run, 1.6 s). A budget keeps it free, so the command's wall time holds.
EXIT_S = 2.0


@contextlib.contextmanager
def typed_command() -> Iterator[None]:
    """Inside: the runs of this process count from its start (the first) or the previous run's end (the next).
    On leaving, runs count from their own call again: a test or notebook that ran a script's ``main()`` in its
    own process must not have its later ``train(cfg)`` charged with the time since that process began."""
    global _next_run_from
    _next_run_from = time.monotonic() - _process_age()
    try:
        yield
    finally:
        _next_run_from = None


def exit_reserve() -> float:
    """Seconds a budget keeps for the process's exit after the run: ``EXIT_S`` for a typed command, else 0."""
    return EXIT_S if _next_run_from is not None else 0.0


def run_began() -> float:
    """``time.monotonic()`` the run starting now counts its time from."""
    return time.monotonic() if _next_run_from is None else _next_run_from


def run_ended() -> None:
    global _next_run_from
    if _next_run_from is not None:
        _next_run_from = time.monotonic()


def _process_age() -> float:
    """Seconds since this process started (Linux: ``/proc/self/stat``'s start time against ``CLOCK_BOOTTIME``;
    elsewhere 0: the runs count from the entry point)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError, IndexError):
        return 0.0
    return min(max(age, 0.0), 60.0)  # an entry point is reached within seconds of the start
