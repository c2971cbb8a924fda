"""The fused CPU kernel rope_slab_write (rotary embedding of q and k + the KV slab write) against
a float64 torch reference, and bit for bit against the unfused path it replaces (the model's
apply_rope in float32, then slab_write), on fresh random inputs with awkward sizes and scattered
slots. Also: the model forward with and without the fusion, and bad input."""
from __future__ import annotations

import pytest
import torch

from orca_ext import modes, ops, reference
from orca_ext.models import ForwardBatch, load_model
from orca_ext.models.rope import apply_rope

_C = pytest.importorskip("orca_ext._C")

DTYPES = [torch.float32, torch.bfloat16]
# (atol, rtol) of the kernel's output against the float64 reference (inputs are ~N(0, 3^2)).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 1e-2)}
# (T, Hq, Hkv, D): a decode, a few tokens, a prefill chunk above the kernel's parallel threshold.
SHAPES = [(1, 9, 3, 64), (3, 7, 1, 48), (37, 9, 3, 64), (37, 7, 1, 2), (3, 5, 5, 128), (700, 9, 3, 64)]


def make_case(n_tokens, n_q, n_kv, d, dtype, index_dtype=torch.int64, seed=0):
    """Random qkv, rope tables of random positions, caches with random contents, distinct slots."""
    gen = torch.Generator().manual_seed(seed)
    n_slots = n_tokens + 23
    qkv = (3 * torch.randn(n_tokens, (n_q + 2 * n_kv) * d, generator=gen)).to(dtype)
    positions = torch.randint(0, 32768, (n_tokens,), generator=gen)
    freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(positions.to(torch.float32), freq)
    k_cache = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype)
    slots = torch.randperm(n_slots, generator=gen)[:n_tokens].to(index_dtype)
    return qkv, angles.cos(), angles.sin(), k_cache, v_cache, slots


