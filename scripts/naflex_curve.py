"""Test accuracy against sequence length: one NaFlex model against fixed-size models, one per length, on
Fashion-MNIST (body: vitpipe/tasks/naflex_curve.py): `python scripts/naflex_curve.py --out DIR [--epochs 10]`."""

import sys

from vitpipe.commands import command

main = command("naflex_curve")  # the command as `vitpipe naflex_curve` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
