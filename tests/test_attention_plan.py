"""ragged_attention_plan on the CPU: a plan changes nothing about the result (the CPU kernel needs
no work list), serves several layers, and is refused with a ValueError naming the field when it
does not belong to the call. The CUDA plan (the device work list, its reuse across layers, the
runtime knobs) is tested in tests/cuda/test_attention_plan_cuda.py.
"""
from __future__ import annotations

import pytest
import torch

from orca_ext import ops, reference

from kernel_cases import make_ragged_case, random_kinds

_C = pytest.importorskip("orca_ext._C")


def plan_for(case, **kw):
    n_tokens, n_q, d = case.q.shape
    n_slots, n_kv, _ = case.k_cache.shape
    return _C.ragged_attention_plan(*case.index_tensors(), n_tokens, n_slots, n_q, n_kv, d, case.q.dtype, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_plan_gives_the_same_result_for_every_layer(dtype, index_dtype):
    case = make_ragged_case(5, random_kinds(5, 9), 6, 2, 40, dtype, index_dtype=index_dtype, max_context=70)
    plan = plan_for(case)
    gen = torch.Generator().manual_seed(1)
    for layer in range(3):  # new queries and caches per layer, one plan
        q = torch.randn(case.q.shape, generator=gen).to(dtype)
        k = torch.randn(case.k_cache.shape, generator=gen).to(dtype)
        v = torch.randn(case.v_cache.shape, generator=gen).to(dtype)
        with_plan = _C.ragged_attention(q, k, v, *case.index_tensors(), 0.2, plan)
        assert torch.equal(with_plan, _C.ragged_attention(q, k, v, *case.index_tensors(), 0.2))
        expected = reference.ragged_attention(q.double(), k.double(), v.double(), *case.index_tensors(), 0.2)
        torch.testing.assert_close(with_plan.double(), expected, atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, msg=f"layer {layer}")


def test_plan_with_mixed_index_types():
    case = make_ragged_case(7, ["decode", "prefill", "prefix"], 4, 2, 16, torch.float32)
    idx = [case.q_start, case.q_len.long(), case.kv_start, case.kv_len.long()]
    plan = _C.ragged_attention_plan(*idx, case.q.shape[0], case.k_cache.shape[0], 4, 2, 16, torch.float32)
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *idx, 0.3, plan=plan)
    assert torch.equal(out, _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.3))


def test_plan_describes_itself():
    case = make_ragged_case(3, ["decode", "prefill"], 4, 2, 16, torch.float32)
    plan = plan_for(case, items_per_sm=7, decode_stages=3)
    assert (plan.n_tokens, plan.n_requests, plan.n_q_heads, plan.n_kv_heads, plan.head_dim) == \
        (case.q.shape[0], 2, 4, 2, 16)
    assert plan.n_slots == case.k_cache.shape[0] and plan.dtype == torch.float32
    assert plan.device == torch.device("cpu") and plan.nbytes == 0  # the CPU kernel needs no work list
    assert (plan.items_per_sm, plan.decode_stages) == (7, 3)
    assert "RaggedAttentionPlan(n_tokens=" in repr(plan)


