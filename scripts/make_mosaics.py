"""Fashion-MNIST 2x2 mosaics labelled with the set of classes present, as an image folder with a labels file
(body: vitpipe/tasks/make_mosaics.py): `python scripts/make_mosaics.py --out DIR [--train N --val N --test N --seed S]`."""

import sys

from vitpipe.commands import command

main = command("make_mosaics")  # the command as `vitpipe make_mosaics` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
