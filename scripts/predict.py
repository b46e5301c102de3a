"""Predict image files: `python scripts/predict.py ckpt_path=<ckpt or run dir> images=<folder|file|glob> out=preds.csv`
(also `vitpipe predict`)."""

import sys

from vitpipe.commands import command

main = command("predict")  # the command as `vitpipe predict` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
