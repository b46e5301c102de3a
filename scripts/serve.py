"""Serve a checkpoint over HTTP: `python scripts/serve.py ckpt_path=<ckpt | run dir | last> [port=8000 backend=torch|onnx]`
(also `vitpipe serve`)."""

import sys

from vitpipe.commands import command

main = command("serve")  # the command as `vitpipe serve` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
