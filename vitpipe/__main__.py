"""``vitpipe <command> [args]``: the console entry point (also ``python -m vitpipe``), from any directory.

``vitpipe train model=vit_s4 data=fashion_mnist`` is ``python scripts/train.py model=vit_s4
data=fashion_mnist`` of a checkout: the same command (``vitpipe.commands``), composed from the configs
shipped in the package. ``vitpipe cp <config> <dest>`` copies a shipped config out to edit (torchtune's
``tune cp``); ``vitpipe <command> --config-dir <dest folder>`` then finds it beside the shipped ones.
"""

from __future__ import annotations

import argparse
import sys

from vitpipe.commands import COMMANDS, run

USAGE = "vitpipe <command> [args]   (vitpipe <command> --help: its arguments)"
CP_HELP = """usage: vitpipe cp <config> <dest>

Copy a shipped config out to edit. <config>: its Hydra name, e.g. train, model/vit_s4,
experiment/fmnist_vit (.yaml optional). <dest>: a .yaml file, else a folder (made if missing)
where it keeps its file name. An existing file is never replaced.

Hydra searches --config-dir after the shipped configs, so give the copy a name of its own:
  vitpipe cp model/vit_s4 my_conf/model/my_vit.yaml
  vitpipe train --config-dir my_conf model=my_vit
"""


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the console entry point: a time budget holds the process's whole wall time
        from vitpipe.run.wallclock import typed_command

        with typed_command():
            return _main(sys.argv[1:])
    return _main(list(argv))


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(overview())
        return 0
    name, args = argv[0], argv[1:]
    if name == "cp":
        return copy(args)
    if name not in COMMANDS:
        from vitpipe.config.checks import did_you_mean

        print(f"vitpipe: error: {name} is not a vitpipe command" + did_you_mean(name, [*COMMANDS, "cp"], shown=20),
              file=sys.stderr)
        return 2
    if COMMANDS[name].config is not None:
        return run(name, args)
    # argparse names its program after sys.argv[0]: `usage: vitpipe make_teacher run out`, not `usage: vitpipe run out`
    typed, sys.argv[0] = sys.argv[0], f"vitpipe {name}"
    try:
        return run(name, args)
    finally:
        sys.argv[0] = typed


def overview() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {USAGE}", "", "commands:"]
    for name, cmd in COMMANDS.items():
        script = f" (scripts/{cmd.script}.py)" if cmd.script else ""
        lines.append(f"  {name:<{width}}  {cmd.summary}{script}")
    lines.append(f"  {'cp':<{width}}  copy a shipped config out to edit: vitpipe cp <config> <dest>")
    return "\n".join(lines)


def copy(args: list[str]) -> int:
    from vitpipe.config.shipped import copy_config
    from vitpipe.errors import ConfigError

    parser = argparse.ArgumentParser(prog="vitpipe cp", add_help=False)
    parser.add_argument("config", nargs="?")
    parser.add_argument("dest", nargs="?")
    parser.add_argument("-h", "--help", action="store_true")
    known, extra = parser.parse_known_args(args)
    if known.help:
        print(CP_HELP, end="")
        return 0
    if known.config is None or known.dest is None or extra:
        print("vitpipe: error: vitpipe cp takes <config> <dest>, e.g. vitpipe cp model/vit_s4 my_conf/model/my_vit.yaml",
              file=sys.stderr)
        return 2
    try:
        written = copy_config(known.config, known.dest)
    except ConfigError as e:
        print(f"vitpipe: error: {e}", file=sys.stderr)
        return 2
    print(f"vitpipe: copied {known.config} to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
