"""Rebuild a sweep's summary (CSV, markdown, PNG): `python scripts/sweep_report.py <sweep_dir> [--metric test/acc]`."""

import argparse
import sys
from pathlib import Path

from vitpipe.sweep.summary import write_summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--metric", default=None, help="metric to plot (default: the first of val/acc_best, test/acc, ...)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"sweep_report: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    rows = write_summary(args.sweep_dir, args.metric)
    if not rows:
        print(f"sweep_report: no job folders (0/, 1/, ...) in {args.sweep_dir}", file=sys.stderr)
        return 2
    print((args.sweep_dir / "summary.md").read_text())
    return 0

