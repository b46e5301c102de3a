"""Attention figures: `python scripts/visualize_attention.py ckpt_path=<ckpt or run dir> images=<folder|val|test>`
(also `vitpipe visualize`)."""

import sys

from vitpipe.commands import command

main = command("visualize")  # the command as `vitpipe visualize` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
