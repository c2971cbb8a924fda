"""The CPU weight-streaming projections (`_C.linear`, `_C.linear_silu_mul`, and `_C.rmsnorm_qkv`
on the same kernels) against float64 references, on awkward sizes, in float32 and bfloat16, on
every float32 and bf16 instruction path this CPU can run -- always including the scalar emulation
of the AVX512-BF16 path, so that its blocking and tails are tested on CPUs without the instructions.
Also: a token's outputs are bit-identical whatever else shares the call (batch invariance), and
the ATen path above the crossover is correct too."""
from __future__ import annotations

import contextlib
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from orca_ext import ops, reference

_C = pytest.importorskip("orca_ext._C")

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
BF16_PATHS = _C.cpu_bf16_paths()
F32_PATHS = _C.cpu_f32_paths()


@pytest.fixture(params=BF16_PATHS)
def bf16_path(request):
    """Runs the test on one bf16 instruction path, then restores the previous one."""
    before = _C.cpu_bf16_path()
    _C.set_cpu_bf16_path(request.param)
    yield request.param
    _C.set_cpu_bf16_path(before)


@pytest.fixture
def streaming_everywhere():
    """Keeps every T on our kernels (the crossover to ATen out of reach) for the test."""
    before = {name: _C.cpu_stream_max_tokens(name) for name in DTYPE_NAMES.values()}
    for name in before:
        _C.set_cpu_stream_max_tokens(name, 1 << 30)
    yield
    for name, value in before.items():
        _C.set_cpu_stream_max_tokens(name, value)


def cases(dtype):
    """(dtype, path) pairs: each dtype runs on each of its instruction paths."""
    return [(dtype, p) for p in (F32_PATHS if dtype == torch.float32 else BF16_PATHS)]


ALL_CASES = cases(torch.float32) + cases(torch.bfloat16)


@contextlib.contextmanager
def path_forced(dtype, path):
    """Runs the body on one instruction path of dtype's kernels, then restores the previous one."""
    get, put = ((_C.cpu_f32_path, _C.set_cpu_f32_path) if dtype == torch.float32
                else (_C.cpu_bf16_path, _C.set_cpu_bf16_path))
    before = get()
    put(path)
    try:
        yield
    finally:
        put(before)


@pytest.fixture(params=ALL_CASES, ids=lambda c: f"{DTYPE_NAMES[c[0]]}-{c[1]}")
def dtype_path(request):
    dtype, path = request.param
    with path_forced(dtype, path):
        yield dtype


def rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def accumulation_terms(k, dtype=None):
    """Roundings on the longest path of a k-term float32 dot product: on the lane paths (see
    below) at most k/8 per lane and a few in the lane tree. amx_bf16 runs each sum as one chain
    through k, in tile steps whose internal rounding Intel leaves unspecified: allow one ulp
    (two half-ulp roundings) per product there."""
    if dtype == torch.bfloat16 and _C.cpu_bf16_path() == "amx_bf16":
        return 2 * k + 7
    return k // 8 + 7


def assert_within_bound(got, ref, mass, dtype, k, what, extra=0.0):
    """|got - ref| <= half an ulp of the output + a rigorous bound on float32 accumulation over k
    terms (each lane adds at most ceil(k/8) products on the 8-lane paths, ceil(k/16) on the 16-lane
    ones, then a 3- or 4-level tree, then bias and residual) + extra."""
    out_rtol = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    bound = out_rtol * ref.abs() + accumulation_terms(k, dtype) * 2.0 ** -24 * mass + extra + 1e-30
    err = (got.double() - ref).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} out of bound; worst err "
                           f"{float((err - bound).max()):.3g} above bound at index {int((err - bound).argmax())}")


