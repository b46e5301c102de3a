"""Export a classifier: `python scripts/export.py ckpt_path=<ckpt or run dir> format=timm|onnx out=<dir or .onnx>`."""

from vitpipe.tasks.cli import hydra_main, run_cli
from vitpipe.tasks.export import export


@hydra_main(config_path="../conf", config_name="export")
def main(cfg) -> None:
    run_cli(export, cfg)


if __name__ == "__main__":
    main()
