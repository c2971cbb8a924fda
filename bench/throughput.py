"""Throughput benchmark: Orca iteration-level scheduling vs request-level batching, in one run.

The benchmark lives in orca_ext/benchmarks/throughput.py (so the installed `orca-ext bench` has
it too); this script runs it from a source checkout. See `python bench/throughput.py --help`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install

from orca_ext.benchmarks.throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
