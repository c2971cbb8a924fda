"""Device dispatch of the kernels: the compiled `orca_ext._C` when it is built, else the
pure-torch references (slow, but the package stays usable without a compiler).

Each function takes and returns torch tensors; `_C` itself checks shapes, dtypes and devices and
dispatches CPU tensors to csrc/cpu and CUDA tensors to csrc/cuda (glue in csrc/torch).

The projections and the attention read the process's kernel modes (orca_ext/modes.py) at each
call: with `modes.current().batch_invariant` they take their one T-independent code path (the
`_C` functions take it as their own `batch_invariant` argument). Modes change only between
forwards, so every op of one forward runs in the same ones.

The runtime knobs of the CUDA attention (see RaggedAttentionTuning in csrc/cuda/launchers.h) can
be set for a whole process from the environment, e.g. to compare settings in the engine benchmark:
  ORCA_EXT_ATTENTION_ITEMS_PER_SM   decode work items per SM, 1..256 (default 16)
  ORCA_EXT_ATTENTION_DECODE_STAGES  0 = the shared kernel (default); 2 or 3 = the decode kernel
"""
from __future__ import annotations

import logging
import os

import torch

from . import modes, reference
from .quant import kernels as quant_kernels
from .quant.weight import Quantized

log = logging.getLogger(__name__)

try:
    from . import _C  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - exercised only without a build
    _C = None
    log.warning("orca_ext._C is not built (%s); using the slow pure-torch reference ops", exc)

HAVE_EXTENSION = _C is not None


def _env_int(name: str, default: int, allowed: range | tuple) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer") from None
    if value not in allowed:
        raise ValueError(f"${name}={value} is out of range; allowed: {allowed}")
    return value


ATTENTION_ITEMS_PER_SM = _env_int("ORCA_EXT_ATTENTION_ITEMS_PER_SM", 16, range(1, 257))
ATTENTION_DECODE_STAGES = _env_int("ORCA_EXT_ATTENTION_DECODE_STAGES", 0, (0, 2, 3))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, H]."""
    if _C is None:
        return reference.rms_norm(x, weight, eps)
    return _C.rms_norm(x, weight, eps)


def rmsnorm_qkv(x, norm_weight, qkv_weight, qkv_bias, eps: float) -> torch.Tensor:
    """[T, H] -> [T, Nq*D + 2*Nkv*D]. Batch-invariant mode: one T-independent code path (CPU: our
    kernel at every T, as by default; CUDA: no fused decode kernel, fixed-chunk cuBLAS).
    A quantized `qkv_weight` (orca_ext/quant) goes to its kernels, in the same modes."""
    if isinstance(qkv_weight, Quantized):
        return quant_kernels.rmsnorm_qkv(x, norm_weight, qkv_weight, qkv_bias, eps, modes.current().batch_invariant)
    if _C is None:
        return reference.rmsnorm_qkv(x, norm_weight, qkv_weight, qkv_bias, eps)
    return _C.rmsnorm_qkv(x, norm_weight, qkv_weight, qkv_bias, eps, modes.current().batch_invariant)


def linear(x, weight, bias=None, residual=None) -> torch.Tensor:
    """[T, K] -> [T, N] = x W^T + bias (+ residual, added before the one rounding).
    Batch-invariant mode: each row's result depends only on that row (CPU: our kernels at every T;
    CUDA: cuBLAS on fixed-shape row chunks). A quantized `weight` goes to its kernels."""
    if isinstance(weight, Quantized):
        return quant_kernels.linear(x, weight, bias, residual, modes.current().batch_invariant)
    if _C is None:
        return reference.linear(x, weight, bias, residual)
    return _C.linear(x, weight, bias, residual, modes.current().batch_invariant)


def linear_silu_mul(x, gate_up_weight, gate_up_bias=None) -> torch.Tensor:
    """[T, K] -> [T, I] = silu(gate) * up of the fused gate_up projection [2I, K]. Batch-invariant
    mode: as in linear. A quantized weight goes to its kernels."""
    if isinstance(gate_up_weight, Quantized):
        return quant_kernels.linear_silu_mul(x, gate_up_weight, gate_up_bias, modes.current().batch_invariant)
    if _C is None:
        return reference.linear_silu_mul(x, gate_up_weight, gate_up_bias)
    return _C.linear_silu_mul(x, gate_up_weight, gate_up_bias, modes.current().batch_invariant)


def embedding(token_ids: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `token_ids` [T] of the [V, H] embedding -> [T, H] in `dtype`; a quantized embedding
    decodes only those rows (orca_ext/quant)."""
    if isinstance(weight, Quantized):
        return quant_kernels.embedding(weight, token_ids, dtype)
    return torch.nn.functional.embedding(token_ids, weight)


