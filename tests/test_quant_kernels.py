"""The CPU kernels over quantized weights kept in their ggml block formats (`_C.quant_linear`,
`_C.quant_linear_silu_mul`, `_C.quant_rmsnorm_qkv`, `_C.quant_embedding`), against the gguf
package's dequantization (the independent reading of every format) and float64 references, at
awkward sizes, in float32 and bfloat16, on every quantized instruction path this CPU can run.
Also: a token's outputs are bit-identical whatever else shares the call, and bad arguments are
refused with a message naming them."""
from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from orca_ext import reference

_C = pytest.importorskip("orca_ext._C")
gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
QUANT_PATHS = _C.cpu_quant_paths()
# ggml type id -> (name, block elements, block bytes)
FORMATS = {8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
           7: ("Q5_1", 32, 24), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
K_FOR = {8: 32 * 7, 2: 32 * 19, 3: 32 * 9, 6: 32 * 11, 7: 32 * 5, 12: 256 * 3, 13: 256 * 3,
         14: 256 * 3}  # 32 * odd; 256 * 3


@pytest.fixture(params=QUANT_PATHS)
def quant_path(request):
    """Runs the test on one quantized instruction path, then restores the previous one."""
    before = _C.cpu_quant_path()
    _C.set_cpu_quant_path(request.param)
    yield request.param
    _C.set_cpu_quant_path(before)


def random_fp16(rng, shape, low, high):
    """Finite fp16 scales as bytes [..., 2]."""
    return rng.uniform(low, high, size=shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def make_qweight(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row_bytes] uint8 rows of valid blocks: gguf's own quantizer where it has one, else
    random bytes with finite positive fp16 scales (every bit pattern of the quants is valid)."""
    rng = np.random.default_rng(seed)
    name, block, nbytes = FORMATS[qtype]
    if qtype in (8, 2, 3, 6, 7):
        w = rng.standard_normal((n, k)).astype(np.float32) / math.sqrt(k)
        return np.ascontiguousarray(gguf_quants.quantize(w, GGMLQuantizationType(qtype)))
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    if qtype in (12, 13):  # d, dmin: the two fp16 at the front
        raw[..., 0:2] = random_fp16(rng, (n, k // block), 2e-4, 2e-3)
        raw[..., 2:4] = random_fp16(rng, (n, k // block), 2e-4, 2e-3)
    else:  # Q6_K: d is the last fp16
        raw[..., 208:210] = random_fp16(rng, (n, k // block), 1e-4, 1e-3)
    return raw.reshape(n, -1)


def dequantized(qweight: np.ndarray, qtype: int) -> torch.Tensor:
    """The gguf package's float32 reading of the blocks."""
    return torch.from_numpy(gguf_quants.dequantize(qweight, GGMLQuantizationType(qtype)).astype(np.float32))


def rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def assert_within_bound(got, ref, mass, dtype, k, what, extra=0.0):
    """|got - ref| <= half an ulp of the output + a rigorous bound on float32 accumulation over k
    terms (each lane adds at most k/8 products on either path, then at most a 4-level tree, then
    bias and residual) + extra."""
    out_rtol = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    bound = out_rtol * ref.abs() + (k // 8 + 7) * 2.0 ** -24 * mass + extra + 1e-30
    err = (got.double() - ref).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} out of bound; worst err "
                           f"{float((err - bound).max()):.3g} above bound at index {int((err - bound).argmax())}")


def test_quant_types():
    assert _C.quant_types() == sorted(FORMATS)
    assert "avx2" in QUANT_PATHS


@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_is_gguf_dequantization(qtype, dtype):
    """Every row, in gguf's float32 arithmetic bit for bit, then rounded once to dtype."""
    k = K_FOR[qtype]
    qw = make_qweight(qtype, 41, k, seed=qtype)
    ids = torch.tensor([40, 0, 7, 7, 13, 39], dtype=torch.int64)
    got = _C.quant_embedding(torch.from_numpy(qw), qtype, k, ids, dtype)
    assert got.shape == (6, k) and got.dtype == dtype
    assert torch.equal(got, dequantized(qw, qtype)[ids].to(dtype))


@pytest.mark.parametrize("qtype", sorted(FORMATS))
def test_every_fp16_scale_is_read_as_gguf_reads_it(qtype):
    """Scales of every fp16 class -- subnormal, negative, zero, the largest finite -- widen exactly."""
    rng = np.random.default_rng(qtype)
    k = FORMATS[qtype][1]
    specials = np.array([2.0 ** -24, -(2.0 ** -20), 3 * 2.0 ** -17, 0.0, -0.0, 65504.0, -1.5, 6.1e-5],
                        dtype=np.float16).view(np.uint8).reshape(-1, 2)
    qw = make_qweight(qtype, len(specials), k, seed=qtype)
    offsets = {12: (0, 2), 13: (0, 2), 14: (208,), 3: (0, 2), 7: (0, 2)}.get(qtype, (0,))
    for row, scale in enumerate(specials):
        for off in offsets:
            qw[row, off:off + 2] = scale
    got = _C.quant_embedding(torch.from_numpy(qw), qtype, k, torch.arange(len(specials)), torch.float32)
    assert torch.equal(got, dequantized(qw, qtype))


@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 3, 17, 70])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True), (True, False)])
def test_quant_linear(quant_path, qtype, dtype, n_tokens, bias, residual):
    k, n = K_FOR[qtype], 37
    gen = torch.Generator().manual_seed(hash((qtype, n_tokens, bias, residual)) % 2**31)
    qw = make_qweight(qtype, n, k, seed=n_tokens + 100 * qtype)
    x = rand(gen, n_tokens, k).to(dtype)
    b = rand(gen, n).to(dtype) if bias else None
    r = rand(gen, n_tokens, n).to(dtype) if residual else None
    out = _C.quant_linear(x, torch.from_numpy(qw), qtype, k, b, r)
    assert out.shape == (n_tokens, n) and out.dtype == dtype
    x64, w64 = x.double(), dequantized(qw, qtype).double()
    b64, r64 = (None if b is None else b.double()), (None if r is None else r.double())
    ref = reference.linear(x64, w64, b64, r64)
    mass = x64.abs() @ w64.abs().T + (0 if b64 is None else b64.abs()) + (0 if r64 is None else r64.abs())
    assert_within_bound(out, ref, mass, dtype, k, f"quant_linear {FORMATS[qtype][0]}")


