"""Run the chosen comparisons and gather one JSON-ready result (schema ``vitpipe.bench/1``)."""

from __future__ import annotations

import os
import platform

import lightning
import timm
import torch

from vitpipe.bench.data_path import compare_data
from vitpipe.bench.loops import compare_loops
from vitpipe.bench.memory import METHOD
from vitpipe.bench.settings import BenchConfig
from vitpipe.bench.switches import compare_switches
from vitpipe.bench.vit import compare_vit

SCHEMA = "vitpipe.bench/1"
RUNNERS = {"vit": compare_vit, "lightning": compare_loops, "data": compare_data, "switches": compare_switches}
DEFAULT_ONLY = ("vit", "lightning", "data")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def environment(cfg: BenchConfig) -> dict:
    return {
        "torch": torch.__version__, "timm": timm.__version__, "lightning": lightning.__version__,
        "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name() if cfg.device == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def run(cfg: BenchConfig, only: tuple[str, ...] = DEFAULT_ONLY) -> dict:
    """``{"schema", "config", "env", "memory_method", "results": {comparison: {"contenders", "ratios", ...}}}``."""
    load_start = os.getloadavg()
    results = {name: RUNNERS[name](cfg) for name in only}
    return {
        "schema": SCHEMA,
        "config": cfg.to_dict(),
        "env": {**environment(cfg), "loadavg_1m_start": load_start[0], "loadavg_1m_end": os.getloadavg()[0]},
        "memory_method": METHOD[cfg.device],
        "results": results,
    }
