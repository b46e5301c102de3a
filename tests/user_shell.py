"""Run commands the way a user types them: from a fresh working directory that looks like a checkout
(``scripts/`` and ``conf/`` linked in, nothing else: no logs/, no data/), through the real CLI in a
subprocess, with the test's Python standing in for ``python``."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# appended to a training command so that it finishes in seconds; nothing else is ever added
SHORT_TRAIN = ["trainer.max_epochs=1", "++trainer.limit_train_batches=2", "++trainer.limit_val_batches=2",
               "++trainer.limit_test_batches=2"]


def fresh_checkout(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    for name in ("scripts", "conf"):
        link = where / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)
    return where


def user_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def argv(command: str | list[str]) -> list[str]:
    args = shlex.split(command) if isinstance(command, str) else list(command)
    if args and args[0] == "python":
        args[0] = sys.executable
    elif args and args[0] == "torchrun":
        args = [sys.executable, "-m", "torch.distributed.run", *args[1:]]
    return args


def popen(command, cwd: Path, *, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv(command), cwd=cwd, env=env or user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run(command, cwd: Path, *, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv(command), cwd=cwd, env=env or user_env(), capture_output=True, text=True,
                          timeout=timeout)


def run_dir_of(stdout: str) -> Path:
    """The ``run dir`` line of train's summary."""
    lines = [ln.split("run dir", 1)[1].strip() for ln in stdout.splitlines() if ln.strip().startswith("run dir")]
    assert lines, f"no 'run dir' line in:\n{stdout[-2000:]}"
    return Path(lines[-1])
