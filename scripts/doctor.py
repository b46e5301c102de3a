"""Check attention on your own model: `python scripts/doctor.py ckpt_path=<run dir or .ckpt>` or
`python scripts/doctor.py model=vit_micro` (also `vitpipe doctor`); docs/doctor.md."""

import sys

from vitpipe.commands import command

main = command("doctor")  # the command as `vitpipe doctor` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
