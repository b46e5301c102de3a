"""Rebuild a sweep's summary: `python scripts/sweep_report.py <sweep_dir> [--metric test/acc]`."""

import sys

from vitpipe.tasks.sweep_report import main

if __name__ == "__main__":
    sys.exit(main())
