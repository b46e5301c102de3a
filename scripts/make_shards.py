"""Convert a data set to shards: `python scripts/make_shards.py data=<data config> out=DIR [shard_size=64MB]`
(also `vitpipe make_shards`)."""

import sys

from vitpipe.commands import command

main = command("make_shards")  # the command as `vitpipe make_shards` runs it (vitpipe/commands.py)

if __name__ == "__main__":
    sys.exit(main())