def slab_write(k_cache, v_cache, k, v, slots) -> None:
    """k_cache[slots[t]] = k[t]; v_cache[slots[t]] = v[t]."""
    if _C is None:
        return reference.slab_write(k_cache, v_cache, k, v, slots)
    _C.slab_write(k_cache, v_cache, k, v, slots)


def row_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, V] float32 -> (index [R] int64, value [R]): each row's maximum and the first column
    holding it (a row with a NaN: NaN). One CPU kernel call; after a forward has streamed the
    weights through the caches, ATen's max(dim) and the ops around it start cold and cost several
    times more. Other devices use torch.max."""
    if _C is None or not x.is_cpu:
        value, index = x.max(dim=-1)
        return index, value
    return _C.row_argmax(x)


def rope_slab_write(qkv, cos, sin, k_cache, v_cache, slots, n_q_heads: int, n_kv_heads: int) -> torch.Tensor:
    """qkv [T, (Hq + 2*Hkv) * D] -> rotated q [T, Hq, D]; rotated k and v go to the caches at
    slots[t]. cos/sin [T, D/2] float32 (each token's position). The CPU kernel is bit-identical
    to rope then slab_write; there is no CUDA kernel, so other devices run that pair of steps."""
    if _C is None or not qkv.is_cpu:
        return reference.rope_slab_write(qkv, cos, sin, k_cache, v_cache, slots, n_q_heads, n_kv_heads)
    return _C.rope_slab_write(qkv, cos, sin, k_cache, v_cache, slots, n_q_heads, n_kv_heads)


def ragged_attention_plan(q_start, q_len, kv_start, kv_len, n_tokens: int, n_slots: int, n_q_heads: int,
                          n_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """The attention work list of one set of [B] index tensors, for every layer that shares them
    (None without the extension: the references need no plan). Batch-invariant mode: a work list
    without decode splits (each row depends only on its own request's kv_len); it runs on the
    shared kernel, so ATTENTION_DECODE_STAGES is not used with it."""
    if _C is None:
        return None
    invariant = modes.current().batch_invariant
    return _C.ragged_attention_plan(q_start, q_len, kv_start, kv_len, n_tokens, n_slots, n_q_heads, n_kv_heads,
                                    head_dim, dtype, ATTENTION_ITEMS_PER_SM,
                                    0 if invariant else ATTENTION_DECODE_STAGES, invariant)


def ragged_attention(q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, scale: float, plan=None):
    """q [T, Hq, D] -> [T, Hq, D]; see docs/DESIGN.md section 4. `plan`: from ragged_attention_plan
    over these index tensors in the same modes, or None (`_C` raises ValueError for a plan built
    in the other batch-invariant mode). Batch-invariant mode: each row's arithmetic depends only
    on its own request's context."""
    if _C is None:
        return reference.ragged_attention(q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, scale)
    return _C.ragged_attention(q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, scale, plan,
                               modes.current().batch_invariant)


def slab_move(pools: torch.Tensor, moves: torch.Tensor) -> None:
    """pools [P, S, ...] (every layer's K and V pool, contiguous); moves [M, 3] int64 on the CPU,
    rows (src, dst, n): rows [src, src+n) of every pool go to [dst, dst+n), move after move,
    each as if through a temporary (the two ranges may overlap)."""
    if _C is None:
        return reference.slab_move(pools, moves.tolist())
    _C.slab_move(pools, moves)
