"""Every bad input to the kernels raises ValueError (or RuntimeError) with a message naming the
problem; none of them crashes the process or touches memory out of bounds."""
from __future__ import annotations

import pytest
import torch

_C = pytest.importorskip("orca_ext._C")


def qkv_args(**over):
    args = dict(x=torch.randn(5, 32), norm_weight=torch.randn(32), qkv_weight=torch.randn(48, 32),
                qkv_bias=None, eps=1e-6)
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(x=torch.randn(32)), "x must be 2-D"),
    (dict(norm_weight=torch.randn(31)), "norm_weight has 31 elements"),
    (dict(qkv_weight=torch.randn(48, 33)), "qkv_weight has 33 columns"),
    (dict(qkv_weight=torch.randn(48)), "qkv_weight must be 2-D"),
    (dict(qkv_bias=torch.randn(47)), "qkv_bias has 47 elements"),
    (dict(x=torch.randn(5, 32, dtype=torch.float64)), "only float32 and bfloat16"),
    (dict(x=torch.randn(5, 32).half()), "only float32 and bfloat16"),
    (dict(norm_weight=torch.randn(32).bfloat16()), "norm_weight has dtype"),
    (dict(eps=0.0), "eps must be finite and > 0"),
    (dict(eps=float("nan")), "eps must be finite"),
])
def test_rmsnorm_qkv_bad_input(over, match):
    with pytest.raises(ValueError, match=match):
        _C.rmsnorm_qkv(**qkv_args(**over))


def test_rms_norm_bad_input():
    with pytest.raises(ValueError, match="weight has 3 elements"):
        _C.rms_norm(torch.randn(2, 4), torch.randn(3), 1e-6)
    with pytest.raises(ValueError, match="x must be 2-D"):
        _C.rms_norm(torch.randn(2, 4, 1), torch.randn(4), 1e-6)


def slab_args(**over):
    args = dict(k_cache=torch.zeros(10, 2, 8), v_cache=torch.zeros(10, 2, 8), k=torch.randn(3, 2, 8),
                v=torch.randn(3, 2, 8), slots=torch.tensor([0, 4, 9], dtype=torch.int32))
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(slots=torch.tensor([0, 4, 10])), "slots contains 10, outside the cache of 10 slots"),
    (dict(slots=torch.tensor([0, -1, 3])), "slots contains -1"),
    (dict(slots=torch.tensor([0, 4])), "slots has 2 entries but k has 3 rows"),
    (dict(slots=torch.tensor([0.0, 1.0, 2.0])), "slots must be int32 or int64"),
    (dict(slots=torch.tensor([[0, 1, 2]])), "slots must be a 1-D"),
    (dict(k=torch.randn(3, 2, 7), v=torch.randn(3, 2, 7)), "Hkv and D must match"),
    (dict(v=torch.randn(3, 2, 9)), "v shape"),
    (dict(v_cache=torch.zeros(11, 2, 8)), "v_cache shape"),
    (dict(k_cache=torch.zeros(10, 16)), "k_cache must be 3-D"),
    (dict(k=torch.randn(3, 2, 8).bfloat16()), "k has dtype"),
    (dict(k_cache=torch.zeros(8, 2, 10).permute(2, 1, 0)), "must be contiguous"),
])
def test_slab_write_bad_input(over, match):
    args = slab_args(**over)
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=match):
        _C.slab_write(**args)
    assert torch.equal(args["k_cache"], before)  # nothing was written


