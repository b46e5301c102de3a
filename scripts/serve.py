"""Serve a checkpoint over HTTP: `python scripts/serve.py ckpt_path=<ckpt | run dir | last> [port=8000 backend=torch|onnx]`."""

from vitpipe.tasks.cli import hydra_main, run_cli
from vitpipe.tasks.serve import serve


@hydra_main(config_path="../conf", config_name="serve")
def main(cfg) -> None:
    run_cli(serve, cfg)


if __name__ == "__main__":
    main()
