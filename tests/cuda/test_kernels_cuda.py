"""The CUDA kernels of orca_ext._C against float64 torch references (orca_ext.reference), on fresh
random ragged batches with awkward sizes: bf16 and fp16 (fp32 where the kernels offer it), GQA 1/2/8,
head dims 64/80/96/128 (tensor cores) and others (CUDA-core fallback), mixes of decodes, prefills and
prefills over a cached prefix, scattered slabs, long contexts that are split across blocks, both
sides of the rmsnorm_qkv fused/cuBLAS switch, and CUDA-graph capture with changing indices.
"""
from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

from orca_ext import reference

from kernel_cases import make_ragged_case, random_kinds, scattered_slabs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_C = pytest.importorskip("orca_ext._C")

DEV = "cuda"
# (atol, rtol) of a kernel's output against the float64 reference.
TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 2e-2)}
HALF_DTYPES = [torch.bfloat16, torch.float16]
ALL_DTYPES = HALF_DTYPES + [torch.float32]
FUSED_MAX_TOKENS = 64  # kRmsnormQkvFusedMaxTokens in csrc/cuda/launchers.h


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def reference_attention(case, scale):
    """float64 reference of a ragged case (computed on the CPU)."""
    cpu = [t.cpu() for t in case.index_tensors()]
    return reference.ragged_attention(case.q.double().cpu(), case.k_cache.double().cpu(),
                                      case.v_cache.double().cpu(), *cpu, scale)


def test_extension_dispatches_cuda_tensors_to_the_cuda_kernels():
    """A _C built against a CPU torch would fail every test below with one repeated error; say it once."""
    assert _C.built_with_cuda(), "orca_ext._C was built without CUDA: rebuild it against this CUDA torch"


