"""Attention figures: `python scripts/visualize_attention.py ckpt_path=<ckpt or run dir> images=<folder|val|test>`."""

import hydra

from vitpipe.cli import run_cli
from vitpipe.viz.visualize import visualize


@hydra.main(version_base="1.3", config_path="../conf", config_name="visualize")
def main(cfg) -> None:
    run_cli(visualize, cfg)


if __name__ == "__main__":
    main()
