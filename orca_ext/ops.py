"""Device dispatch of the kernels: the compiled `orca_ext._C` when it is built, else the
pure-torch references (slow, but the package stays usable without a compiler).

Each function takes and returns torch tensors; `_C` itself checks shapes, dtypes and devices and
dispatches CPU tensors to csrc/cpu and CUDA tensors to csrc/cuda (glue in csrc/torch).
"""
from __future__ import annotations

import logging

import torch

from . import reference

log = logging.getLogger(__name__)

try:
    from . import _C  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - exercised only without a build
    _C = None
    log.warning("orca_ext._C is not built (%s); using the slow pure-torch reference ops", exc)

HAVE_EXTENSION = _C is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, H]."""
    if _C is None:
        return reference.rms_norm(x, weight, eps)
    return _C.rms_norm(x, weight, eps)


def rmsnorm_qkv(x, norm_weight, qkv_weight, qkv_bias, eps: float, batch_invariant: bool = False) -> torch.Tensor:
    """[T, H] -> [T, Nq*D + 2*Nkv*D]. batch_invariant: one code path for every T."""
    if _C is None:
        return reference.rmsnorm_qkv(x, norm_weight, qkv_weight, qkv_bias, eps)
    return _C.rmsnorm_qkv(x, norm_weight, qkv_weight, qkv_bias, eps, batch_invariant)


def linear(x, weight, bias, batch_invariant: bool = False) -> torch.Tensor:
    """[T, K] -> [T, N] = x W^T + b. With batch_invariant each row's result depends only on that
    row (`_C.linear`); otherwise ATen's GEMM, whose blocking and reduction order change with T."""
    if not batch_invariant or _C is None:
        return torch.nn.functional.linear(x, weight, bias)
    return _C.linear(x, weight, bias)


def silu_mul(gate_up: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """[T, 2I] -> [T, I] = silu(gate) * up. ATen's CPU silu rounds an element differently
    depending on where T puts the thread and vector boundaries, hence `_C.silu_mul` when
    batch_invariant."""
    n = gate_up.shape[-1] // 2
    if not batch_invariant or _C is None:
        return torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    return _C.silu_mul(gate_up)


def slab_write(k_cache, v_cache, k, v, slots) -> None:
    """k_cache[slots[t]] = k[t]; v_cache[slots[t]] = v[t]."""
    if _C is None:
        return reference.slab_write(k_cache, v_cache, k, v, slots)
    _C.slab_write(k_cache, v_cache, k, v, slots)


def ragged_attention(q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, scale: float,
                     batch_invariant: bool = False):
    """q [T, Hq, D] -> [T, Hq, D]; see docs/DESIGN.md section 4. batch_invariant: each row's
    arithmetic depends only on its own request's context."""
    if _C is None:
        return reference.ragged_attention(q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, scale)
    return _C.ragged_attention(q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, scale, batch_invariant)


def slab_move(pools: torch.Tensor, moves: torch.Tensor) -> None:
    """pools [P, S, ...] (every layer's K and V pool, contiguous); moves [M, 3] int64 on the CPU,
    rows (src, dst, n): rows [src, src+n) of every pool go to [dst, dst+n), move after move,
    each as if through a temporary (the two ranges may overlap)."""
    if _C is None:
        return reference.slab_move(pools, moves.tolist())
    _C.slab_move(pools, moves)