@pytest.mark.parametrize("n_tokens", [1, 2, 3, 5, 13, 40, 97])
@pytest.mark.parametrize("k,n", [(1, 9), (7, 260), (33, 67), (581, 131)])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True), (True, True)])
def test_linear(dtype_path, streaming_everywhere, n_tokens, k, n, bias, residual):
    dtype = dtype_path
    gen = torch.Generator().manual_seed(hash((n_tokens, k, n, bias, residual)) % 2**31)
    x = rand(gen, n_tokens, k).to(dtype)
    w = rand(gen, n, k, scale=1 / math.sqrt(k)).to(dtype)
    b = rand(gen, n).to(dtype) if bias else None
    r = rand(gen, n_tokens, n).to(dtype) if residual else None
    out = _C.linear(x, w, b, r)
    assert out.shape == (n_tokens, n) and out.dtype == dtype
    x64, w64 = x.double(), w.double()
    ref = reference.linear(x64, w64, None if b is None else b.double(), None if r is None else r.double())
    mass = x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs()) + (0 if r is None else r.double().abs())
    assert_within_bound(out, ref, mass, dtype, k, "linear")


@pytest.mark.parametrize("n_tokens", [1, 4, 29])
@pytest.mark.parametrize("k,n_inter", [(5, 1), (263, 7), (96, 133)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_silu_mul(dtype_path, streaming_everywhere, n_tokens, k, n_inter, bias):
    dtype = dtype_path
    gen = torch.Generator().manual_seed(hash((n_tokens, k, n_inter, bias)) % 2**31)
    x = rand(gen, n_tokens, k).to(dtype)
    w = rand(gen, 2 * n_inter, k, scale=2 / math.sqrt(k)).to(dtype)
    b = rand(gen, 2 * n_inter).to(dtype) if bias else None
    out = _C.linear_silu_mul(x, w, b)
    assert out.shape == (n_tokens, n_inter) and out.dtype == dtype
    x64, w64, b64 = x.double(), w.double(), None if b is None else b.double()
    expected = reference.linear_silu_mul(x64, w64, b64)
    # gate and up carry float32 accumulation errors dg, du, which silu(g) * u turns into at most
    # 1.1 |u| dg + |silu(g)| du; silu itself adds ~1e-7 relative; then the output is rounded.
    gate, up = reference.linear(x64, w64, b64).chunk(2, dim=-1)
    mass = (x64.abs() @ w64.abs().T + (0 if b64 is None else b64.abs())).chunk(2, dim=-1)
    acc = accumulation_terms(k, dtype) * 2.0 ** -24
    bound = (1.1 * up.abs() * acc * mass[0] + torch.nn.functional.silu(gate).abs() * acc * mass[1]
             + 1e-6 * expected.abs())
    out_rtol = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    err = (out.double() - expected).abs()
    assert (err <= out_rtol * expected.abs() + bound + 1e-30).all(), f"worst error {float(err.max()):.3g}"


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n_tokens", [1, 6, 41])
@pytest.mark.parametrize("k,n", [(45, 3), (130, 61), (576, 203)])
def test_thread_count_never_changes_bits(dtype_path, streaming_everywhere, restore_threads, n_tokens, k, n):
    """Each thread cuts its range of outputs into 8 streams, and a panel gathers output i of every
    stream; short and empty streams pad the panel. However many threads split the outputs (more
    threads than panels included), every output is the same float32 reduction: the bits match the
    1-thread result, which is within the float64 reference's bound."""
    dtype = dtype_path
    gen = torch.Generator().manual_seed(hash((n_tokens, k, n)) % 2**31)
    x = rand(gen, n_tokens, k).to(dtype)
    w = rand(gen, 2 * n, k, scale=1 / math.sqrt(k)).to(dtype)
    b = rand(gen, 2 * n).to(dtype)
    r = rand(gen, n_tokens, 2 * n).to(dtype)

    def run():
        return _C.linear(x, w, b, r), _C.linear_silu_mul(x, w, b)

    torch.set_num_threads(1)
    one = run()
    x64, w64, b64 = x.double(), w.double(), b.double()
    mass = x64.abs() @ w64.abs().T + b64.abs() + r.double().abs()
    assert_within_bound(one[0], reference.linear(x64, w64, b64, r.double()), mass, dtype, k, "linear, 1 thread")
    for threads in (2, 3, 5, 8):
        torch.set_num_threads(threads)
        for got, base, name in zip(run(), one, ("linear", "linear_silu_mul")):
            assert torch.equal(got, base), f"{name}: {threads} threads differ from 1 thread"


@pytest.mark.parametrize("n_tokens", [1, 3, 17, 50])
def test_rmsnorm_qkv_streaming(dtype_path, streaming_everywhere, n_tokens):
    """The fused norm feeds the same kernels; in bfloat16 the normalised row is rounded to bf16 first."""
    dtype = dtype_path
    gen = torch.Generator().manual_seed(n_tokens)
    hidden, n_out = 197, 75
    x = rand(gen, n_tokens, hidden, scale=2).to(dtype)
    nw = (1 + 0.1 * rand(gen, hidden)).to(dtype)
    w = rand(gen, n_out, hidden, scale=1 / math.sqrt(hidden)).to(dtype)
    b = rand(gen, n_out).to(dtype)
    out = _C.rmsnorm_qkv(x, nw, w, b, 1e-6)
    normed = reference.rms_norm(x.double(), nw.double(), 1e-6)
    if dtype == torch.bfloat16:
        # The kernel rounds a float32 norm to bf16; where that differs from rounding the float64
        # norm, one element moves by one bf16 ulp (2^-8 of itself): allow two such elements.
        normed_bf16 = normed.to(dtype).double()
        slack = 2 * 2.0 ** -8 * (normed_bf16.abs() @ w.double().abs().T).amax(dim=1, keepdim=True)
        normed = normed_bf16
    else:
        slack = 1e-6 * (normed.abs() @ w.double().abs().T)  # the float32 norm itself
    ref = reference.linear(normed, w.double(), b.double())
    mass = normed.abs() @ w.double().abs().T + b.double().abs()
    assert_within_bound(out, ref, mass, dtype, hidden, "rmsnorm_qkv", extra=slack)


@pytest.mark.parametrize("dtype", DTYPES)
def test_aten_path_above_crossover(dtype):
    """With the crossover at 0 every call takes the ATen path; it computes the same functions."""
    name = DTYPE_NAMES[dtype]
    before = _C.cpu_stream_max_tokens(name)
    gen = torch.Generator().manual_seed(7)
    x = rand(gen, 6, 40).to(dtype)
    w = rand(gen, 22, 40, scale=0.2).to(dtype)
    b, r = rand(gen, 22).to(dtype), rand(gen, 6, 22).to(dtype)
    nw = (1 + 0.1 * rand(gen, 40)).to(dtype)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    try:
        _C.set_cpu_stream_max_tokens(name, 0)
        got = (_C.linear(x, w, b, r), _C.linear_silu_mul(x, w, b), _C.rmsnorm_qkv(x, nw, w, b, 1e-6))
    finally:
        _C.set_cpu_stream_max_tokens(name, before)
    x64, w64, b64 = x.double(), w.double(), b.double()
    expected = (reference.linear(x64, w64, b64, r.double()), reference.linear_silu_mul(x64, w64, b64),
                reference.rmsnorm_qkv(x64, nw.double(), w64, b64, 1e-6))
    for g, e in zip(got, expected):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), e, **tol)


