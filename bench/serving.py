"""Online serving benchmark against a running `orca-ext serve` (vLLM's serving-benchmark metrics).

The benchmark lives in orca_ext/benchmarks/serving.py; this script runs it from a source
checkout. See `python bench/serving.py --help`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install

from orca_ext.benchmarks.serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
