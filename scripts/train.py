"""Train (and test) a ViT: `python scripts/train.py [group=option ...] [key=value ...]`."""

from vitpipe.tasks.cli import hydra_main, run_cli
from vitpipe.tasks.train import train


@hydra_main(config_path="../conf", config_name="train")
def main(cfg) -> float | None:
    metrics = run_cli(train, cfg)
    return metrics.get(cfg.get("optimized_metric")) if metrics else None  # for Hydra sweepers


if __name__ == "__main__":
    main()
