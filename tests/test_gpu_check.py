"""scripts/gpu_check.sh names only what exists (it runs where nobody watches, on a GPU machine lent for
minutes): both scripts parse, its pytest step selects the gpu tests of tests/test_gpu.py, its benchmark
commands parse with scripts/benchmark.py's flags and settings, and its train/eval commands compose
with conf/ and pass vitpipe's config checks, in the GPU mode and in --cpu-dry-run. It reads the
commands from ``gpu_check.sh --print-steps``, which runs nothing."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_cfg
from hydra.utils import instantiate

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def printed_steps(*flags: str) -> dict[str, list[str]]:
    done = subprocess.run(["bash", str(SCRIPT), "--print-steps", *flags], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    steps = {}
    for line in done.stdout.splitlines():
        name, command = line.split("\t", 1)
        steps[name] = shlex.split(command)
    return steps


def test_both_scripts_parse():
    for name in ("gpu_check.sh", "gpu_wheels.sh"):
        done = subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("mode", ["gpu", "cpu-dry-run"])
def test_every_step_names_what_exists(mode, tmp_path):
    from vitpipe.config.preflight import check_config
    from vitpipe.report.evaluation import eval_options

    steps = printed_steps(*(["--cpu-dry-run"] if mode == "cpu-dry-run" else []))
    expected = {"env", "tests", "bench_bf16", "recipe", "recipe_tta", "bench_switches"}
    expected |= {"bench_tf32", "bench_fp32"} if mode == "gpu" else set()
    assert set(steps) == expected

    # the tests step: the gpu marker (declared, out of the default suite) over tests/test_gpu.py,
    # where every test carries it
    argv = steps["tests"]
    pytest_args = argv[argv.index("pytest") + 1:]  # after `python -m pytest`
    assert pytest_args[pytest_args.index("-m") + 1] == "gpu" and "tests/test_gpu.py" in pytest_args
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"gpu: ', pyproject) and "not gpu" in pyproject
    import test_gpu

    assert any(m.name == "gpu" for m in test_gpu.pytestmark)
    assert len([n for n in dir(test_gpu) if n.startswith("test_")]) >= 10

    # benchmark commands: benchmark.py's own parser and its BenchConfig checks (on this machine's device)
    from vitpipe.benchmark.config import BenchConfig
    from vitpipe.benchmark.run import COMPARISONS, parse_args  # scripts/benchmark.py wraps it

    for name in [n for n in steps if n.startswith("bench_")]:
        argv = steps[name]
        assert argv[1] == "scripts/benchmark.py", name
        args = parse_args(argv[2:])
        assert args.device == ("cuda" if mode == "gpu" else "cpu") and args.out
        only = args.only.split(",")
        assert set(only) <= set(COMPARISONS), name
        cfg = BenchConfig(variant=args.variant, batch_size=args.batch_size, precision=args.precision,
                                   device="cpu", steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                                   workers=args.workers, switches=tuple(n for n in args.switches.split(",") if n))
        assert dataclasses.asdict(cfg)["variant"] == ("vit_b16" if mode == "gpu" else "vit_micro")

    # the recipe and its TTA evaluation: they compose, pass the config checks, and the data module
    # takes the carried files' folder (+data.system_dir)
    argv = steps["recipe"]
    assert argv[1] == "scripts/train.py" and "experiment=fmnist_vit" in argv
    cfg = make_cfg(tmp_path / "recipe", argv[2:])
    check_config(cfg)
    assert cfg.trainer.accelerator == ("gpu" if mode == "gpu" else "cpu") and cfg.data.download is False
    dm = instantiate(cfg.data)
    assert dm.system_dir == str(ROOT / ".gpu_data" / "fashion-mnist")
    assert re.fullmatch(r"\d+s", cfg.trainer.time_budget)  # the recipe fitted to the time the check has left
    argv = steps["recipe_tta"]
    assert argv[1] == "scripts/eval.py"
    cfg = make_cfg(tmp_path / "tta", argv[2:], config_name="eval")
    assert eval_options(cfg).tta == "hflip" and cfg.ckpt_path.endswith("/fmnist")
