"""``python -m vitpipe.benchmark``: the same command as scripts/benchmark.py."""

import sys

from vitpipe.benchmark.run import main

sys.exit(main())
