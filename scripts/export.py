"""Export a classifier: `python scripts/export.py ckpt_path=<ckpt or run dir> format=timm|onnx out=<dir or .onnx>`
(also `vitpipe export`)."""

import sys

from vitpipe.commands import command

main = command("export")  # the command as `vitpipe export` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
