"""Benchmark training/inference throughput, peak memory and MFU; prints a table, writes JSON.

    python scripts/benchmark.py --variant vit_ti4 --batch-size 64 --out results.json
    python scripts/benchmark.py --only vit --device cuda --precision bf16-mixed --compile --batch-size 256

Comparisons (--only, comma-separated): vit (vitpipe vs timm, same weights), lightning (plain loop vs
Trainer.fit), data (fast path vs PIL DataLoader), switches (fused AdamW, compile, channels-last, SDPA
backends). Contenders alternate (A B, B A, ...) so a shared machine's load hits them alike; the
figure is the median over repeats of each repeat's median step time, warm-up steps excluded.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch

from vitpipe.bench import DEFAULT_ONLY, BenchConfig, format_table, parse_only, run
from vitpipe.errors import ConfigError


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
    p.add_argument("--only", default=",".join(DEFAULT_ONLY), help="vit,lightning,data,switches")
    p.add_argument("--switches", default="", help="subset of the switches comparison, e.g. adamw_fused,sdpa_math "
                   "(default: all; compile's warm-up takes a minute on a CPU)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = BenchConfig(variant=args.variant, img_size=args.img_size, batch_size=args.batch_size,
                          num_classes=args.num_classes, precision=args.precision, device=args.device,
                          compile=args.compile, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                          workers=args.workers, switches=tuple(n for n in args.switches.split(",") if n))
        only = parse_only(args.only)
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
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
