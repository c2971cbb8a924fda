"""The CPU microbenchmark executables (built by CMake under build/*/bench/cpu) validate their kernels
against the scalar double-precision references of bench/common/reference.h before timing anything. Run that validation here so a
kernel change that breaks a benchmark's reference check fails CI."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# One per kernel, the same names as bench/cpu/*.cpp (and bench/cuda/*.cu).
NAMES = ["bench_rms_norm", "bench_rmsnorm_qkv", "bench_skinny_gemm", "bench_slab_write", "bench_slab_move",
         "bench_ragged_attention", "bench_row_argmax", "bench_quant_gemm"]


def find_executable(name: str) -> Path | None:
    hits = sorted((ROOT / "build").glob(f"*/bench/cpu/{name}"), key=lambda p: p.stat().st_mtime, reverse=True)
    return hits[0] if hits else None


@pytest.mark.parametrize("name", NAMES)
def test_cpu_microbenchmark_validates(name):
    exe = find_executable(name)
    if exe is None:
        pytest.skip(f"{name} is not built (build with `make install`)")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([str(exe), "--validate-only"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{name} validation failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
