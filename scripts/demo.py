"""A demo page for a classifier: `python scripts/demo.py ckpt_path=<ckpt | run dir | last>` (Gradio, 127.0.0.1)
(also `vitpipe demo`)."""

import sys

from vitpipe.commands import command

main = command("demo")  # the command as `vitpipe demo` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
