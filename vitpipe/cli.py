"""Shared entry wrapper: config mistakes print one line and exit 2, no traceback wall."""

from __future__ import annotations

import sys

from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from vitpipe.errors import ConfigError


def run_cli(fn, cfg):
    try:
        return fn(cfg)
    except (ConfigError, MissingMandatoryValue, InterpolationResolutionError) as e:
        print(f"vitpipe: error: {e}", file=sys.stderr)
        sys.exit(2)