def crowd_rows(gen_seed, n_tokens, k):
    return torch.randn(n_tokens, k, generator=torch.Generator().manual_seed(gen_seed), dtype=torch.float64)


@pytest.mark.parametrize("trial", range(3))
def test_batch_invariance(dtype_path, trial):
    """A token's outputs alone equal, bit for bit, its outputs inside random crowds of other tokens,
    for every batch size up to the crossover."""
    dtype = dtype_path
    limit = _C.cpu_stream_max_tokens(DTYPE_NAMES[dtype])
    rng = random.Random(trial)
    k, n = rng.choice([(576, 131), (97, 64)])
    gen = torch.Generator().manual_seed(100 + trial)
    w = rand(gen, 2 * n, k, scale=1 / math.sqrt(k)).to(dtype)
    b = rand(gen, 2 * n).to(dtype)
    nw = (1 + 0.1 * rand(gen, k)).to(dtype)
    me = rand(gen, 1, k).to(dtype)
    alone = (_C.linear(me, w, b, None), _C.linear_silu_mul(me, w, b), _C.rmsnorm_qkv(me, nw, w, b, 1e-6))
    for size in sorted({2, 3, 4, 7, 13, rng.randint(14, 64), min(limit, 200)}):
        if size > limit:
            continue
        crowd = (crowd_rows(rng.randrange(1 << 30), size, k) * rng.choice([0.1, 1.0, 30.0])).to(dtype)
        at = rng.randrange(size)
        crowd[at] = me[0]
        res = torch.zeros(size, 2 * n, dtype=dtype)
        got = (_C.linear(crowd, w, b, res)[at], _C.linear_silu_mul(crowd, w, b)[at],
               _C.rmsnorm_qkv(crowd, nw, w, b, 1e-6)[at])
        for g, a, name in zip(got, alone, ("linear", "linear_silu_mul", "rmsnorm_qkv")):
            assert torch.equal(g, a[0]), f"{name}: token at row {at} of a {size}-token batch differs from alone"