# ---- rms_norm / rmsnorm_qkv --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("n_tokens,hidden", [(1, 1024), (7, 111), (83, 576), (300, 1000)])
def test_rms_norm(dtype, n_tokens, hidden):
    gen = torch.Generator().manual_seed(n_tokens * 7919 + hidden)
    x = (torch.randn(n_tokens, hidden, generator=gen) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    out = _C.rms_norm(x.to(DEV), w.to(DEV), 1e-5)
    assert out.device.type == "cuda" and out.dtype == dtype and out.shape == x.shape
    assert_close(out, reference.rms_norm(x.double(), w.double(), 1e-5), dtype, "rms_norm")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
# 1..64 tokens run the fused kernel (for H % 8 == 0); 65+ the rms_norm + cuBLAS path.
@pytest.mark.parametrize("n_tokens", [1, 7, 16, 17, 33, FUSED_MAX_TOKENS, FUSED_MAX_TOKENS + 1, 200])
@pytest.mark.parametrize("hidden,heads", [(111, (3, 1, 16)), (576, (9, 3, 64)), (1024, (16, 8, 128)),
                                          (200, (5, 1, 20))])
@pytest.mark.parametrize("bias", [False, True])
def test_rmsnorm_qkv(dtype, n_tokens, hidden, heads, bias):
    n_q, n_kv, d = heads
    n_out = (n_q + 2 * n_kv) * d
    gen = torch.Generator().manual_seed(zlib.crc32(repr((n_tokens, hidden, bias, dtype)).encode()))
    x = (torch.randn(n_tokens, hidden, generator=gen) * 2).to(dtype)
    nw = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    w = (torch.randn(n_out, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)
    b = torch.randn(n_out, generator=gen).to(dtype) if bias else None
    out = _C.rmsnorm_qkv(x.to(DEV), nw.to(DEV), w.to(DEV), None if b is None else b.to(DEV), 1e-6)
    assert out.shape == (n_tokens, n_out) and out.dtype == dtype and out.device.type == "cuda"
    expected = reference.rmsnorm_qkv(x.double(), nw.double(), w.double(), None if b is None else b.double(), 1e-6)
    assert_close(out, expected, dtype, "rmsnorm_qkv")


def test_rmsnorm_qkv_unaligned_input_takes_the_safe_path():
    """A view that starts 2 bytes into its storage cannot use 16-byte loads; the result is the same."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(9 * 256 + 1, generator=gen).to(torch.bfloat16).to(DEV)
    x = base[1:].view(9, 256)
    nw = torch.randn(256, generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.randn(96, 256, generator=gen) / 16).to(torch.bfloat16).to(DEV)
    out = _C.rmsnorm_qkv(x, nw, w, None, 1e-6)
    expected = reference.rmsnorm_qkv(x.double().cpu(), nw.double().cpu(), w.double().cpu(), None, 1e-6)
    assert_close(out, expected, torch.bfloat16, "rmsnorm_qkv (unaligned)")


# ---- slab_write ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n_tokens,n_kv,d", [(1, 8, 128), (7, 3, 80), (83, 2, 64), (40, 3, 7)])
def test_slab_write_scattered(dtype, index_dtype, n_tokens, n_kv, d):
    rng = random.Random(n_tokens * 31 + d)
    gen = torch.Generator().manual_seed(n_tokens + d)
    lengths = [len(c) for c in torch.arange(n_tokens).tensor_split(min(n_tokens, 4))]
    starts, n_slots = scattered_slabs(rng, [n + 5 for n in lengths])
    offsets = [rng.randint(0, 5) for _ in lengths]
    slots = torch.tensor([s + o + i for s, o, n in zip(starts, offsets, lengths) for i in range(n)], dtype=index_dtype)
    k_cache = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype)
    k = torch.randn(n_tokens, n_kv, d, generator=gen).to(dtype)
    v = torch.randn(n_tokens, n_kv, d, generator=gen).to(dtype)
    kc, vc = k_cache.to(DEV), v_cache.to(DEV)
    _C.slab_write(kc, vc, k.to(DEV), v.to(DEV), slots.to(DEV))
    reference.slab_write(k_cache, v_cache, k, v, slots)
    assert torch.equal(kc.cpu(), k_cache) and torch.equal(vc.cpu(), v_cache)


def test_slab_write_skips_out_of_range_slots():
    """On CUDA index values are not checked on the host (no sync); the kernel skips bad slots."""
    gen = torch.Generator().manual_seed(11)
    k_cache = torch.randn(20, 2, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(20, 2, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 20, 17])
    kc, vc = k_cache.to(DEV), v_cache.to(DEV)
    try:
        _C.slab_write(kc, vc, k.to(DEV), v.to(DEV), slots.to(DEV))
    except (ValueError, RuntimeError):
        return  # rejecting bad slots outright is also acceptable
    torch.cuda.synchronize()
    good = torch.tensor([0, 3])
    reference.slab_write(k_cache, v_cache, k[good], v[good], slots[good])
    assert torch.equal(kc.cpu(), k_cache) and torch.equal(vc.cpu(), v_cache)


# ---- ragged_attention ------------------------------------------------------------------------------
HEADS = [(4, 4), (8, 4), (16, 2)]  # GQA 1, 2, 8


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_attention_mixed_batches(dtype, heads, head_dim, seed):
    n_q, n_kv = heads
    kinds = random_kinds(1000 * seed + head_dim + n_q, 7)
    case = make_ragged_case(seed * 97 + head_dim, kinds, n_q, n_kv, head_dim, dtype, device=DEV,
                            max_context=300)
    scale = 1 / math.sqrt(head_dim)
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), scale)
    assert out.shape == case.q.shape and out.dtype == dtype and out.device.type == "cuda"
    assert_close(out, reference_attention(case, scale), dtype, f"ragged_attention {kinds}")


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_ragged_attention_long_contexts_split(dtype, index_dtype):
    """Decodes and short prefix-prefills over contexts of thousands of keys: the KV range is split
    across blocks and merged (log-sum-exp), and prefills span many 128-row tiles."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    n_q, n_kv, d = 8, 4, 128
    q_lens = [1, 1, 3, 1, 700, 5, 2]
    kv_lens = [4097, 2600, 3001, 300, 700, 1900, 64]
    starts, n_slots = scattered_slabs(rng, kv_lens)
    order = rng.sample(range(len(q_lens)), len(q_lens))
    q_starts, t = [0] * len(q_lens), 0
    for i in order:
        q_starts[i], t = t, t + q_lens[i]
    q = torch.randn(t, n_q, d, generator=gen).to(dtype).to(DEV)
    kc = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype).to(DEV)
    vc = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype).to(DEV)
    idx = [torch.tensor(v, dtype=index_dtype, device=DEV) for v in (q_starts, q_lens, starts, kv_lens)]
    scale = 0.09
    out = _C.ragged_attention(q, kc, vc, *idx, scale)
    expected = reference.ragged_attention(q.double().cpu(), kc.double().cpu(), vc.double().cpu(),
                                          *[i.cpu() for i in idx], scale)
    assert_close(out, expected, dtype, "ragged_attention (long contexts)")


