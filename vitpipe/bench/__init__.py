"""Throughput, memory and MFU benchmarks: vitpipe vs timm, Lightning vs a plain loop, fast vs PIL data.

``scripts/benchmark.py`` is the command line; ``run(BenchConfig(...), only=...)`` the function.
"""

from vitpipe.bench.report import format_table
from vitpipe.bench.runner import DEFAULT_ONLY, RUNNERS, SCHEMA, run
from vitpipe.bench.settings import BenchConfig, parse_only

__all__ = ["BenchConfig", "DEFAULT_ONLY", "RUNNERS", "SCHEMA", "format_table", "parse_only", "run"]