@pytest.mark.parametrize("qtype", sorted(FORMATS))
def test_every_path_reads_the_weights_as_gguf(quant_path, qtype):
    """Unit activation rows pick single weights out of the product (every other term is +0), so
    quant_linear(I) is the path's own dequantization: gguf's, bit for bit."""
    k, n = K_FOR[qtype], 21
    qw = make_qweight(qtype, n, k, seed=5 * qtype)
    got = _C.quant_linear(torch.eye(k), torch.from_numpy(qw), qtype, k)
    assert torch.equal(got, dequantized(qw, qtype).T)


@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("n_tokens", [1, 3, 23])  # one token; one block of tokens; blocks reusing kept rows
def test_every_path_equals_linear_on_dequantized_weights(quant_path, qtype, n_tokens):
    """On each instruction path the quantized product is the float32 linear's arithmetic on the
    same path, bit for bit, however the weights reach the FMAs (widened in registers or through a
    buffer)."""
    if quant_path not in _C.cpu_f32_paths():
        pytest.skip(f"no float32 {quant_path} path on this CPU")
    k, n = K_FOR[qtype], 45
    qw = torch.from_numpy(make_qweight(qtype, n, k, seed=7 * qtype + n_tokens))
    w = _C.quant_embedding(qw, qtype, k, torch.arange(n), torch.float32)
    gen = torch.Generator().manual_seed(qtype * 100 + n_tokens)
    x, b = rand(gen, n_tokens, k).float(), rand(gen, n).float()
    f32_before = _C.cpu_f32_path()
    try:
        _C.set_cpu_f32_path(quant_path)  # the float32 linear's lanes of the same width
        got = _C.quant_linear(x, qw, qtype, k, b)
        expected = _C.linear(x, w, b, batch_invariant=True)
    finally:
        _C.set_cpu_f32_path(f32_before)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_silu_mul(quant_path, qtype, dtype, n_tokens, bias):
    k, n_inter = K_FOR[qtype], 19
    gen = torch.Generator().manual_seed(hash((qtype, n_tokens, bias, 1)) % 2**31)
    qw = make_qweight(qtype, 2 * n_inter, k, seed=3 + qtype)
    x = rand(gen, n_tokens, k, scale=4.0).to(dtype)
    b = rand(gen, 2 * n_inter).to(dtype) if bias else None
    out = _C.quant_linear_silu_mul(x, torch.from_numpy(qw), qtype, k, b)
    assert out.shape == (n_tokens, n_inter) and out.dtype == dtype
    x64, w64, b64 = x.double(), dequantized(qw, qtype).double(), None if b is None else b.double()
    expected = reference.linear_silu_mul(x64, w64, b64)
    # gate and up carry float32 accumulation errors dg, du, which silu(g) * u turns into at most
    # 1.1 |u| dg + |silu(g)| du; silu itself adds ~1e-7 relative; then the output is rounded.
    gate, up = reference.linear(x64, w64, b64).chunk(2, dim=-1)
    mass = (x64.abs() @ w64.abs().T + (0 if b64 is None else b64.abs())).chunk(2, dim=-1)
    acc = (k // 8 + 7) * 2.0 ** -24
    bound = (1.1 * up.abs() * acc * mass[0] + torch.nn.functional.silu(gate).abs() * acc * mass[1]
             + 1e-6 * expected.abs())
    out_rtol = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    err = (out.double() - expected).abs()
    assert (err <= out_rtol * expected.abs() + bound + 1e-30).all(), f"worst error {float(err.max()):.3g}"


@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 3, 70])
def test_quant_rmsnorm_qkv(quant_path, qtype, dtype, n_tokens):
    """The fused norm feeds the same kernels; in bfloat16 the normalised row is rounded to bf16 first."""
    k, n = K_FOR[qtype], 45
    gen = torch.Generator().manual_seed(n_tokens + qtype)
    qw = make_qweight(qtype, n, k, seed=11 * qtype + n_tokens)
    x = rand(gen, n_tokens, k, scale=2).to(dtype)
    nw = (1 + 0.1 * rand(gen, k)).to(dtype)
    b = rand(gen, n).to(dtype)
    out = _C.quant_rmsnorm_qkv(x, nw, torch.from_numpy(qw), qtype, k, b, 1e-6)
    assert out.shape == (n_tokens, n) and out.dtype == dtype
    w64 = dequantized(qw, qtype).double()
    normed = reference.rms_norm(x.double(), nw.double(), 1e-6)
    if dtype == torch.bfloat16:
        # The kernel rounds a float32 norm to bf16; where that differs from rounding the float64
        # norm, one element moves by one bf16 ulp (2^-8 of itself): allow two such elements.
        normed_bf16 = normed.to(dtype).double()
        slack = 2 * 2.0 ** -8 * (normed_bf16.abs() @ w64.abs().T).amax(dim=1, keepdim=True)
        normed = normed_bf16
    else:
        slack = 1e-6 * (normed.abs() @ w64.abs().T)  # the float32 norm itself
    ref = reference.linear(normed, w64, b.double())
    mass = normed.abs() @ w64.abs().T + b.double().abs()
    assert_within_bound(out, ref, mass, dtype, k, f"quant_rmsnorm_qkv {FORMATS[qtype][0]}", extra=slack)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance(quant_path, restore_threads, qtype, dtype):
    """A token's outputs alone equal, bit for bit, its outputs inside ragged crowds of other tokens
    of awkward sizes, with one thread and with all of them."""
    rng = random.Random(qtype)
    k, n = K_FOR[qtype], 2 * 29
    qw = torch.from_numpy(make_qweight(qtype, n, k, seed=99 + qtype))
    gen = torch.Generator().manual_seed(200 + qtype)
    b = rand(gen, n).to(dtype)
    nw = (1 + 0.1 * rand(gen, k)).to(dtype)
    me = rand(gen, 1, k).to(dtype)

    def run(x, residual):
        return (_C.quant_linear(x, qw, qtype, k, b, residual), _C.quant_linear_silu_mul(x, qw, qtype, k, b),
                _C.quant_rmsnorm_qkv(x, nw, qw, qtype, k, b, 1e-6))

    torch.set_num_threads(1)
    alone = run(me, torch.zeros(1, n, dtype=dtype))
    for threads in sorted({1, 2, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        for size in (2, 3, 7, 13, 17, rng.randint(18, 69), 70):
            crowd = (rand(gen, size, k) * rng.choice([0.1, 1.0, 30.0])).to(dtype)
            at = rng.randrange(size)
            crowd[at] = me[0]
            got = run(crowd, torch.zeros(size, n, dtype=dtype))
            for g, a, name in zip(got, alone, ("quant_linear", "quant_linear_silu_mul", "quant_rmsnorm_qkv")):
                assert torch.equal(g[at], a[0]), (f"{name}: row {at} of a {size}-token batch ({threads} threads) "
                                                  "differs from the row alone")


def test_zero_tokens():
    qw = torch.from_numpy(make_qweight(8, 6, 64, seed=1))
    assert _C.quant_linear(torch.empty(0, 64), qw, 8, 64).shape == (0, 6)
    assert _C.quant_linear_silu_mul(torch.empty(0, 64), qw, 8, 64).shape == (0, 3)
    assert _C.quant_embedding(qw, 8, 64, torch.empty(0, dtype=torch.int64), torch.float32).shape == (0, 64)


def test_non_contiguous_inputs():
    qtype, k = 2, 96
    qw = torch.from_numpy(make_qweight(qtype, 10, k, seed=5))
    x = torch.randn(k, 4).T  # [4, k], transposed view
    wide = torch.zeros(10, 2 * qw.shape[1], dtype=torch.uint8)
    wide[:, ::2] = qw
    assert torch.equal(_C.quant_linear(x, wide[:, ::2], qtype, k), _C.quant_linear(x.contiguous(), qw, qtype, k))


_QW = torch.from_numpy(make_qweight(2, 6, 64, seed=3))  # Q4_0, K = 64: rows of 36 bytes
_X = torch.randn(3, 64)


@pytest.mark.parametrize("call,match", [
    (lambda: _C.quant_linear(_X, _QW, 10, 64), r"qtype 10 is not a supported ggml type; supported: 2 \(Q4_0\)"),
    (lambda: _C.quant_linear(_X, _QW, -1, 64), "qtype -1 is not a supported"),
    (lambda: _C.quant_linear(_X, _QW, 2, 48), "k must be a positive multiple of 32"),
    (lambda: _C.quant_linear(_X, _QW, 2, 0), "k must be a positive multiple of 32"),
    (lambda: _C.quant_linear(torch.randn(3, 256), torch.zeros(6, 144, dtype=torch.uint8), 12, 200),
     "multiple of 256"),
    (lambda: _C.quant_linear(_X, _QW, 8, 64), "qweight rows are 36 bytes but k = 64 in Q8_0 needs 68"),
    (lambda: _C.quant_linear(_X, _QW.view(torch.int8), 2, 64), "must be uint8"),
    (lambda: _C.quant_linear(_X, _QW[0], 2, 64), "qweight must be 2-D"),
    (lambda: _C.quant_linear(torch.randn(3, 32), _QW, 2, 64), "x has 32 columns but k is 64"),
    (lambda: _C.quant_linear(_X.double(), _QW, 2, 64), "only float32 and bfloat16"),
    (lambda: _C.quant_linear(_X, _QW, 2, 64, torch.randn(5)), "bias has 5 elements but qweight has 6 rows"),
    (lambda: _C.quant_linear(_X, _QW, 2, 64, torch.randn(6).bfloat16()), "bias has dtype"),
    (lambda: _C.quant_linear(_X, _QW, 2, 64, None, torch.randn(3, 5)), "residual has shape"),
    (lambda: _C.quant_linear_silu_mul(_X, _QW[:5], 2, 64), "qweight has 5 rows"),
    (lambda: _C.quant_linear_silu_mul(_X, _QW, 2, 64, torch.randn(3)), "bias has 3 elements"),
    (lambda: _C.quant_rmsnorm_qkv(_X, torch.ones(63), _QW, 2, 64, None, 1e-6), "norm_weight has 63"),
    (lambda: _C.quant_rmsnorm_qkv(_X, torch.ones(64), _QW, 2, 64, None, -1.0), "eps"),
    (lambda: _C.quant_embedding(_QW, 2, 64, torch.tensor([0, 6]), torch.float32),
     r"token_ids\[1\] = 6 is outside the 6 rows"),
    (lambda: _C.quant_embedding(_QW, 2, 64, torch.tensor([-1]), torch.float32), "token_ids"),
    (lambda: _C.quant_embedding(_QW, 2, 64, torch.tensor([0.0]), torch.float32), "token_ids"),
    (lambda: _C.quant_embedding(_QW, 2, 64, torch.tensor([0]), torch.float16), "dtype"),
    (lambda: _C.set_cpu_quant_path("sse2"), "unknown quantized path"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_quant_path_from_environment():
    """ORCA_CPU_QUANT_PATH=avx2 forces the portable path (read once, at first use)."""
    code = "import orca_ext._C as C; print(C.cpu_quant_path())"
    env = dict(os.environ, ORCA_CPU_QUANT_PATH="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["avx2"]
