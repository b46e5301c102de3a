"""Rebuild a sweep's summary: `python scripts/sweep_report.py <sweep_dir> [--metric test/acc]`."""

import sys

from vitpipe.commands import command

main = command("sweep_report")  # the command as `vitpipe sweep_report` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
