"""Test a checkpoint: `python scripts/eval.py ckpt_path=<file|run dir|last> [data=<name>] [split=val] [calibrate=true]
[tta=hflip]` (also `vitpipe eval`)."""

import sys

from vitpipe.commands import command

main = command("eval")  # the command as `vitpipe eval` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
