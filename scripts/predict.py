"""Predict image files: `python scripts/predict.py ckpt_path=<ckpt or run dir> images=<folder|file|glob> out=preds.csv`."""

from vitpipe.tasks.cli import hydra_main, run_cli
from vitpipe.tasks.predict import predict


@hydra_main(config_path="../conf", config_name="predict")
def main(cfg) -> None:
    run_cli(predict, cfg)


if __name__ == "__main__":
    main()
