"""The CUDA ragged_attention plan against the float64 reference: one device work list serves several
layers (each launch must leave the plan's counters as it found them, or the next layer computes
nothing or never merges its KV splits), under every runtime knob (items per SM, the decode kernel
with 2 or 3 K/V stages, which runs prefill work as 16-row tiles), inside a CUDA graph with changing
indices, and with rows owned by no request zeroed on every launch.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from orca_ext import reference

from kernel_cases import make_ragged_case, random_kinds, scattered_slabs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_C = pytest.importorskip("orca_ext._C")

DEV = "cuda"
TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 2e-2)}


def expected_of(q, k, v, idx, scale):
    return reference.ragged_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                      *[i.cpu() for i in idx], scale)


def assert_close(actual, expected, dtype, what):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def plan_for(q, k, idx, **kw):
    return _C.ragged_attention_plan(*idx, q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], q.dtype, **kw)


def long_mixed_batch(seed, n_q, n_kv, d, dtype, index_dtype=torch.int32):
    """Decodes over thousands of keys (split across blocks), multi-row decodes, prefills of several
    128-row tiles and prefills over a cached prefix, with scattered slabs and shuffled rows."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    q_lens = [1, 1, 3, 1, 300, 5, 2, 1, 40]
    kv_lens = [4097, 2600, 3001, 300, 300, 1900, 64, 1, 900]
    starts, n_slots = scattered_slabs(rng, kv_lens)
    order = rng.sample(range(len(q_lens)), len(q_lens))
    q_starts, t = [0] * len(q_lens), 0
    for i in order:
        q_starts[i], t = t, t + q_lens[i]
    idx = [torch.tensor(v, dtype=index_dtype, device=DEV) for v in (q_starts, q_lens, starts, kv_lens)]

    def layer():
        return (torch.randn(t, n_q, d, generator=gen).to(dtype).to(DEV),
                torch.randn(n_slots, n_kv, d, generator=gen).to(dtype).to(DEV),
                torch.randn(n_slots, n_kv, d, generator=gen).to(dtype).to(DEV))

    return idx, layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim", [((8, 4), 128), ((16, 2), 64), ((4, 4), 80), ((8, 2), 96)])
def test_one_plan_serves_every_layer(dtype, heads, head_dim):
    n_q, n_kv = heads
    idx, layer = long_mixed_batch(head_dim + n_q, n_q, n_kv, head_dim, dtype)
    q0, k0, _ = layer()
    plan = plan_for(q0, k0, idx)
    assert plan.nbytes > 0
    scale = 1 / math.sqrt(head_dim)
    for i in range(4):
        q, k, v = layer()
        out = _C.ragged_attention(q, k, v, *idx, scale, plan)
        assert_close(out, expected_of(q, k, v, idx, scale), dtype, f"layer {i}")


@pytest.mark.parametrize("decode_stages", [0, 2, 3])
@pytest.mark.parametrize("items_per_sm", [1, 4, 16, 64, 256])
def test_tuning_knobs_keep_the_result(decode_stages, items_per_sm):
    idx, layer = long_mixed_batch(items_per_sm * 7 + decode_stages, 16, 2, 128, torch.bfloat16,
                                  index_dtype=torch.int64)
    q, k, v = layer()
    plan = plan_for(q, k, idx, items_per_sm=items_per_sm, decode_stages=decode_stages)
    for i in range(2):
        q, k, v = layer()
        out = _C.ragged_attention(q, k, v, *idx, 0.1, plan)
        assert_close(out, expected_of(q, k, v, idx, 0.1), torch.bfloat16,
                     f"items_per_sm={items_per_sm} decode_stages={decode_stages} layer {i}")


@pytest.mark.parametrize("decode_stages", [0, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_decode_kernel_on_random_mixed_batches(decode_stages, dtype, head_dim):
    """Every head dim of both kernels on short mixed batches (GQA 2)."""
    kinds = random_kinds(head_dim + decode_stages, 8)
    case = make_ragged_case(head_dim * 3 + decode_stages, kinds, 8, 4, head_dim, dtype, device=DEV, max_context=400)
    plan = plan_for(case.q, case.k_cache, case.index_tensors(), decode_stages=decode_stages)
    scale = 1 / math.sqrt(head_dim)
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), scale, plan)
    assert_close(out, expected_of(case.q, case.k_cache, case.v_cache, case.index_tensors(), scale), dtype,
                 f"decode_stages={decode_stages} {kinds}")


@pytest.mark.parametrize("decode_stages", [0, 2, 3])
@pytest.mark.parametrize("heads,head_dim,dtype", [((17, 1), 128, torch.bfloat16), ((32, 1), 128, torch.float16),
                                                  ((40, 2), 64, torch.bfloat16), ((48, 2), 80, torch.float16),
                                                  ((96, 4), 96, torch.bfloat16)])
