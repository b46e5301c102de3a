"""Compose Hydra configs the way scripts/train.py does (lightning-hydra-template style)."""

from __future__ import annotations

import fcntl
import functools
import os
import tempfile
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

# pytest-xdist (`-n auto` in pyproject's addopts): each worker gets an equal share of the cores for torch's threads,
# set before torch starts its pool; the subprocesses a test starts inherit it unless the test sets its own
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if os.environ.get("PYTEST_XDIST_WORKER") and _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

import vitpipe  # noqa: E402, F401  (registers the configs' resolvers: ${auto_precision:}, ${variant:...}, ...)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

os.environ.setdefault("WANDB_MODE", "disabled")
# the image-folder decode cache (vitpipe/data/images.py) goes to a per-session folder, not ~/.cache
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="vitpipe-test-cache-")
os.environ.setdefault("WANDB_SILENT", "true")

# .ci/run's phases after the default suite share CI's wall time: past VITPIPE_CI_DEADLINE (seconds since the epoch)
# a test not yet started is skipped, with the command that runs it alone; none is cut in the middle. The default
# suite runs without a deadline.
_CI_DEADLINE = os.environ.get("VITPIPE_CI_DEADLINE")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _CI_DEADLINE and time.time() > float(_CI_DEADLINE):
        pytest.skip(f"CI's time is up (VITPIPE_CI_DEADLINE); run it alone: python -m pytest -m slow '{item.nodeid}'")


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: the default suite runs on one worker per core (at most 4), so the single-threaded parts of
    its tests (the subprocesses' start-up above all) overlap. Runs stay serial where parallel runs would change
    what they measure or share: a marker expression other than the default's (the slow runs, faults and real
    services that .ci/run times against its deadline) and runs of a single file or test."""
    if config.option.markexpr != default_markexpr(config):
        return 0
    files = {str(a).split("::")[0] for a in config.args}
    if len(files) == 1 and next(iter(files)).endswith(".py"):
        return 0
    return min(os.cpu_count() or 1, 4)


def default_markexpr(config) -> str:
    """The ``-m`` expression of pyproject's addopts: the default suite's selection."""
    addopts = list(config.getini("addopts"))
    return addopts[addopts.index("-m") + 1]


@functools.cache
def _room_locks(config) -> tuple | None:
    """Two lock files shared by this run's xdist workers (None in one process): a turnstile and the room. They live
    in the run's base temporary folder, the parent of each worker's own, which pytest removes with old runs."""
    if _WORKERS < 2 or not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    folder = config._tmp_path_factory.getbasetemp().parent
    return tuple(open(folder / f"vitpipe-{name}.lock", "a+") for name in ("turnstile", "room"))  # noqa: SIM115


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked ``alone`` measures wall time (a budget, a deadline): under xdist it runs with no other test
    beside it. Every test holds the room shared, an ``alone`` test holds it exclusively; the turnstile keeps a
    waiting ``alone`` test from being starved by the other workers' next tests (a fair readers-writer lock)."""
    locks = _room_locks(item.config)
    if locks is None:
        yield
        return
    turnstile, room = locks
    alone = item.get_closest_marker("alone") is not None
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    if alone:
        fcntl.flock(room, fcntl.LOCK_EX)  # the other workers' running tests end; their next ones wait at the turnstile
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    else:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(room, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(room, fcntl.LOCK_UN)


def make_cfg(tmp_path: Path, overrides: list[str] = (), config_name: str = "train") -> DictConfig:
    """A composed config with its output and log dirs under tmp_path, hydra resolvers usable."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "run")
        cfg.hydra.runtime.cwd = str(ROOT)
        cfg.hydra.job.num = 0
        cfg.paths.log_dir = str(tmp_path / "logs")
        cfg.paths.data_dir = str(tmp_path / "data")
    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.fixture
def cfg_factory(tmp_path):
    def factory(*overrides: str, config_name: str = "train", sub: str | None = None):
        base = tmp_path / sub if sub else tmp_path
        return make_cfg(base, overrides, config_name)

    yield factory
    GlobalHydra.instance().clear()


@pytest.fixture
def wandb_offline(monkeypatch):
    """WANDB_MODE=offline for one test, with a fresh wandb process singleton: wandb freezes its settings (the
    mode included) when a process first sets it up, so a test that ran earlier in this worker under the
    suite's WANDB_MODE=disabled would keep this one's run from being written at all."""
    wandb_setup = pytest.importorskip("wandb.sdk.wandb_setup")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(wandb_setup, "_singleton", None)
