"""Convert a data set to shards: `python scripts/make_shards.py data=<data config> out=DIR [shard_size=64MB]`."""

import hydra

from vitpipe.cli import run_cli
from vitpipe.data.make_shards import make_shards_from_config


@hydra.main(version_base="1.3", config_path="../conf", config_name="make_shards")
def main(cfg) -> None:
    run_cli(make_shards_from_config, cfg)


if __name__ == "__main__":
    main()