def test_gqa_groups_over_16_heads(decode_stages, heads, head_dim, dtype):
    """With G > 16 query heads per KV head even a one-token decode packs G rows, more than a 16-row
    decode tile holds: such decodes run as prefill items (128-row tiles, or several 16-row tiles
    under the decode kernel). Every request of the long mixed batch is one, decodes over thousands
    of keys included, with one plan reused across layers and with a plan built per call."""
    n_q, n_kv = heads
    idx, layer = long_mixed_batch(n_q * head_dim + decode_stages, n_q, n_kv, head_dim, dtype)
    q0, k0, _ = layer()
    plan = plan_for(q0, k0, idx, decode_stages=decode_stages)
    scale = 1 / math.sqrt(head_dim)
    for i in range(2):
        q, k, v = layer()
        out = _C.ragged_attention(q, k, v, *idx, scale, plan)
        assert_close(out, expected_of(q, k, v, idx, scale), dtype, f"G={n_q // n_kv} layer {i}")
    # Without a plan (one built per call) the result is the same.
    out = _C.ragged_attention(q, k, v, *idx, scale)
    assert_close(out, expected_of(q, k, v, idx, scale), dtype, f"G={n_q // n_kv} without a plan")


@pytest.mark.parametrize("decode_stages", [0, 3])
def test_unowned_rows_are_zeroed_by_every_launch(decode_stages):
    case = make_ragged_case(21, ["decode", "prefill", "prefix"], 8, 2, 64, torch.bfloat16, device=DEV)
    q = torch.cat([case.q, torch.randn(5, 8, 64, device=DEV).to(torch.bfloat16)])  # 5 rows nobody owns
    plan = plan_for(q, case.k_cache, case.index_tensors(), decode_stages=decode_stages)
    expected = expected_of(case.q, case.k_cache, case.v_cache, case.index_tensors(), 0.125)
    for _ in range(2):
        # Leave NaNs in the allocator's cache, so an output block that is reused and not zeroed shows.
        poison = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEV)
        del poison
        out = _C.ragged_attention(q, case.k_cache, case.v_cache, *case.index_tensors(), 0.125, plan)
        assert torch.count_nonzero(out[-5:]) == 0
        assert_close(out[:-5], expected, torch.bfloat16, "owned rows")


def test_plan_and_layers_in_a_cuda_graph():
    """Capture the plan and two layers' attention, replay with new indices and new queries."""
    n_q, n_kv, d, t, b, n_slots = 8, 2, 128, 40, 4, 2000
    gen = torch.Generator().manual_seed(2)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(DEV)

    qs = [rand(t, n_q, d) for _ in range(2)]
    caches = [(rand(n_slots, n_kv, d), rand(n_slots, n_kv, d)) for _ in range(2)]
    idx = [torch.zeros(b, dtype=torch.int32, device=DEV) for _ in range(4)]

    def set_batch(q_lens, kv_lens, kv_starts):
        starts = [0] + list(torch.tensor(q_lens).cumsum(0)[:-1].tolist())
        for dst, vals in zip(idx, (starts, q_lens, kv_starts, kv_lens)):
            dst.copy_(torch.tensor(vals, dtype=torch.int32))
        for q in qs:
            q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))

    def forward():
        plan = _C.ragged_attention_plan(*idx, t, n_slots, n_q, n_kv, d, torch.bfloat16)
        return [_C.ragged_attention(q, k, v, *idx, 0.1, plan) for q, (k, v) in zip(qs, caches)]

    set_batch([1, 1, 1, 37], [50, 1500, 9, 37], [0, 100, 1700, 1800])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward()
    for q_lens, kv_lens, kv_starts in (([1, 1, 1, 37], [50, 1500, 9, 37], [0, 100, 1700, 1800]),
                                       ([2, 30, 1, 7], [900, 30, 1999, 7], [1000, 0, 1, 1950]),
                                       ([1, 1, 1, 1], [1, 2, 3, 1900], [0, 10, 20, 30])):
        set_batch(q_lens, kv_lens, kv_starts)
        graph.replay()
        torch.cuda.synchronize()
        for layer, (out, q, (k, v)) in enumerate(zip(outs, qs, caches)):
            assert_close(out, expected_of(q, k, v, idx, 0.1), torch.bfloat16, f"replay {q_lens} layer {layer}")


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 48)])
def test_cuda_core_path_needs_no_device_plan(dtype, head_dim):
    case = make_ragged_case(head_dim, random_kinds(head_dim, 6), 6, 2, head_dim, dtype, device=DEV, max_context=120)
    plan = plan_for(case.q, case.k_cache, case.index_tensors())
    assert plan.nbytes == 0
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.2, plan)
    assert_close(out, expected_of(case.q, case.k_cache, case.v_cache, case.index_tensors(), 0.2), dtype, "fallback")


def test_plan_errors_on_cuda():
    case = make_ragged_case(3, ["decode", "prefill"], 4, 2, 64, torch.bfloat16, device=DEV)
    idx = case.index_tensors()
    with pytest.raises(ValueError, match="decode_stages"):
        plan_for(case.q, case.k_cache, idx, decode_stages=5)
    cpu_idx = [i.cpu() for i in idx]
    cpu_plan = _C.ragged_attention_plan(*cpu_idx, case.q.shape[0], case.k_cache.shape[0], 4, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="built for device cpu"):
        _C.ragged_attention(case.q, case.k_cache, case.v_cache, *idx, 0.1, cpu_plan)
    fp16_plan = _C.ragged_attention_plan(*idx, case.q.shape[0], case.k_cache.shape[0], 4, 2, 64, torch.float16)
    assert fp16_plan.nbytes > 0
    with pytest.raises(ValueError, match="dtype"):
        _C.ragged_attention(case.q, case.k_cache, case.v_cache, *idx, 0.1, fp16_plan)
