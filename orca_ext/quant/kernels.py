"""The products of quantized weights: the compiled `_C.quant_*` kernels, else (a format they do
not take, or no extension built) the fallback below (dequantize the matrix, then the float
kernel on it).

    quant_linear(x, qweight, qtype, k, bias, residual, batch_invariant)       -> [T, N]
    quant_linear_silu_mul(x, qweight, qtype, k, bias, batch_invariant)        -> [T, I]
    quant_rmsnorm_qkv(x, norm_weight, qweight, qtype, k, bias, eps, batch_invariant) -> [T, N]
    quant_embedding(qweight, qtype, k, token_ids, dtype)                      -> [T, K]

The compiled CPU products of the formats in `_C.quant_int8_types()` (every compiled format on
AVX2 CPUs) take int8-quantized activations where the process-wide mode `quant_activations`
(modes.py), read at each call, says so for the weight's format (formats.int8_activations: "int8"
for every format, "auto" for Q4_K, Q5_K and Q6_K); the mode changes nothing for the fallback or CUDA.

`qweight` is QuantizedWeight.data (uint8 [N, row_bytes]); a format the compiled kernels do not
list in `_C.quant_types()` takes the fallback. The fallback's result is exactly the
float path's on the dequantized matrix (the same float kernel on the same numbers), so it is as
batch-invariant as that kernel; it costs a float copy of each matrix per call and serves for
tests and machines without the compiled kernels.

A QuantizedStack (weight.py) runs each part with its own format's kernel and concatenates the
outputs; its norm (rmsnorm_qkv) and activation (linear_silu_mul) run once on the whole.
"""
from __future__ import annotations

import torch

from .. import modes, reference
from .formats import int8_activations
from .weight import QuantizedStack, QuantizedWeight

try:
    from .. import _C  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised only without a build
    _C = None

# The formats the compiled kernels take (_C.quant_types()); others use the fallback.
KERNEL_TYPES = frozenset(int(t) for t in _C.quant_types()) if _C is not None else frozenset()


def compiled(w: QuantizedWeight) -> bool:
    """Whether w's products run in the compiled kernels (else the fallback)."""
    return int(w.qtype) in KERNEL_TYPES

Weight = QuantizedWeight | QuantizedStack


def linear(x: torch.Tensor, w: Weight, bias=None, residual=None, batch_invariant: bool = False) -> torch.Tensor:
    """[T, K] -> [T, N] = x W^T + bias (+ residual)."""
    if isinstance(w, QuantizedStack):
        out = _stacked(x, w, bias, batch_invariant)
        return out if residual is None else (out.float() + residual.float()).to(x.dtype)
    if compiled(w):
        return _C.quant_linear(x, w.data, int(w.qtype), w.k, bias, residual, batch_invariant, _int8(w))
    return _float_linear(x, w.dequantize(x.dtype), bias, residual, batch_invariant)


def linear_silu_mul(x: torch.Tensor, w: Weight, bias=None, batch_invariant: bool = False) -> torch.Tensor:
    """[T, K] -> [T, I] = silu(gate) * up of the fused [2I, K] gate_up matrix."""
    if isinstance(w, QuantizedStack):
        gate, up = _stacked(x, w, bias, batch_invariant).float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).to(x.dtype)
    if compiled(w):
        return _C.quant_linear_silu_mul(x, w.data, int(w.qtype), w.k, bias, batch_invariant, _int8(w))
    weight = w.dequantize(x.dtype)
    if _C is None:
        return reference.linear_silu_mul(x, weight, bias)
    return _C.linear_silu_mul(x, weight, bias, batch_invariant)


def rmsnorm_qkv(x: torch.Tensor, norm_weight: torch.Tensor, w: Weight, bias, eps: float,
                batch_invariant: bool = False) -> torch.Tensor:
    """[T, H] -> [T, N] = linear(rms_norm(x) * norm_weight, W, bias), the normed rows rounded to
    x's dtype first."""
    if isinstance(w, QuantizedStack):
        return _stacked(_rms_norm(x, norm_weight, eps), w, bias, batch_invariant)
    if compiled(w):
        return _C.quant_rmsnorm_qkv(x, norm_weight, w.data, int(w.qtype), w.k, bias, eps, batch_invariant,
                                    _int8(w))
    weight = w.dequantize(x.dtype)
    if _C is None:
        return reference.rmsnorm_qkv(x, norm_weight, weight, bias, eps)
    return _C.rmsnorm_qkv(x, norm_weight, weight, bias, eps, batch_invariant)


def embedding(w: QuantizedWeight, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `token_ids` [T] of the [V, H] matrix -> [T, H] in `dtype` (only those rows decoded)."""
    if compiled(w):
        return _C.quant_embedding(w.data, int(w.qtype), w.k, token_ids, dtype)
    return QuantizedWeight(w.qtype, w.data[token_ids.long()], token_ids.numel(), w.k).dequantize(dtype)


def _int8(w: QuantizedWeight) -> bool:
    return int8_activations(modes.current().quant_activations, w.qtype)


def _float_linear(x, weight, bias, residual, batch_invariant: bool) -> torch.Tensor:
    if _C is None:
        return reference.linear(x, weight, bias, residual)
    return _C.linear(x, weight, bias, residual, batch_invariant)


def _rms_norm(x, weight, eps: float) -> torch.Tensor:
    if _C is None:
        return reference.rms_norm(x, weight, eps)
    return _C.rms_norm(x, weight, eps)


def _stacked(x, w: QuantizedStack, bias, batch_invariant: bool) -> torch.Tensor:
    """Each part's product (with its rows of the bias), side by side: [T, N]."""
    outs, row = [], 0
    for part in w.parts:
        part_bias = None if bias is None else bias[row:row + part.n]
        outs.append(linear(x, part, part_bias, None, batch_invariant))
        row += part.n
    return torch.cat(outs, dim=-1)
