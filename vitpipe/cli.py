"""Shared entry wrapper: mistakes and stops print one line, no traceback wall.

Exit statuses: 0 done; 2 a configuration mistake; 3 a NaN/inf loss stopped training; 74 a full disk
(EX_IOERR; earlier checkpoints are intact); 128 + signal for a stop by a signal: 143 SIGTERM,
130 SIGINT (Ctrl-C). A stop while fitting has written a resumable ``last.ckpt`` first.
"""

from __future__ import annotations

import signal
import sys

from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from vitpipe.errors import ConfigError
from vitpipe.lit.checkpointing import DiskFullError, SecondInterrupt, disk_full_cause
from vitpipe.lit.classifier import NonFiniteLossError

EXIT_CONFIG, EXIT_NONFINITE, EXIT_DISK_FULL = 2, 3, 74


def run_cli(fn, cfg):
    try:
        return fn(cfg)
    except (ConfigError, MissingMandatoryValue, InterpolationResolutionError) as e:
        print(f"vitpipe: error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except NonFiniteLossError as e:
        print(f"vitpipe: stopped: {e}", file=sys.stderr)
        sys.exit(EXIT_NONFINITE)
    except SIGTERMException as e:
        print(stop_message(e), file=sys.stderr)
        sys.exit(128 + getattr(e, "vitpipe_signal", signal.SIGTERM))  # what a job killed by it reports
    except (KeyboardInterrupt, SecondInterrupt) as e:  # Ctrl-C outside a Trainer stage, or pressed twice
        why = " (pressed twice: stopped at once)" if isinstance(e, SecondInterrupt) else ""
        print(f"vitpipe: interrupted by SIGINT{why}; nothing was saved by the interrupt", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Exception as e:
        full = disk_full_cause(e)
        if full is None:
            raise
        print(f"vitpipe: error: {disk_full_message(full)}", file=sys.stderr)
        sys.exit(EXIT_DISK_FULL)


def stop_message(e: SIGTERMException) -> str:
    name = signal.Signals(getattr(e, "vitpipe_signal", signal.SIGTERM)).name
    saved = getattr(e, "vitpipe_checkpoint", None)
    if saved:
        return (f"vitpipe: stopped by {name} at global step {e.vitpipe_step}; saved {saved}: "
                f"rerun with ckpt_path=last (or ckpt_path={saved}) to continue")
    stage = getattr(e, "vitpipe_stage", None)
    return f"vitpipe: stopped by {name}{f' during {stage}' if stage else ''}; no checkpoint was written by the stop"


def disk_full_message(e: OSError) -> str:
    where = e.filename or "a file"
    if isinstance(e, DiskFullError):  # our atomic writer: the partial file is gone, the old one untouched
        return (f"{e.strerror} writing {where}; earlier checkpoints are intact (the partial file was removed): "
                f"free space, then rerun with ckpt_path=last")
    return f"{e.strerror} writing {where}"
