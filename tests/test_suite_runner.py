"""The default suite's runner (tests/conftest.py): xdist workers, and tests marked ``alone`` run with no other test
beside them. Checked on a small suite of sleeping tests run by pytest in a subprocess, with the project's conftest."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SLEEPER = '''import os, time, pytest
{mark}
@pytest.mark.parametrize("i", range({n}))
def test_sleeps(i):
    start = time.time()
    time.sleep(0.3)
    with open({log!r}, "a") as f:
        f.write(f"{kind} {{os.environ.get('PYTEST_XDIST_WORKER', '-')}} {{start}} {{time.time()}}\\n")
'''


def _suite(tmp_path: Path) -> tuple[Path, Path]:
    """A folder with the project's conftest and pytest settings, two files of normal tests and one of ``alone``."""
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", suite / "conftest.py")
    shutil.copy(ROOT / "pyproject.toml", suite / "pyproject.toml")
    log = tmp_path / "intervals.log"
    for name, kind, mark, n in [("test_a.py", "N", "", 6), ("test_b.py", "N", "", 6),
                                ("test_c.py", "A", "@pytest.mark.alone", 3)]:
        (suite / name).write_text(SLEEPER.format(mark=mark, n=n, log=str(log), kind=kind))
    return suite, log


def _run(suite: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    env.pop("PYTEST_XDIST_TESTRUNUID", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=suite, env=env,
                          capture_output=True, text=True, timeout=300)


def _intervals(log: Path) -> list[tuple[str, str, float, float]]:
    return [(k, w, float(a), float(b)) for k, w, a, b in (line.split() for line in log.read_text().splitlines())]


@pytest.mark.slow  # three pytest processes starting up (~40 s on 2 cores): .ci/run's slow single tests
def test_alone_tests_run_with_nothing_beside_them_while_others_overlap(tmp_path):
    suite, log = _suite(tmp_path)
    r = _run(suite, "-n", "2")
    assert r.returncode == 0 and "15 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    rows = _intervals(log)
    assert {w for _, w, _, _ in rows} == {"gw0", "gw1"}
    alone = [(a, b) for k, _, a, b in rows if k == "A"]
    normal = [(a, b) for k, _, a, b in rows if k == "N"]
    assert len(alone) == 3 and len(normal) == 12
    assert not [(x, y) for x in alone for y in normal if x[0] < y[1] and y[0] < x[1]]  # no overlap with an alone test
    # the lock is not a global one: normal tests on the two workers did run side by side
    assert any(x[0] < y[1] and y[0] < x[1] for i, x in enumerate(normal) for y in normal[i + 1:])


def test_auto_workers_for_the_default_run_only():
    """``-n auto`` (pyproject's addopts): one worker per core (at most 4) for the default selection; one process
    for a marker expression (the slow runs, real services) or a single file."""
    import conftest

    (line,) = [line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith("addopts = ")]
    addopts = shlex.split(line.removeprefix("addopts = ").strip('"'))
    assert "-n" in addopts and addopts[addopts.index("-n") + 1] == "auto"
    default = "not slow and not gpu and not slurm and not s3"

    def workers(markexpr, *args):
        config = types.SimpleNamespace(option=types.SimpleNamespace(markexpr=markexpr), args=list(args),
                                       getini=lambda name: addopts)
        return conftest.pytest_xdist_auto_num_workers(config)

    cores = min(os.cpu_count() or 1, 4)
    assert workers(default, "tests") == cores
    assert workers(default, "tests/test_vit.py", "tests/test_rollout.py") == cores
    assert workers(default, "tests/test_vit.py") == 0
    assert workers(default, "tests/test_vit.py::test_a", "tests/test_vit.py::test_b") == 0
    assert workers("slow", "tests") == 0 and workers("slurm or s3", "tests") == 0
