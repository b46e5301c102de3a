"""The GPU check's first step: the machine and its packages as JSON (``gpu_check``'s report heads its
tables with it). A step of its own, in its own process under the step timeout: a CUDA driver that
hangs at initialisation stops this step, not the check.

    python -m vitpipe.benchmark.gpu_env OUT.json [--cpu-dry-run]

Without ``--cpu-dry-run`` a machine where torch sees no CUDA device fails the step with one line.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import torch

from vitpipe.benchmark.common import cpu_name
from vitpipe.run.files import atomic_write_text


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
    for name in ("lightning", "timm", "torchmetrics", "torchvision", "hydra", "omegaconf"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:  # recorded, not fatal: the steps that need it fail on their own
            info[name] = f"missing ({type(e).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"device_name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
                 "multiprocessors": p.multi_processor_count, "bf16_supported": torch.cuda.is_bf16_supported()}
        info["driver"] = _output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], 20)
    else:
        info |= {"device_name": cpu_name(), "driver": "-"}
    info["commit"] = _output(["git", "rev-parse", "--short", "HEAD"], 10)
    return info


def _output(argv: list[str], timeout: float) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out, dry = next(a for a in args if not a.startswith("-")), "--cpu-dry-run" in args
    info = machine()
    atomic_write_text(out, json.dumps(info, indent=2))
    print(json.dumps(info, indent=2))
    if not dry and not torch.cuda.is_available():
        print("gpu_check: error: torch sees no CUDA device; use --cpu-dry-run on a machine without one", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