def test_ragged_attention_many_split_multirow_requests():
    """16-row decode items (16 query rows, no GQA) over long contexts: more split partials than the
    partial-result buffer (sized for one-row decodes) holds, so later requests run unsplit."""
    rng = random.Random(9)
    gen = torch.Generator().manual_seed(9)
    n_q = n_kv = 2
    d = 64
    q_lens = [16] * 14 + [1, 1]
    kv_lens = [rng.randint(3000, 5000) for _ in q_lens]
    starts, n_slots = scattered_slabs(rng, kv_lens)
    q_starts = list(torch.tensor([0] + q_lens[:-1]).cumsum(0).tolist())
    t = sum(q_lens)
    q = torch.randn(t, n_q, d, generator=gen).to(torch.bfloat16).to(DEV)
    kc = torch.randn(n_slots, n_kv, d, generator=gen).to(torch.bfloat16).to(DEV)
    vc = torch.randn(n_slots, n_kv, d, generator=gen).to(torch.bfloat16).to(DEV)
    idx = [torch.tensor(v, dtype=torch.int32, device=DEV) for v in (q_starts, q_lens, starts, kv_lens)]
    out = _C.ragged_attention(q, kc, vc, *idx, 0.125)
    expected = reference.ragged_attention(q.double().cpu(), kc.double().cpu(), vc.double().cpu(),
                                          *[i.cpu() for i in idx], 0.125)
    assert_close(out, expected, torch.bfloat16, "ragged_attention (partial-buffer fallback)")


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 24),
                                            (torch.float16, 48), (torch.bfloat16, 16)])
def test_ragged_attention_cuda_core_fallback(dtype, head_dim):
    """float32, and head dims without a tensor-core instantiation, use the CUDA-core kernel."""
    kinds = random_kinds(head_dim, 6)
    case = make_ragged_case(head_dim + 5, kinds, 6, 2, head_dim, dtype, device=DEV, max_context=120)
    scale = 1 / math.sqrt(head_dim)
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), scale)
    assert_close(out, reference_attention(case, scale), dtype, f"ragged_attention fallback D={head_dim}")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (20, 1)])
def test_ragged_attention_head_dim_256_on_the_cuda_core_kernel(dtype, heads):
    """head_dim 256, the largest the CUDA-core kernel holds (kGenericMaxDim: 8 values per lane),
    on mixed batches whose contexts span several 32-key steps; one more is refused by name."""
    n_q, n_kv = heads
    kinds = random_kinds(256 + n_q, 6)
    case = make_ragged_case(256 * n_q, kinds, n_q, n_kv, 256, dtype, device=DEV, max_context=200)
    scale = 1 / 16
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), scale)
    assert_close(out, reference_attention(case, scale), dtype, f"ragged_attention D=256 {kinds}")
    too_wide = make_ragged_case(3, ["decode", "prefill"], n_q, n_kv, 258, dtype, device=DEV)
    with pytest.raises(ValueError, match="head_dim 258 is not supported"):
        _C.ragged_attention(too_wide.q, too_wide.k_cache, too_wide.v_cache, *too_wide.index_tensors(), scale)


