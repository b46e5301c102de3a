"""Test a checkpoint: `python scripts/eval.py ckpt_path=<file|run dir|last> [data=<name>] [split=val] [calibrate=true] [tta=hflip]`."""

from vitpipe.tasks.cli import hydra_main, run_cli
from vitpipe.tasks.evaluate import evaluate


@hydra_main(config_path="../conf", config_name="eval")
def main(cfg) -> None:
    run_cli(evaluate, cfg)


if __name__ == "__main__":
    main()
