"""Test accuracy against sequence length: one NaFlex model against fixed-size models, one per length, on
Fashion-MNIST (body: vitpipe/tasks/naflex_curve.py): `python scripts/naflex_curve.py --out DIR [--epochs 10]`."""

import sys

from vitpipe.tasks.naflex_curve import main

if __name__ == "__main__":
    sys.exit(main())