def test_a_plan_for_another_call_is_refused():
    case = make_ragged_case(4, ["decode", "prefill", "prefix"], 4, 2, 16, torch.float32)
    plan = plan_for(case)
    q, k, v, idx = case.q, case.k_cache, case.v_cache, list(case.index_tensors())
    cases = [  # (q, k_cache, v_cache, index tensors), the message
        ((q, k, v, [idx[0].clone()] + idx[1:]), "built from another q_start tensor"),
        ((q, k, v, idx[:3] + [idx[3].clone()]), "built from another kv_len tensor"),
        ((torch.cat([q, q[:1]]), k, v, idx), f"built for n_tokens={q.shape[0]} but this call has {q.shape[0] + 1}"),
        ((q, torch.cat([k, k[:2]]), torch.cat([v, v[:2]]), idx), "built for n_slots="),
        ((q.repeat(1, 2, 1), k, v, idx), "built for n_q_heads=4 but this call has 8"),
        ((q, k[:, :1], v[:, :1], idx), "built for n_kv_heads=2 but this call has 1"),
        ((q, k, v, [t[:2] for t in idx]), "built for n_requests=3 but this call has 2"),
        ((q.bfloat16(), k.bfloat16(), v.bfloat16(), idx), "built for dtype Float but q has dtype BFloat16"),
    ]
    for (qq, kk, vv, ii), msg in cases:
        with pytest.raises(ValueError, match=msg):
            _C.ragged_attention(qq, kk, vv, *ii, 0.1, plan)


def test_plan_arguments_are_checked():
    case = make_ragged_case(2, ["decode", "prefill"], 4, 2, 16, torch.float32)
    idx = case.index_tensors()
    t, s = case.q.shape[0], case.k_cache.shape[0]
    bad = [
        (dict(items_per_sm=0), "items_per_sm must be in \\[1, 256\\], got 0"),
        (dict(items_per_sm=257), "items_per_sm"),
        (dict(decode_stages=1), "decode_stages must be 0"),
        (dict(decode_stages=4), "decode_stages"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            _C.ragged_attention_plan(*idx, t, s, 4, 2, 16, torch.float32, **kw)
    with pytest.raises(ValueError, match="dtype Half is not supported on cpu"):
        _C.ragged_attention_plan(*idx, t, s, 4, 2, 16, torch.float16)
    with pytest.raises(ValueError, match="n_tokens must be >= 0"):
        _C.ragged_attention_plan(*idx, -1, s, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        _C.ragged_attention_plan(*idx, t, s, 5, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        _C.ragged_attention_plan(*idx, t, s, 4, 2, 0, torch.float32)
    with pytest.raises(ValueError, match="kv_len has 1 entries but q_start has 2"):
        _C.ragged_attention_plan(idx[0], idx[1], idx[2], idx[3][:1], t, s, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="q_len must be a 1-D index tensor"):
        _C.ragged_attention_plan(idx[0], idx[1].view(2, 1), idx[2], idx[3], t, s, 4, 2, 16, torch.float32)


def test_ops_plan_uses_the_process_knobs(monkeypatch):
    case = make_ragged_case(6, ["decode"], 2, 1, 16, torch.float32)
    monkeypatch.setattr(ops, "ATTENTION_ITEMS_PER_SM", 5)
    monkeypatch.setattr(ops, "ATTENTION_DECODE_STAGES", 2)
    plan = ops.ragged_attention_plan(*case.index_tensors(), case.q.shape[0], case.k_cache.shape[0], 2, 1, 16,
                                     torch.float32)
    assert (plan.items_per_sm, plan.decode_stages) == (5, 2)


@pytest.mark.parametrize("raw,expected", [(None, 16), ("", 16), ("32", 32), ("1", 1), ("256", 256)])
def test_env_knob_parsing(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("ORCA_EXT_TEST_KNOB", raising=False)
    else:
        monkeypatch.setenv("ORCA_EXT_TEST_KNOB", raw)
    assert ops._env_int("ORCA_EXT_TEST_KNOB", 16, range(1, 257)) == expected


@pytest.mark.parametrize("raw,msg", [("0", "out of range"), ("x", "not an integer"), ("1", "out of range")])
def test_env_knob_errors_name_the_variable(monkeypatch, raw, msg):
    monkeypatch.setenv("ORCA_EXT_TEST_KNOB", raw)
    allowed = (0, 2, 3) if raw == "1" else range(1, 257)
    with pytest.raises(ValueError, match=f"ORCA_EXT_TEST_KNOB.*{msg}"):
        ops._env_int("ORCA_EXT_TEST_KNOB", 16, allowed)