def attn_args(**over):
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    args = dict(q=torch.randn(4, 4, 16), k_cache=torch.randn(20, 2, 16), v_cache=torch.randn(20, 2, 16),
                q_start=i32([0, 1]), q_len=i32([1, 3]), kv_start=i32([0, 10]), kv_len=i32([5, 3]), scale=0.25)
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(q=torch.randn(4, 64)), "q must be 3-D"),
    (dict(q=torch.randn(4, 4, 32)), "q has head dim 32 but k_cache has 16"),
    (dict(q=torch.randn(4, 3, 16)), r"q heads \(3\) must be a multiple of k_cache heads \(2\)"),
    (dict(v_cache=torch.randn(20, 2, 8)), "v_cache shape"),
    (dict(q_len=torch.tensor([1, 3, 1], dtype=torch.int32)), "q_len has 3 entries but q_start has 2"),
    (dict(kv_len=torch.tensor([5], dtype=torch.int32)), "kv_len has 1 entries"),
    (dict(kv_start=torch.tensor([0, 18], dtype=torch.int32)), r"context slots \[18, 21\) fall outside the cache of 20"),
    (dict(kv_start=torch.tensor([-1, 10], dtype=torch.int32)), "context slots"),
    (dict(q_start=torch.tensor([0, 2], dtype=torch.int32)), r"query rows \[2, 5\) fall outside q's 4 rows"),
    (dict(kv_len=torch.tensor([5, 2], dtype=torch.int32)), "need 0 <= q_len <= kv_len"),
    (dict(q_len=torch.tensor([-1, 3], dtype=torch.int32)), "need 0 <= q_len"),
    (dict(q_start=torch.tensor([0.0, 1.0])), "q_start must be int32 or int64"),
    (dict(q=torch.randn(4, 4, 16).bfloat16()), "k_cache has dtype"),
    (dict(q=torch.randn(4, 4, 16).double(), k_cache=torch.randn(20, 2, 16).double(),
          v_cache=torch.randn(20, 2, 16).double()), "only float32 and bfloat16"),
    (dict(scale=float("inf")), "scale must be finite"),
])
def test_ragged_attention_bad_input(over, match):
    with pytest.raises(ValueError, match=match):
        _C.ragged_attention(**attn_args(**over))


def test_built_with_cuda_matches_the_torch_it_was_built_against():
    """A CPU-only torch has no CUDA glue to link, so the CUDA dispatch cannot be compiled in."""
    assert isinstance(_C.built_with_cuda(), bool)
    if torch.version.cuda is None:
        assert not _C.built_with_cuda()


def test_cuda_tensor_without_cuda_build_is_a_clear_error():
    if _C.built_with_cuda() or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and a CPU-only build of the extension")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        _C.rms_norm(torch.randn(2, 4, device="cuda"), torch.randn(4, device="cuda"), 1e-6)


def test_mixed_devices_rejected():
    # A meta tensor stands in for "another device" on a CPU-only machine.
    with pytest.raises(ValueError, match="meta"):
        _C.rms_norm(torch.randn(2, 4), torch.empty(4, device="meta"), 1e-6)


@pytest.mark.parametrize("pools,moves,match", [
    (torch.zeros(4, 10, 2), torch.tensor([[0, 5, 6]]), r"moves\[0\] = \(0, 5, 6\) reaches outside the 10 slots"),
    (torch.zeros(4, 10, 2), torch.tensor([[0, 1, 2], [-1, 0, 1]]), r"moves\[1\] = \(-1, 0, 1\)"),
    (torch.zeros(4, 10, 2), torch.tensor([[0, 1, -2]]), r"moves\[0\]"),
    (torch.zeros(4, 10, 2), torch.tensor([[0, 1]]), r"moves must be \[M, 3\]"),
    (torch.zeros(4, 10, 2), torch.tensor([[0, 1, 2]], dtype=torch.int32), "moves must be int64"),
    (torch.zeros(4, 10, 2).transpose(0, 1), torch.tensor([[0, 1, 2]]), "pools must be contiguous"),
    (torch.zeros(10), torch.tensor([[0, 1, 2]]), "at least 2-D"),
])
def test_slab_move_bad_input(pools, moves, match):
    before = pools.clone()
    with pytest.raises(ValueError, match=match):
        _C.slab_move(pools, moves)
    assert torch.equal(pools, before)  # a rejected call moves nothing


def test_linear_and_linear_silu_mul_bad_input():
    with pytest.raises(ValueError, match="weight has 7 columns but x has 8"):
        _C.linear(torch.randn(3, 8), torch.randn(5, 7), None)
    with pytest.raises(ValueError, match="bias has 4 elements but weight has 5 rows"):
        _C.linear(torch.randn(3, 8), torch.randn(5, 8), torch.randn(4))
    with pytest.raises(ValueError, match="weight has dtype"):
        _C.linear(torch.randn(3, 8), torch.randn(5, 8).bfloat16(), None)
    with pytest.raises(ValueError, match=r"gate_up_weight has 7 rows; it must stack I gate rows on I up rows"):
        _C.linear_silu_mul(torch.randn(3, 8), torch.randn(7, 8), None, batch_invariant=True)
