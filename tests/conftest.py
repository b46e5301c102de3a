"""Compose Hydra configs the way scripts/train.py does (lightning-hydra-template style)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import vitpipe.config.build  # noqa: F401  (registers the auto_precision resolver)

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
