"""The CPU kernels of orca_ext._C against float64 torch references, on fresh random ragged batches
with awkward sizes. Ragged batches are checked request by request against that request alone."""
from __future__ import annotations

import math
import random

import pytest
import torch

from orca_ext import reference

from kernel_cases import make_ragged_case, random_kinds, scattered_slabs

_C = pytest.importorskip("orca_ext._C")

DTYPES = [torch.float32, torch.bfloat16]
# (atol, rtol) of a kernel's output against the float64 reference.
TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 2e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 7, 83])
@pytest.mark.parametrize("hidden", [111, 576])
def test_rms_norm(dtype, n_tokens, hidden):
    gen = torch.Generator().manual_seed(n_tokens * 1000 + hidden)
    x = (torch.randn(n_tokens, hidden, generator=gen) * 3).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    out = _C.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, reference.rms_norm(x.double(), w.double(), 1e-5), dtype, "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 7, 16, 17, 83])  # both sides of the fused/GEMM switches
@pytest.mark.parametrize("hidden,heads", [(111, (3, 1, 16)), (576, (9, 3, 64))])
@pytest.mark.parametrize("bias", [False, True])
def test_rmsnorm_qkv(dtype, n_tokens, hidden, heads, bias):
    n_q, n_kv, d = heads
    n_out = (n_q + 2 * n_kv) * d
    gen = torch.Generator().manual_seed(hash((n_tokens, hidden, bias)) % 2**31)
    x = (torch.randn(n_tokens, hidden, generator=gen) * 2).to(dtype)
    nw = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    w = (torch.randn(n_out, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)
    b = torch.randn(n_out, generator=gen).to(dtype) if bias else None
    out = _C.rmsnorm_qkv(x, nw, w, b, 1e-6)
    assert out.shape == (n_tokens, n_out) and out.dtype == dtype
    expected = reference.rmsnorm_qkv(x.double(), nw.double(), w.double(), None if b is None else b.double(), 1e-6)
    assert_close(out, expected, dtype, "rmsnorm_qkv")


def test_rmsnorm_qkv_non_contiguous_input():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 7, generator=gen).t()  # [7, 64], non-contiguous
    nw, w = torch.randn(64, generator=gen), torch.randn(40, 64, generator=gen)
    assert_close(_C.rmsnorm_qkv(x, nw, w, None, 1e-6), reference.rmsnorm_qkv(x.double(), nw.double(), w.double(),
                                                                            None, 1e-6), torch.float32, "rmsnorm_qkv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n_tokens", [1, 7, 83])
def test_slab_write_scattered(dtype, index_dtype, n_tokens):
    rng = random.Random(n_tokens)
    gen = torch.Generator().manual_seed(n_tokens)
    n_kv, d = 3, 80
    # Tokens of a few requests, each request's tokens going to consecutive slots of its own slab.
    lengths = [len(c) for c in torch.arange(n_tokens).tensor_split(min(n_tokens, 4))]
    starts, n_slots = scattered_slabs(rng, [n + 5 for n in lengths])  # room for a start offset
    positions = [rng.randint(0, 5) for _ in lengths]
    slots = torch.tensor([s + p + i for s, p, n in zip(starts, positions, lengths) for i in range(n)], dtype=index_dtype)
    k_cache = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype)
    k = torch.randn(n_tokens, n_kv, d, generator=gen).to(dtype)
    v = torch.randn(n_tokens, n_kv, d, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.slab_write(k_ref, v_ref, k, v, slots)
    _C.slab_write(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy is exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (7, 1), (14, 2)])  # GQA ratios 1, 3, 7, 7
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_ragged_attention_mixed_batch(dtype, heads, head_dim):
    n_q, n_kv = heads
    seed = n_q * 131 + head_dim
    case = make_ragged_case(seed, random_kinds(seed, 7), n_q, n_kv, head_dim, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    q64, k64, v64 = case.q.double(), case.k_cache.double(), case.v_cache.double()
    for b, kind in enumerate(case.kinds):  # each request against that request computed alone
        qs, ql, ks, kl = (int(t[b]) for t in case.index_tensors())
        one = torch.tensor([0])
        expected = reference.ragged_attention(q64[qs:qs + ql], k64[ks:ks + kl], v64[ks:ks + kl], one,
                                              torch.tensor([ql]), one, torch.tensor([kl]), scale)
        assert_close(out[qs:qs + ql], expected, dtype, f"request {b} ({kind}, q_len {ql}, kv_len {kl})")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_ragged_attention_index_dtypes_and_mixed(index_dtype):
    case = make_ragged_case(11, random_kinds(11, 5), 6, 2, 64, torch.float32, index_dtype=index_dtype)
    expected = reference.ragged_attention(case.q.double(), case.k_cache.double(), case.v_cache.double(),
                                          *case.index_tensors(), 0.125)
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.125)
    assert_close(out, expected, torch.float32, "ragged_attention")
    # Mixed int32/int64 index tensors are accepted too.
    mixed = (case.q_start.int(), case.q_len.long(), case.kv_start.int(), case.kv_len.long())
    assert_close(_C.ragged_attention(case.q, case.k_cache, case.v_cache, *mixed, 0.125), expected,
                 torch.float32, "ragged_attention (mixed index dtypes)")


def test_ragged_attention_long_context_no_overflow():
    """Large logits over a long context: a softmax without a running max would overflow float32."""
    gen = torch.Generator().manual_seed(5)
    n_ctx, d = 3000, 64
    q = torch.randn(2, 2, d, generator=gen) * 30
    k = torch.randn(n_ctx, 1, d, generator=gen) * 30
    v = torch.randn(n_ctx, 1, d, generator=gen)
    idx = [torch.tensor(x, dtype=torch.int32) for x in ([0], [2], [0], [n_ctx])]
    out = _C.ragged_attention(q, k, v, *idx, 1.0)
    assert torch.isfinite(out).all()
    expected = reference.ragged_attention(q.double(), k.double(), v.double(), *idx, 1.0)
    assert_close(out, expected, torch.float32, "long context")


def test_ops_dispatch_uses_extension():
    from orca_ext import ops
    assert ops.HAVE_EXTENSION
    case = make_ragged_case(2, ["decode", "prefill"], 2, 1, 64, torch.float32)
    a = ops.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.1)
    b = reference.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.1)
    assert_close(a, b, torch.float32, "ops.ragged_attention")


@pytest.mark.parametrize("n_tokens", [17, 96, 97])  # a tall lm_head-like shape, one and two token tiles
def test_rmsnorm_qkv_wide_output(n_tokens):
    gen = torch.Generator().manual_seed(n_tokens)
    hidden, n_out = 72, 16384 + 13
    x = torch.randn(n_tokens, hidden, generator=gen)
    nw = torch.randn(hidden, generator=gen)
    w = torch.randn(n_out, hidden, generator=gen) / math.sqrt(hidden)
    expected = reference.rmsnorm_qkv(x.double(), nw.double(), w.double(), None, 1e-6)
    assert_close(_C.rmsnorm_qkv(x, nw, w, None, 1e-6), expected, torch.float32, "rmsnorm_qkv (wide)")