def unfused(qkv, cos, sin, k_cache, v_cache, slots, n_q, n_kv):
    """The model's path before the fusion: views of qkv, apply_rope on q and k, slab_write."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    q = apply_rope(qkv[:, :n_q * d].view(t, n_q, d), cos, sin)
    k = apply_rope(qkv[:, n_q * d:(n_q + n_kv) * d].view(t, n_kv, d), cos, sin)
    v = qkv[:, (n_q + n_kv) * d:].reshape(t, n_kv, d).contiguous()
    _C.slab_write(k_cache, v_cache, k, v, slots)
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-{}x{}-D{}".format(*s))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_float64_reference(dtype, shape, index_dtype):
    n_tokens, n_q, n_kv, d = shape
    qkv, cos, sin, k_cache, v_cache, slots = make_case(*shape, dtype, index_dtype, seed=hash(shape) % 2**31)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = _C.rope_slab_write(qkv, cos, sin, k_cache, v_cache, slots, n_q, n_kv)
    assert q.shape == (n_tokens, n_q, d) and q.dtype == dtype and q.is_contiguous()

    k_ref, v_ref = k_before.double(), v_before.double()
    q_ref = reference.rope_slab_write(qkv.double(), cos.double(), sin.double(), k_ref, v_ref, slots, n_q, n_kv)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q.double(), q_ref, atol=atol, rtol=rtol)
    written = slots.long()
    torch.testing.assert_close(k_cache[written].double(), k_ref[written], atol=atol, rtol=rtol)
    assert torch.equal(v_cache[written], qkv[:, (n_q + n_kv) * d:].reshape(n_tokens, n_kv, d))  # v is copied
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-{}x{}-D{}".format(*s))
def test_bit_identical_to_rope_then_slab_write(dtype, shape):
    n_q, n_kv = shape[1], shape[2]
    qkv, cos, sin, k_cache, v_cache, slots = make_case(*shape, dtype, seed=1 + hash(shape) % 2**31)
    k_old, v_old = k_cache.clone(), v_cache.clone()
    q_old = unfused(qkv, cos, sin, k_old, v_old, slots, n_q, n_kv)
    q = _C.rope_slab_write(qkv, cos, sin, k_cache, v_cache, slots, n_q, n_kv)
    assert torch.equal(q, q_old)
    assert torch.equal(k_cache, k_old)
    assert torch.equal(v_cache, v_old)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pure_torch_fallback_matches_kernel(dtype):
    """ops falls back to reference.rope_slab_write without _C (and off the CPU): same bits."""
    shape = (5, 9, 3, 64)
    qkv, cos, sin, k_cache, v_cache, slots = make_case(*shape, dtype, seed=5)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = reference.rope_slab_write(qkv, cos, sin, k_ref, v_ref, slots, 9, 3)
    q = ops.rope_slab_write(qkv, cos, sin, k_cache, v_cache, slots, 9, 3)
    assert torch.equal(q, q_ref) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_non_contiguous_qkv_and_tables():
    qkv, cos, sin, k_cache, v_cache, slots = make_case(4, 3, 1, 16, torch.float32, seed=9)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = unfused(qkv, cos, sin, k_ref, v_ref, slots, 3, 1)
    q = _C.rope_slab_write(qkv.t().contiguous().t(), cos.t().contiguous().t(), sin.t().contiguous().t(),
                           k_cache, v_cache, slots, 3, 1)
    assert torch.equal(q, q_ref) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_zero_tokens_writes_nothing():
    qkv, cos, sin, k_cache, v_cache, slots = make_case(0, 3, 1, 16, torch.float32)
    k_before = k_cache.clone()
    q = _C.rope_slab_write(qkv, cos, sin, k_cache, v_cache, slots, 3, 1)
    assert q.shape == (0, 3, 16) and torch.equal(k_cache, k_before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_model_forward_identical_with_and_without_fusion(tiny_model_dir, monkeypatch, dtype, family):
    """A prefill of two prompts, then a decode step: the same logits and KV pools, bit for bit.
    The fused_rope_on_cpu mode picks the path: the kernel runs once per layer and step with it on,
    never with it off."""
    model = load_model(tiny_model_dir(family, tie_word_embeddings=False), dtype=dtype)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.spec.vocab_size, (n,), generator=gen).tolist() for n in (13, 5)]
    steps = [ForwardBatch.build([(prompts[0], 0, 40), (prompts[1], 0, 3)], "cpu"),
             ForwardBatch.build([([7], 13, 40), ([9], 5, 3)], "cpu")]
    calls = []
    fused_op = ops.rope_slab_write
    monkeypatch.setattr(ops, "rope_slab_write", lambda *args: calls.append(1) or fused_op(*args))
    results = []
    for fused in (False, True):
        calls.clear()
        with modes.using(fused_rope_on_cpu=fused):
            model.allocate_kv_cache(64)
            logits = [model.forward(b) for b in steps]
        assert len(calls) == (len(model.layers) * len(steps) if fused else 0), fused
        results.append((logits, model.kv_pools.clone()))
    (logits_old, pools_old), (logits_new, pools_new) = results
    for old, new in zip(logits_old, logits_new):
        assert torch.equal(old, new)
    assert torch.equal(pools_old, pools_new)


def _call(**changes):
    args = dict(zip(("qkv", "cos", "sin", "k_cache", "v_cache", "slots"), make_case(3, 7, 1, 48, torch.float32)))
    args.update(n_q_heads=7, n_kv_heads=1)
    args.update(changes)
    return _C.rope_slab_write(**args)


@pytest.mark.parametrize("changes,match", [
    (dict(qkv=torch.zeros(3, 9 * 48 + 1)), r"qkv has 433 columns but \(n_q_heads \+ 2\*n_kv_heads\) \* head_dim"),
    (dict(n_q_heads=6), r"qkv has 432 columns"),
    (dict(n_kv_heads=2), r"k_cache has 1 KV heads but n_kv_heads is 2"),
    (dict(n_q_heads=0), r"n_q_heads must be >= 1"),
    (dict(qkv=torch.zeros(3, 9 * 48, dtype=torch.float64)), r"qkv has dtype Double"),
    (dict(qkv=torch.zeros(3, 9 * 48, dtype=torch.bfloat16)), r"k_cache has dtype Float but qkv has BFloat16"),
    (dict(cos=torch.zeros(3, 24, dtype=torch.float64)), r"cos has dtype Double but the rope tables must be float32"),
    (dict(sin=torch.zeros(3, 24, dtype=torch.bfloat16)), r"sin has dtype BFloat16"),
    (dict(cos=torch.zeros(3, 48)), r"cos has shape \[3, 48\] but must be \[T, D/2\] = \[3, 24\]"),
    (dict(sin=torch.zeros(2, 24)), r"sin has shape \[2, 24\]"),
    (dict(cos=torch.zeros(3, 1, 24)), r"cos must be 2-D \[T, D/2\]"),
    (dict(slots=torch.tensor([0, 1])), r"slots has 2 entries but qkv has 3 rows"),
    (dict(slots=torch.tensor([0.0, 1.0, 2.0])), r"slots must be int32 or int64"),
    (dict(v_cache=torch.zeros(26, 2, 48)), r"v_cache shape \[26, 2, 48\] differs from k_cache shape \[26, 1, 48\]"),
    (dict(k_cache=torch.zeros(26, 1, 47), v_cache=torch.zeros(26, 1, 47)), r"head_dim \(k_cache.size\(2\)\) must be even"),
])
def test_bad_input_is_a_value_error(changes, match):
    with pytest.raises(ValueError, match=match):
        _call(**changes)


@pytest.mark.parametrize("bad_slot", [-1, 26, 2**40])
def test_slot_out_of_range_is_rejected_before_any_write(bad_slot):
    qkv, cos, sin, k_cache, v_cache, _ = make_case(3, 7, 1, 48, torch.float32)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match=rf"slots contains {bad_slot}, outside the cache of 26 slots"):
        _C.rope_slab_write(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, bad_slot, 2]), 7, 1)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_non_contiguous_cache_is_rejected():
    qkv, cos, sin, k_cache, v_cache, slots = make_case(3, 7, 1, 48, torch.float32)
    strided = torch.zeros(26, 1, 96)[:, :, :48]
    with pytest.raises(ValueError, match="k_cache and v_cache must be contiguous"):
        _C.rope_slab_write(qkv, cos, sin, strided, torch.zeros(26, 1, 48), slots, 7, 1)
