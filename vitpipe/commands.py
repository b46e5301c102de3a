"""vitpipe's commands, each defined once: ``vitpipe <name> [args]`` (the console entry point,
``vitpipe/__main__.py``) and ``python scripts/<script>.py [args]`` (a checkout) both run ``run(name, args)``.

A Hydra command (``config`` set) composes the shipped config of that name (``pkg://vitpipe.conf``, see
``vitpipe.config.shipped``), checks the command line first and runs its body through ``run_cli`` (one-line
errors, exit statuses: ``vitpipe.tasks.cli``); its arguments are Hydra's (``key=value``, ``-m``,
``--config-dir``, ``--help``). The others parse their own arguments (argparse) and return an exit status.
Bodies are named as ``module:function`` and imported only when their command runs, so ``vitpipe --help``
does not import every command's dependencies (Gradio, LitServe, ...).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    body: str               # "module:function": cfg -> result (Hydra) or argv -> exit status
    summary: str            # one line of `vitpipe --help`
    config: str | None = None   # the shipped primary config a Hydra command composes
    script: str = ""        # scripts/<script>.py when not the command's name


COMMANDS: dict[str, Command] = {
    "train": Command("vitpipe.tasks.train:train", "train (and test) a model", "train"),
    "eval": Command("vitpipe.tasks.evaluate:evaluate", "test a checkpoint: metrics and a report", "eval"),
    "predict": Command("vitpipe.tasks.predict:predict", "predict image files into CSV/JSON", "predict"),
    "export": Command("vitpipe.tasks.export:export", "export a classifier: timm folder or ONNX", "export"),
    "serve": Command("vitpipe.tasks.serve:serve", "serve a checkpoint over HTTP", "serve"),
    "demo": Command("vitpipe.tasks.demo:demo", "a Gradio demo page for a checkpoint", "demo"),
    "visualize": Command("vitpipe.tasks.visualize:visualize", "attention and explanation figures", "visualize",
                         script="visualize_attention"),
    "doctor": Command("vitpipe.tasks.doctor:main", "check attention (scale, positions, causality) on a model",
                      "doctor"),
    "make_shards": Command("vitpipe.tasks.make_shards:make_shards_from_config", "convert a data set to shards",
                           "make_shards"),
    "make_teacher": Command("vitpipe.tasks.make_teacher:main", "a trained run as a distillation teacher file"),
    "make_aspect_data": Command("vitpipe.tasks.make_aspect_data:main", "Fashion-MNIST at random aspect ratios"),
    "make_mosaics": Command("vitpipe.tasks.make_mosaics:main", "Fashion-MNIST multi-label mosaics"),
    "naflex_curve": Command("vitpipe.tasks.naflex_curve:main", "NaFlex accuracy against sequence length"),
    "sweep_report": Command("vitpipe.tasks.sweep_report:main", "rebuild a sweep's summary"),
    "benchmark": Command("vitpipe.benchmark.run:main", "throughput, memory and MFU"),
}


def command(name: str) -> Callable[[], int]:
    """``main()`` of ``scripts/<script>.py``: the command as typed after the script's name (sys.argv[1:])."""
    if name not in COMMANDS:
        raise KeyError(name)
    def main() -> int:
        from vitpipe.run.wallclock import typed_command

        with typed_command():  # a time budget holds the process's whole wall time, start-up included
            return run(name)

    return main


def run(name: str, args: list[str] | None = None) -> int:
    """Run command ``name`` with ``args`` (None: ``sys.argv[1:]``, a script's own arguments); returns its
    exit status, or exits with it (a configuration mistake: 2, see ``vitpipe.tasks.cli``)."""
    cmd = COMMANDS[name]
    args = sys.argv[1:] if args is None else list(args)
    module, _, function = cmd.body.partition(":")
    if cmd.config is None:
        return getattr(importlib.import_module(module), function)(args) or 0
    return _run_hydra(cmd, module, function, args)


def _run_hydra(cmd: Command, module: str, function: str, args: list[str]) -> int:
    from hydra._internal.utils import get_args_parser  # the parser @hydra.main itself uses

    from vitpipe.config.shipped import shadowed
    from vitpipe.tasks.cli import EXIT_CONFIG, hydra_main, run_cli, say_once

    try:
        config_dir = get_args_parser().parse_args(args).config_dir
    except SystemExit:  # a malformed command line: Hydra prints its usage below
        config_dir = None
    taken = shadowed(config_dir) if config_dir else []
    if taken:
        say_once(f"vitpipe: error: --config-dir {config_dir}: {', '.join(f'{t}.yaml' for t in taken)} "
                 "named like a shipped config, which Hydra finds first; give yours another name "
                 "(e.g. model/my_vit.yaml, then model=my_vit)")
        sys.exit(EXIT_CONFIG)
    typed = list(sys.argv)

    @hydra_main(config_name=cmd.config)
    def task(cfg):
        # Lightning starts DDP ranks again from sys.argv: as typed (`vitpipe train ...`), not as Hydra read it
        sys.argv[:] = typed
        # the body (torch, Lightning, ...) is imported once the command line has passed its check: a mistake
        # there is printed in a second, not after the imports
        body = getattr(importlib.import_module(module), function)
        result = run_cli(body, cfg)
        metric = cfg.get("optimized_metric")
        return result.get(metric) if metric and isinstance(result, dict) else None  # for Hydra sweepers (optuna)

    sys.argv[:] = [typed[0], *args]  # @hydra.main reads the command line from sys.argv
    try:
        task()
    finally:
        sys.argv[:] = typed
    return 0
