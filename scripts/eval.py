"""Test a checkpoint: `python scripts/eval.py ckpt_path=<file|run dir|last> [data=<name>] [split=val] [calibrate=true] [tta=hflip]`."""

import hydra

from vitpipe.cli import run_cli
from vitpipe.evaluate import evaluate


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg) -> None:
    run_cli(evaluate, cfg)


if __name__ == "__main__":
    main()
