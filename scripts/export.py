"""Export a classifier: `python scripts/export.py ckpt_path=<ckpt or run dir> format=timm|onnx out=<dir or .onnx>`."""

import hydra

from vitpipe.cli import run_cli
from vitpipe.export import export


@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
def main(cfg) -> None:
    run_cli(export, cfg)


if __name__ == "__main__":
    main()