def test_ragged_attention_uncovered_rows_are_zero():
    case = make_ragged_case(21, ["decode", "prefill", "prefix"], 8, 2, 64, torch.bfloat16, device=DEV)
    extra = torch.randn(5, 8, 64, device=DEV).to(torch.bfloat16)
    q = torch.cat([case.q, extra])  # 5 trailing rows owned by no request
    out = _C.ragged_attention(q, case.k_cache, case.v_cache, *case.index_tensors(), 0.125)
    assert torch.count_nonzero(out[-5:]) == 0
    assert_close(out[:-5], reference_attention(case, 0.125), torch.bfloat16, "covered rows")


def test_ragged_attention_skips_invalid_requests():
    """Index values are not checked on the host for CUDA tensors; a request whose slab leaves the
    cache must neither fault nor disturb the other requests (its rows stay zero)."""
    case = make_ragged_case(8, ["decode", "prefill", "decode", "prefix"], 8, 4, 128, torch.bfloat16, device=DEV)
    q_start, q_len, kv_start, kv_len = (t.clone() for t in case.index_tensors())
    n_slots = case.k_cache.shape[0]
    kv_start[2] = n_slots - int(kv_len[2]) + 1  # one slot past the end
    try:
        out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, q_start, q_len, kv_start, kv_len, 0.1)
        torch.cuda.synchronize()
    except (ValueError, RuntimeError) as exc:  # a host-side check is acceptable too
        assert "kv" in str(exc).lower() or "slot" in str(exc).lower()
        return
    expected = reference_attention(case, 0.1)
    bad = slice(int(q_start[2]), int(q_start[2]) + int(q_len[2]))
    assert torch.count_nonzero(out[bad]) == 0
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[bad] = False
    assert_close(out[keep.to(DEV)], expected[keep], torch.bfloat16, "valid requests")


