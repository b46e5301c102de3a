"""Shared entry wrapper: mistakes and stops print one line, no traceback wall."""

from __future__ import annotations

import sys

from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from vitpipe.errors import ConfigError
from vitpipe.lit.classifier import NonFiniteLossError


def run_cli(fn, cfg):
    try:
        return fn(cfg)
    except (ConfigError, MissingMandatoryValue, InterpolationResolutionError) as e:
        print(f"vitpipe: error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteLossError as e:
        print(f"vitpipe: stopped: {e}", file=sys.stderr)
        sys.exit(3)
    except SIGTERMException:
        print("vitpipe: stopped by SIGTERM; a resumable last.ckpt was written: rerun with ckpt_path=last",
              file=sys.stderr)
        sys.exit(143)  # 128 + SIGTERM, what a killed job reports