@pytest.mark.parametrize("path", F32_PATHS)
@pytest.mark.parametrize("k,n", [(581, 67), (1043, 40), (2053, 100)])
def test_float32_prefill_sizes(streaming_everywhere, path, k, n):
    """Every float32 path at prompt-sized T (the token blocks, their remainders, the token tiles
    of the driver and, at K = 2053, several blocks of panels per thread, each run over all tiles):
    within the float64 bound, and each request of a ragged batch bit-identical to the same rows run
    alone."""
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w = rand(gen, 2 * n, k, scale=1 / math.sqrt(k)).float()
    b = rand(gen, 2 * n).float()
    nw = (1 + 0.1 * rand(gen, k)).float()
    lengths = [1, 3, 31, 32, 33, 77, 513]
    x = rand(gen, sum(lengths), k).float()
    with path_forced(torch.float32, path):
        whole = (_C.linear(x, w, b, None), _C.linear_silu_mul(x, w, b), _C.rmsnorm_qkv(x, nw, w, b, 1e-6))
        start = 0
        for length in lengths:
            rows = x[start:start + length]
            alone = (_C.linear(rows, w, b, None), _C.linear_silu_mul(rows, w, b), _C.rmsnorm_qkv(rows, nw, w, b, 1e-6))
            for got, part, name in zip(whole, alone, ("linear", "linear_silu_mul", "rmsnorm_qkv")):
                assert torch.equal(got[start:start + length], part), f"{name}: request of {length} rows differs"
            start += length
    x64, w64, b64 = x.double(), w.double(), b.double()
    mass = x64.abs() @ w64.abs().T + b64.abs()
    assert_within_bound(whole[0], reference.linear(x64, w64, b64), mass, torch.float32, k, f"linear/{path}")
    gate, up = reference.linear(x64, w64, b64).chunk(2, dim=-1)
    g_mass, u_mass = mass.chunk(2, dim=-1)
    acc = accumulation_terms(k) * 2.0 ** -24
    expected = torch.nn.functional.silu(gate) * up
    bound = (1.1 * up.abs() * acc * g_mass + torch.nn.functional.silu(gate).abs() * acc * u_mass
             + 1e-6 * expected.abs() + 2.0 ** -24 * expected.abs() + 1e-30)
    assert ((whole[1].double() - expected).abs() <= bound).all(), f"linear_silu_mul/{path} out of bound"


AMX = pytest.mark.skipif("amx_bf16" not in BF16_PATHS, reason="this CPU (or OS) has no AMX-BF16")


