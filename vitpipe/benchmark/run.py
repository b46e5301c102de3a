"""Benchmark training/inference throughput, peak memory and MFU; prints a table, writes JSON.

    python scripts/benchmark.py --variant vit_ti4 --batch-size 64 --out results.json
    python scripts/benchmark.py --only vit --device cuda --precision bf16-mixed --compile --batch-size 256
    python scripts/benchmark.py --only serve --batch-size 32 --requests 2000 --clients 16

Comparisons (--only, comma-separated): vit (vitpipe vs timm, same weights), lightning (plain loop vs
Trainer.fit), data (fast path vs PIL DataLoader), shards (data=shards vs data=imagefolder reading the
same JPEG files, decoding + augmenting in ``--workers`` processes), switches (fused AdamW, compile, channels-last, SDPA
backends), mae (MAE step vs the reference's way), naflex (patch-dict input: a padded batch of mixed-aspect
images vs the fixed square path at about the same valid tokens, and vs timm's NaFlexVit, same weights), serve
(scripts/serve.py under a bounded loopback load, ``--requests`` from ``--clients`` threads: dynamic batching with
max_batch_size=--batch-size vs max_batch_size=1, and vs scripts/predict.py on the same files), long_seq (dense
SDPA vs the explicit path, gradient checkpointing and the local + global pattern through masked SDPA and
flex_attention, at 1,024 to 4,096 tokens; its own sizes, batch 1), tokens (training with patch dropout and
inference with token merging against the unmodified model, same weights; its own shapes and batches), teacher
(the pass precomputing a teacher's logits: channels-last batches of 128 vs contiguous batches of 1,000).
Contenders alternate (A B, B A, ...) so a shared machine's load hits them alike; the figure is the median
over repeats of each repeat's median step time, warm-up steps excluded.

Everything trained here is built from conf/ as ``scripts/train.py model=<variant> data=synthetic``
composes it (model, AdamW groups, schedule, label smoothing, gradient clipping), so the benchmark
times the training recipe itself. It needs a checkout (conf/). Each comparison is its own module of
``vitpipe.benchmark`` (vit.py, lightning.py, ...); the timing, memory and FLOP tools are
``vitpipe.benchmark.common``, the table ``vitpipe.benchmark.table``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from dataclasses import asdict

import torch

from vitpipe.benchmark.common import MEMORY_METHOD, environment
from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.table import format_table
from vitpipe.errors import ConfigError
from vitpipe.run.files import atomic_write_text

SCHEMA = "vitpipe.bench/1"
# --only name -> its module vitpipe.benchmark.<name>, holding compare_<name>(cfg) -> {"contenders", "ratios", ...}
COMPARISONS = ("vit", "lightning", "data", "shards", "switches", "mae", "naflex", "serve", "long_seq", "tokens", "teacher")
DEFAULT_ONLY = ("vit", "lightning", "data")


def comparison(name: str):
    """``compare_<name>``, imported when asked for: a comparison's own dependencies (the server stack of
    serve, litdata of shards) are needed only by a run that includes it."""
    return getattr(importlib.import_module(f"vitpipe.benchmark.{name}"), f"compare_{name}")


def run(cfg: BenchConfig, only: tuple[str, ...] = DEFAULT_ONLY) -> dict:
    """``{"schema", "config", "env", "memory_method", "results": {comparison: {"contenders", "ratios", ...}}}``."""
    load_start = os.getloadavg()[0]
    results = {name: comparison(name)(cfg) for name in only}
    return {"schema": SCHEMA, "config": {**asdict(cfg), "img_size": cfg.size},
            "env": {**environment(cfg), "loadavg_1m_start": load_start, "loadavg_1m_end": os.getloadavg()[0]},
            "memory_method": MEMORY_METHOD[cfg.device], "results": results}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="vit_ti4", help="registry name (vitpipe/models/registry.py)")
    p.add_argument("--img-size", type=int, default=None, help="default: the variant's size")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--precision", default="32-true", help="32-true | bf16-mixed | 16-mixed (CUDA)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile the models (vit, lightning)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of the PIL path")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--tf32", action="store_true", help="let fp32 matmuls use TF32 on CUDA")
    p.add_argument("--only", default=",".join(DEFAULT_ONLY), help=",".join(COMPARISONS))
    p.add_argument("--switches", default="", help="subset of the switches comparison, e.g. adamw_fused,sdpa_math "
                   "(default: all; compile's warm-up takes a minute on a CPU)")
    p.add_argument("--requests", type=int, default=2000, help="serve: requests per server contender")
    p.add_argument("--clients", type=int, default=16, help="serve: concurrent client threads")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    only = tuple(n.strip() for n in args.only.split(",") if n.strip())
    try:
        bad = [n for n in only if n not in COMPARISONS]
        if bad or not only:
            raise ConfigError(f"--only {args.only!r}: unknown {bad or 'empty'}; choose among {', '.join(COMPARISONS)}")
        cfg = BenchConfig(variant=args.variant, img_size=args.img_size, batch_size=args.batch_size,
                          num_classes=args.num_classes, precision=args.precision, device=args.device,
                          compile=args.compile, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                          workers=args.workers, switches=tuple(n for n in args.switches.split(",") if n),
                          serve_requests=args.requests, serve_clients=args.clients)
    except ConfigError as e:
        print(f"benchmark: error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    result = run(cfg, only)
    print(format_table(result))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0

