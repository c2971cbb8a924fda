"""The compute kernels run without the GIL, so that the HTTP server's event loop, a Python thread
of the same process, keeps answering while the engine's forward runs: another Python thread makes
progress in the middle of one long kernel call. (Holding the GIL, a kernel would let no other
Python thread run until it returned.)"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

_C = pytest.importorskip("orca_ext._C")

Q8_0, Q8_0_BLOCK_BYTES = 8, 34


def progress_during(call) -> int:
    """How many times a spinning Python thread noted the time within the middle half of `call()`."""
    marks: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            if n % 256 == 0:
                marks.append(time.perf_counter())

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        while not marks:  # the spinner is running before the kernel starts
            time.sleep(0.001)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
    finally:
        stop.set()
        spinner.join(60)
    quarter = (t1 - t0) / 4
    return sum(t0 + quarter < t < t1 - quarter for t in marks)


def _q8_0_weight(n: int, k: int, gen: np.random.Generator) -> torch.Tensor:
    raw = gen.integers(0, 256, size=(n, k // 32, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    raw[..., 0:2] = np.full((n, k // 32), 1e-3, np.float16).view(np.uint8).reshape(n, k // 32, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def _calls():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(509, 2048, generator=g)
    w = torch.randn(6000, 2048, generator=g)
    norm = torch.randn(2048, generator=g)
    t, hq, hkv, d = 2047, 8, 2, 64
    q = torch.randn(t, hq, d, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    idx = [torch.tensor([0]), torch.tensor([t]), torch.tensor([0]), torch.tensor([t])]
    qw = _q8_0_weight(6000, 2048, np.random.default_rng(5))
    return {
        "linear": lambda: _C.linear(x, w),
        "linear_silu_mul": lambda: _C.linear_silu_mul(x, w),
        "rmsnorm_qkv": lambda: _C.rmsnorm_qkv(x, norm, w, None, 1e-6),
        "ragged_attention": lambda: _C.ragged_attention(q, k, v, *idx, 0.125),
        "quant_linear": lambda: _C.quant_linear(x, qw, Q8_0, 2048),
    }


@pytest.mark.parametrize("kernel", ["linear", "linear_silu_mul", "rmsnorm_qkv", "ragged_attention", "quant_linear"])
def test_another_python_thread_runs_during_a_kernel(kernel):
    assert progress_during(_calls()[kernel]) > 0