@AMX
@pytest.mark.parametrize("k,n", [(32, 16), (576, 17), (576, 67), (2080, 131)])
def test_amx_prefill_sizes(streaming_everywhere, k, n):
    """The AMX tile path at every token count a prompt brings (one and two token groups, partial
    groups, several token tiles at K = 2080) and at output counts that end mid-tile (down to a
    single tile of 16, and gate_up halves of 17): within the float64 bound, and each request of a
    ragged batch bit-identical to its rows run alone."""
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w = rand(gen, 2 * n, k, scale=1 / math.sqrt(k)).bfloat16()
    b = rand(gen, 2 * n).bfloat16()
    nw = (1 + 0.1 * rand(gen, k)).bfloat16()
    lengths = [1, 3, 15, 16, 17, 33, 77, 300]
    x = rand(gen, sum(lengths), k).bfloat16()
    r = rand(gen, sum(lengths), 2 * n).bfloat16()
    with path_forced(torch.bfloat16, "amx_bf16"):
        whole = (_C.linear(x, w, b, r), _C.linear_silu_mul(x, w, b), _C.rmsnorm_qkv(x, nw, w, b, 1e-6))
        start = 0
        for length in lengths:
            rows, res = x[start:start + length], r[start:start + length]
            alone = (_C.linear(rows, w, b, res), _C.linear_silu_mul(rows, w, b), _C.rmsnorm_qkv(rows, nw, w, b, 1e-6))
            for got, part, name in zip(whole, alone, ("linear", "linear_silu_mul", "rmsnorm_qkv")):
                assert torch.equal(got[start:start + length], part), f"{name}: request of {length} rows differs"
            start += length
        x64, w64, b64, r64 = x.double(), w.double(), b.double(), r.double()
        mass = x64.abs() @ w64.abs().T + b64.abs() + r64.abs()
        assert_within_bound(whole[0], reference.linear(x64, w64, b64, r64), mass, torch.bfloat16, k, "linear/amx")
        gate, up = reference.linear(x64, w64, b64).chunk(2, dim=-1)
        g_mass, u_mass = (mass - r64.abs()).chunk(2, dim=-1)
        acc = accumulation_terms(k, torch.bfloat16) * 2.0 ** -24
    expected = torch.nn.functional.silu(gate) * up
    bound = (1.1 * up.abs() * acc * g_mass + torch.nn.functional.silu(gate).abs() * acc * u_mass
             + 1e-6 * expected.abs() + 2.0 ** -8 * expected.abs() + 1e-30)
    assert ((whole[1].double() - expected).abs() <= bound).all(), "linear_silu_mul/amx out of bound"