def test_ragged_attention_is_graph_capturable():
    """Capture one call in a CUDA graph (a host sync would fail the capture), then replay it with
    new query data and new per-request indices of the same shapes."""
    n_q, n_kv, d, t, b, n_slots = 8, 2, 128, 40, 4, 2000
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(t, n_q, d, generator=gen).to(torch.bfloat16).to(DEV)
    kc = torch.randn(n_slots, n_kv, d, generator=gen).to(torch.bfloat16).to(DEV)
    vc = torch.randn(n_slots, n_kv, d, generator=gen).to(torch.bfloat16).to(DEV)
    idx = [torch.zeros(b, dtype=torch.int32, device=DEV) for _ in range(4)]

    def set_batch(q_lens, kv_lens, kv_starts):
        starts = [0] + list(torch.tensor(q_lens).cumsum(0)[:-1].tolist())
        for dst, vals in zip(idx, (starts, q_lens, kv_starts, kv_lens)):
            dst.copy_(torch.tensor(vals, dtype=torch.int32))
        q.copy_(torch.randn(t, n_q, d, generator=gen).to(torch.bfloat16))

    set_batch([1, 1, 1, 37], [50, 1500, 9, 37], [0, 100, 1700, 1800])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (allocator, one-time setup)
        _C.ragged_attention(q, kc, vc, *idx, 0.1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _C.ragged_attention(q, kc, vc, *idx, 0.1)
    for q_lens, kv_lens, kv_starts in (([1, 1, 1, 37], [50, 1500, 9, 37], [0, 100, 1700, 1800]),
                                       ([2, 30, 1, 7], [900, 30, 1999, 7], [1000, 0, 1, 1950]),
                                       ([1, 1, 1, 1], [1, 2, 3, 1900], [0, 10, 20, 30])):
        set_batch(q_lens, kv_lens, kv_starts)
        graph.replay()
        torch.cuda.synchronize()
        expected = reference.ragged_attention(q.double().cpu(), kc.double().cpu(), vc.double().cpu(),
                                              *[i.cpu() for i in idx], 0.1)
        assert_close(out, expected, torch.bfloat16, f"graph replay {q_lens}/{kv_lens}")


def test_norm_projection_and_cache_write_are_graph_capturable():
    """rms_norm, the fused rmsnorm_qkv and slab_write inside one captured graph (as in a captured
    decode step), replayed with new activations and new slots."""
    gen = torch.Generator().manual_seed(4)
    t, h, n_q, n_kv, d, n_slots = 8, 256, 4, 2, 64, 300
    n_out = (n_q + 2 * n_kv) * d
    dt = torch.bfloat16
    x = torch.zeros(t, h, dtype=dt, device=DEV)
    nw = (1 + 0.3 * torch.randn(h, generator=gen)).to(dt).to(DEV)
    w = (torch.randn(n_out, h, generator=gen) / 16).to(dt).to(DEV)
    k_cache = torch.zeros(n_slots, n_kv, d, dtype=dt, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.zeros(t, dtype=torch.int64, device=DEV)

    def step():
        normed = _C.rms_norm(x, nw, 1e-6)
        qkv = _C.rmsnorm_qkv(x, nw, w, None, 1e-6)
        k = qkv[:, n_q * d:(n_q + n_kv) * d].reshape(t, n_kv, d)
        v = qkv[:, (n_q + n_kv) * d:].reshape(t, n_kv, d)
        _C.slab_write(k_cache, v_cache, k, v, slots)
        return normed, qkv

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, qkv = step()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x_host = torch.randn(t, h, generator=g).to(dt)
        slot_host = torch.randperm(n_slots, generator=g)[:t]
        x.copy_(x_host)
        slots.copy_(slot_host)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(normed, reference.rms_norm(x_host.double(), nw.double().cpu(), 1e-6), dt, "rms_norm (graph)")
        expected = reference.rmsnorm_qkv(x_host.double(), nw.double().cpu(), w.double().cpu(), None, 1e-6)
        assert_close(qkv, expected, dt, "rmsnorm_qkv (graph)")
        assert torch.equal(k_cache[slot_host.to(DEV)], qkv[:, n_q * d:(n_q + n_kv) * d].reshape(t, n_kv, d))
        assert torch.equal(v_cache[slot_host.to(DEV)], qkv[:, (n_q + n_kv) * d:].reshape(t, n_kv, d))
# ---- slab_move (slab compaction) ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("shape", [(1, 40, 1), (6, 97, 3, 16), (64, 600, 8, 128)])
def test_slab_move_matches_reference_bit_for_bit(dtype, shape):
    """Disjoint and overlapping moves in both directions: the big case stages overlapping moves
    through scratch, the small ones copy them in shift-sized pieces."""
    rng = random.Random(sum(shape))
    pools = (torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))) * 100).to(dtype)
    moves = []
    for i in range(9):
        n = rng.randint(0, shape[1] // 2)
        src = rng.randint(0, shape[1] - n)
        dst = rng.randint(0, shape[1] - n) if i % 2 else max(0, min(shape[1] - n, src + rng.randint(-n, n)))
        moves.append((src, dst, n))
    expected = pools.clone()
    reference.slab_move(expected, moves)
    dev = pools.to(DEV)
    _C.slab_move(dev, torch.tensor(moves, dtype=torch.int64))
    assert torch.equal(dev.cpu(), expected)


def test_slab_move_pools_over_2_gib_match_reference():
    """Pools of over 2 GiB each, as a large model's KV cache has on this GPU: their pitch (one
    pool's bytes) exceeds cudaDevAttrMaxPitch (2^31 - 1), which no 2-D device copy accepts, so the
    moves go pool by pool. Disjoint moves across the 2 GiB mark, overlapping ones staged through
    the scratch (a shift below its 10,922 rows per pool) and in shift-sized pieces (a larger one)."""
    n_pools, heads, head_dim = 3, 8, 128  # a row: 8 KV heads x 128 int16 = 2 KiB, as a bf16 K pool's
    row_bytes = heads * head_dim * 2
    n_slots = 2**31 // row_bytes + 40_000  # rows from 2^20 on lie past 2 GiB into their pool
    assert n_slots * row_bytes > 2**31 - 1
    pool_bytes = n_pools * n_slots * row_bytes
    free, _total = torch.cuda.mem_get_info()
    if free < 2.5 * pool_bytes:
        pytest.skip(f"needs {2.5 * pool_bytes / 2**30:.1f} GiB free on the GPU, has {free / 2**30:.1f}")
    gen = torch.Generator(device=DEV).manual_seed(2**31)
    # int16: any bit pattern compares equal to itself (bf16 NaNs would not)
    pools = torch.randint(-2**15, 2**15, (n_pools, n_slots, heads, head_dim), dtype=torch.int16, device=DEV,
                          generator=gen)
    rng = random.Random(31)
    high = n_slots - 70_000
    moves = [
        (rng.randrange(1000), high + rng.randrange(1000), 50_000),      # low -> past 2 GiB
        (high + rng.randrange(1000), rng.randrange(1000), 60_001),      # past 2 GiB -> low
        (2**20 - 5, 2**20 + 95, 30_000),                                # overlapping, shift 100: scratch
        (high - 300_000, high - 300_007, 200_003),                      # overlapping the other way
        (300_000, 350_000, 100_000),                                    # shift 50,000 > scratch: pieces
        (n_slots - 100_000, n_slots - 160_000, 100_000),                # the last rows, pieces downward
        (123, 123, 1000), (5, 9, 0),                                    # no-ops
    ]
    expected = pools.clone()
    reference.slab_move(expected, moves)
    _C.slab_move(pools, torch.tensor(moves, dtype=torch.int64))
    torch.cuda.synchronize()
    assert torch.equal(pools, expected)


# ---- batch-invariant paths ---------------------------------------------------------------------------
def random_subsets(rng: random.Random, n: int, count: int = 6) -> list[list[int]]:
    sizes = [1, 2, 3, 63, 64, 65, n] + [rng.randint(1, n) for _ in range(count)]
    return [rng.sample(range(n), min(k, n)) for k in sizes]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("k,n", [(40, 96), (576, 1536)])
def test_linear_batch_invariant_rows_do_not_depend_on_the_batch(dtype, k, n):
    rng = random.Random(k + n)
    gen = torch.Generator().manual_seed(k * n)
    x = torch.randn(300, k, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype).to(DEV)
    b = torch.randn(n, generator=gen).to(dtype).to(DEV)
    full = _C.linear(x, w, b, batch_invariant=True)
    assert_close(full, torch.nn.functional.linear(x.double(), w.double(), b.double()), dtype, "linear")
    for rows in random_subsets(rng, x.shape[0]):
        assert torch.equal(_C.linear(x[rows], w, b, batch_invariant=True), full[rows]), f"{len(rows)} rows"


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_linear_silu_mul_batch_invariant_rows_do_not_depend_on_the_batch(dtype):
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(301, 96, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(2 * 80, 96, generator=gen) / math.sqrt(96)).to(dtype).to(DEV)
    full = _C.linear_silu_mul(x, w, None, batch_invariant=True)
    assert_close(full, reference.linear_silu_mul(x.double().cpu(), w.double().cpu()), dtype, "linear_silu_mul")
    for rows in random_subsets(rng, x.shape[0]):
        assert torch.equal(_C.linear_silu_mul(x[rows], w, None, batch_invariant=True), full[rows])


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rmsnorm_qkv_batch_invariant_rows(dtype):
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    hidden, n_out = 576, 960
    x = torch.randn(200, hidden, generator=gen).to(dtype).to(DEV)  # both sides of the fused switch
    nw = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEV)
    w = (torch.randn(n_out, hidden, generator=gen) / math.sqrt(hidden)).to(dtype).to(DEV)
    full = _C.rmsnorm_qkv(x, nw, w, None, 1e-6, True)
    expected = reference.rmsnorm_qkv(x.double().cpu(), nw.double().cpu(), w.double().cpu(), None, 1e-6)
    assert_close(full, expected, dtype, "rmsnorm_qkv (batch-invariant)")
    for rows in random_subsets(rng, x.shape[0]):
        assert torch.equal(_C.rmsnorm_qkv(x[rows], nw, w, None, 1e-6, True), full[rows])


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("heads,head_dim", [((16, 8), 128), ((9, 3), 64), ((6, 2), 48)])
def test_ragged_attention_batch_invariant_rows_ignore_chunks_and_batch_mates(dtype, heads, head_dim):
    """One request's prompt rows as one prefill, as chunks over its cached prefix, as one-row
    decodes (a long context: the default path would split it), and beside other requests."""
    n_q, n_kv = heads
    rng = random.Random(n_q + head_dim)
    gen = torch.Generator().manual_seed(n_q)
    d, n_ctx, start = head_dim, 1500, 7
    others = make_ragged_case(n_q, random_kinds(n_q, 9), n_q, n_kv, d, dtype, device=DEV, max_context=700)
    k_cache = torch.cat([others.k_cache, torch.randn(start + n_ctx, n_kv, d, generator=gen).to(dtype).to(DEV)])
    v_cache = torch.cat([others.v_cache, torch.randn(start + n_ctx, n_kv, d, generator=gen).to(dtype).to(DEV)])
    slab = others.k_cache.shape[0] + start
    q = torch.randn(n_ctx, n_q, d, generator=gen).to(dtype).to(DEV)

    def run(pieces, with_others, planned=False):
        qs, ql, ks, kl, rows = [], [], [], [], []
        if with_others:
            rows.append(others.q)
            qs += others.q_start.tolist(); ql += others.q_len.tolist()
            ks += others.kv_start.tolist(); kl += others.kv_len.tolist()
        base = sum(r.shape[0] for r in rows)
        for lo, hi in pieces:
            qs.append(base); ql.append(hi - lo); ks.append(slab); kl.append(hi)
            rows.append(q[lo:hi])
            base += hi - lo
        idx = [torch.tensor(v, dtype=torch.int32, device=DEV) for v in (qs, ql, ks, kl)]
        plan = (_C.ragged_attention_plan(*idx, base, k_cache.shape[0], n_q, n_kv, d, dtype, batch_invariant=True)
                if planned else None)
        out = _C.ragged_attention(torch.cat(rows), k_cache, v_cache, *idx, 0.125, plan=plan, batch_invariant=True)
        return out[base - sum(hi - lo for lo, hi in pieces):]

    whole = run([(0, n_ctx)], False)
    expected = reference.ragged_attention(q.double().cpu(), k_cache[slab:].double().cpu(),
                                          v_cache[slab:].double().cpu(),
                                          *(torch.tensor([v]) for v in (0, n_ctx, 0, n_ctx)), 0.125)
    assert_close(whole, expected, dtype, "ragged_attention (batch-invariant)")
    cuts = sorted(rng.sample(range(1, n_ctx), 8))
    assert torch.equal(run(list(zip([0] + cuts, cuts + [n_ctx])), True), whole)
    assert torch.equal(run([(0, 40)], True), whole[:40])
    for p in (0, 1, 63, 64, 700, n_ctx - 1):
        assert torch.equal(run([(p, p + 1)], rng.random() < 0.5), whole[p:p + 1]), f"row {p}"
        # The same through a plan built once for the batch (as the model's forward does).
        assert torch.equal(run([(p, p + 1)], True, planned=True), whole[p:p + 1]), f"row {p} (plan)"
