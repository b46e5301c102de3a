"""Fashion-MNIST items on canvases of random aspect ratio (1:3 to 3:1), as an image folder (body:
vitpipe/tasks/make_aspect_data.py): `python scripts/make_aspect_data.py --out DIR [--train N --val N --test N --seed S]`."""

import sys

from vitpipe.commands import command

main = command("make_aspect_data")  # the command as `vitpipe make_aspect_data` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
