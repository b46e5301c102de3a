"""Train (and test) a ViT: `python scripts/train.py [group=option ...] [key=value ...]` (also `vitpipe train`)."""

import sys

from vitpipe.commands import command

main = command("train")  # the command as `vitpipe train` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