@AMX
def test_amx_path_is_its_own_kernel_and_falls_back_by_shape():
    """Where the tiles fit (K a multiple of 32, at least 16 outputs) amx_bf16 runs its own kernel,
    whose rounding differs from vdpbf16ps in some last bits; a matrix that does not fit runs the
    vdpbf16ps kernel at every T, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    outs = {}
    # Many outputs: a float32 difference shows only where it crosses a bf16 rounding.
    for k, n in ((1024, 1000), (1000, 1000), (1024, 15)):
        x, w = rand(gen, 60, k).bfloat16(), rand(gen, n, k, scale=1 / math.sqrt(k)).bfloat16()
        for path in ("amx_bf16", "avx512_bf16"):
            with path_forced(torch.bfloat16, path):
                outs[k, n, path] = _C.linear(x, w)
    assert not torch.equal(outs[1024, 1000, "amx_bf16"], outs[1024, 1000, "avx512_bf16"])
    assert torch.equal(outs[1000, 1000, "amx_bf16"], outs[1000, 1000, "avx512_bf16"])
    assert torch.equal(outs[1024, 15, "amx_bf16"], outs[1024, 15, "avx512_bf16"])


def test_float32_paths_round_differently_but_both_hold():
    """The paths are distinct kernels (the test above would not notice if both ran one path): on
    enough random sums, 8-lane and 16-lane accumulation differ in some last bits."""
    if len(F32_PATHS) < 2:
        pytest.skip("this CPU has one float32 path")
    gen = torch.Generator().manual_seed(5)
    x, w = rand(gen, 40, 777).float(), rand(gen, 64, 777).float()
    outs = []
    for path in F32_PATHS:
        with path_forced(torch.float32, path):
            outs.append(_C.linear(x, w))
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("n_tokens", [1, 2, 3, 31, 77])
# Many outputs: a float32 difference shows only where it crosses a bf16 rounding.
@pytest.mark.parametrize("k,n", [(581, 1031), (2085, 300)])
def test_native_bf16_path_equals_its_emulation(streaming_everywhere, n_tokens, k, n):
    """The native vdpbf16ps kernel (16-lane blocks of 3 tokens x 8 rows, or 6 tokens x 4 rows once a
    panel outgrows L1; lanes summed by shuffles) performs exactly the arithmetic its scalar
    emulation spells out (4 x 4 blocks, one lane at a time): the bits agree at every T and at K
    with a tail."""
    if "avx512_bf16" not in BF16_PATHS:
        pytest.skip("this CPU has no AVX512-BF16")
    gen = torch.Generator().manual_seed(n_tokens)
    x = rand(gen, n_tokens, k).bfloat16()
    w = rand(gen, 2 * n, k, scale=1 / math.sqrt(k)).bfloat16()
    b = rand(gen, 2 * n).bfloat16()
    outs = []
    for path in ("avx512_bf16", "avx512_bf16_emulated"):
        with path_forced(torch.bfloat16, path):
            outs.append((_C.linear(x, w, b, None), _C.linear_silu_mul(x, w, b)))
    for native, emulated, name in zip(outs[0], outs[1], ("linear", "linear_silu_mul")):
        assert torch.equal(native, emulated), f"{name}: native bf16 path differs from its emulation"


def test_float32_path_from_environment():
    """ORCA_CPU_F32_PATH=avx2 forces the portable path (read once, at first use); unset or auto
    picks the widest one the CPU has."""
    code = "import orca_ext._C as C; print(C.cpu_f32_path(), ' '.join(C.cpu_f32_paths()))"
    results = {}
    for value in ("avx2", "auto", None):
        env = {k: v for k, v in os.environ.items() if k != "ORCA_CPU_F32_PATH"}
        if value is not None:
            env["ORCA_CPU_F32_PATH"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        results[value] = out.stdout.split()
    assert results["avx2"][0] == "avx2"
    supported = results[None][1:]
    assert "avx2" in supported
    best = "avx512" if "avx512" in supported else "avx2"
    assert results[None][0] == best and results["auto"][0] == best


def test_ops_dispatch_and_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(3)
    x = rand(gen, 40, 5).float().t()                 # [5, 40] non-contiguous
    w = rand(gen, 40, 18).float().t()                # [18, 40] non-contiguous
    r = rand(gen, 18, 5).float().t()                 # [5, 18] non-contiguous
    expected = reference.linear(x.double(), w.double(), None, r.double())
    torch.testing.assert_close(ops.linear(x, w, None, residual=r).double(), expected, atol=1e-5, rtol=1e-5)
    gate_up = w[:18]
    torch.testing.assert_close(ops.linear_silu_mul(x, gate_up).double(),
                               reference.linear_silu_mul(x.double(), gate_up.double()), atol=1e-5, rtol=1e-5)


def test_zero_sizes():
    assert _C.linear(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)
    assert _C.linear_silu_mul(torch.randn(3, 8), torch.randn(0, 8)).shape == (3, 0)
    b = torch.randn(4)
    torch.testing.assert_close(_C.linear(torch.randn(2, 0), torch.randn(4, 0), b), b.expand(2, 4))


@pytest.mark.parametrize("call,match", [
    (lambda: _C.linear(torch.randn(3, 8), torch.randn(5, 7)), "weight has 7 columns but x has 8"),
    (lambda: _C.linear(torch.randn(8), torch.randn(5, 8)), "x must be 2-D"),
    (lambda: _C.linear(torch.randn(3, 8), torch.randn(5, 8), torch.randn(4)), "bias has 4 elements"),
    (lambda: _C.linear(torch.randn(3, 8), torch.randn(5, 8), None, torch.randn(3, 4)), "residual has shape"),
    (lambda: _C.linear(torch.randn(3, 8), torch.randn(5, 8).bfloat16()), "weight has dtype"),
    (lambda: _C.linear(torch.randn(3, 8).double(), torch.randn(5, 8).double()), "only float32 and bfloat16"),
    (lambda: _C.linear_silu_mul(torch.randn(3, 8), torch.randn(5, 8)), "gate_up_weight has 5 rows"),
    (lambda: _C.linear_silu_mul(torch.randn(3, 8), torch.randn(6, 8), torch.randn(3)), "gate_up_bias has 3"),
    (lambda: _C.set_cpu_stream_max_tokens("float32", -1), "max_tokens must be >= 0"),
    (lambda: _C.set_cpu_stream_max_tokens("float16", 4), "dtype must be"),
    (lambda: _C.set_cpu_bf16_path("sse2"), "unknown bf16 path"),
    (lambda: _C.set_cpu_f32_path("sse2"), "unknown float32 path"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("path", ["avx512_bf16", "amx_bf16"])
def test_unsupported_bf16_path_is_refused(path):
    if path in BF16_PATHS:
        pytest.skip(f"this CPU runs {path}")
    before = _C.cpu_bf16_path()
    with pytest.raises(ValueError, match=f"cannot run the bf16 path {path}"):
        _C.set_cpu_bf16_path(path)
    assert _C.cpu_bf16_path() == before


def test_amx_path_only_where_the_cpu_reports_amx():
    """amx_bf16 is offered only where the kernel's /proc/cpuinfo lists AMX-TILE and AMX-BF16 (an
    independent witness of CPUID); where it does, the OS may still refuse the tile state."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    if "amx_bf16" in flags and "amx_tile" in flags:
        pytest.skip("this CPU reports AMX")
    assert "amx_bf16" not in BF16_PATHS


