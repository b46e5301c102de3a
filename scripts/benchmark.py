"""Benchmark training/inference throughput, peak memory and MFU (body: vitpipe/benchmark/run.py)."""

import sys

from vitpipe.benchmark.run import main

if __name__ == "__main__":
    sys.exit(main())
