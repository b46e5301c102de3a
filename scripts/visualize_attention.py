"""Attention figures: `python scripts/visualize_attention.py ckpt_path=<ckpt or run dir> images=<folder|val|test>`."""

from vitpipe.tasks.cli import hydra_main, run_cli
from vitpipe.tasks.visualize import visualize


@hydra_main(config_path="../conf", config_name="visualize")
def main(cfg) -> None:
    run_cli(visualize, cfg)


if __name__ == "__main__":
    main()