def test_bf16_path_from_environment():
    """ORCA_CPU_BF16_PATH=avx2 forces the portable path, and any other supported path can be named
    (read once, at first use); unset, the widest path the CPU has is taken."""
    code = "import orca_ext._C as C; print(C.cpu_bf16_path(), ' '.join(C.cpu_bf16_paths()))"
    env = dict(os.environ, ORCA_CPU_BF16_PATH="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    active, supported = out.stdout.split(maxsplit=1)
    assert active == "avx2"
    assert {"avx2", "avx512_bf16_emulated"} <= set(supported.split())
    default = subprocess.run([sys.executable, "-c", code], env={k: v for k, v in os.environ.items()
                                                                 if k != "ORCA_CPU_BF16_PATH"},
                             capture_output=True, text=True, timeout=120)
    supported = supported.split()
    widest = [p for p in ("amx_bf16", "avx512_bf16") if p in supported]
    assert default.stdout.split()[0] == (widest[0] if widest else "avx2")
    if "amx_bf16" in supported:  # a narrower native path can be forced too
        forced = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, ORCA_CPU_BF16_PATH="avx512_bf16"),
                                capture_output=True, text=True, timeout=120)
        assert forced.stdout.split()[0] == "avx512_bf16"


def test_stream_read_probe():
    words = torch.randint(-2**62, 2**62, (1 << 17,), dtype=torch.int64, generator=torch.Generator().manual_seed(1))
    expected = 0
    for v in words.tolist():
        expected ^= v & (2**64 - 1)
    assert _C.stream_read(words) == expected
