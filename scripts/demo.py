"""A demo page for a classifier: `python scripts/demo.py ckpt_path=<ckpt | run dir | last>` (Gradio, 127.0.0.1)."""

from vitpipe.tasks.cli import hydra_main, run_cli
from vitpipe.tasks.demo import demo


@hydra_main(config_path="../conf", config_name="demo")
def main(cfg) -> None:
    run_cli(demo, cfg)


if __name__ == "__main__":
    main()
