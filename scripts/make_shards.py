"""Convert a data set to shards: `python scripts/make_shards.py data=<data config> out=DIR [shard_size=64MB]`."""

from vitpipe.tasks.cli import hydra_main, run_cli
from vitpipe.tasks.make_shards import make_shards_from_config


@hydra_main(config_path="../conf", config_name="make_shards")
def main(cfg) -> None:
    run_cli(make_shards_from_config, cfg)


if __name__ == "__main__":
    main()
