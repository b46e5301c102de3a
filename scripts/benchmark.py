"""Benchmark training/inference throughput, peak memory and MFU (body: vitpipe/tasks/benchmark.py)."""

import sys

from vitpipe.tasks.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
