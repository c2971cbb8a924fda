"""Checks shared by the int8-activation quantized products of every format: the fused epilogues
against the unfused product (silu_mul on quant_linear's float32 sums, rmsnorm_qkv bit for bit
against quant_linear on the rows _C.rms_norm stores), and batch invariance (rows, tile edges)."""
from __future__ import annotations

import torch


def check_silu_mul_and_rmsnorm_qkv(_C, qweight: torch.Tensor, qtype: int, k: int, inter: int,
                                   x: torch.Tensor, gen: torch.Generator) -> None:
    """qweight: [2 * inter, row bytes] blocks of qtype; x [T, k] in the activation dtype."""
    dtype = x.dtype
    bias = (torch.randn(2 * inter, generator=gen) * 0.1).to(dtype)
    # silu_mul: the epilogue on the float32 sums of quant_linear (same activations, same sums)
    sums = _C.quant_linear(x.float(), qweight, qtype, k, None, None, int8_activations=True).double()
    sums = sums + bias.double()
    gate, up = sums[:, :inter], sums[:, inter:]
    ref = torch.nn.functional.silu(gate) * up
    got = _C.quant_linear_silu_mul(x, qweight, qtype, k, bias, int8_activations=True)
    tol = (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -20) * ref.abs() + 1e-6 * (gate.abs() * up.abs() + 1e-3)
    assert ((got.double() - ref).abs() <= tol).all(), float((got.double() - ref).abs().max())
    # rmsnorm_qkv: the same products on the rows _C.rms_norm stores (bit for bit)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    fused = _C.quant_rmsnorm_qkv(x, norm_weight, qweight, qtype, k, bias, 1e-6, int8_activations=True)
    unfused = _C.quant_linear(_C.rms_norm(x, norm_weight, 1e-6), qweight, qtype, k, bias, None,
                              int8_activations=True)
    assert torch.equal(fused, unfused)


def check_rows_batch_invariant(_C, w: torch.Tensor, wg: torch.Tensor, qtype: int, k: int,
                               big: torch.Tensor, gen: torch.Generator) -> None:
    """Each int8-activation product (linear, silu_mul with wg [2 * inter, ...], rmsnorm_qkv) of
    a slice of the rows big [T, k] equals the same rows of the product of all of them, bit for
    bit: a row's quantization and sums never depend on its batch-mates."""
    norm_weight = torch.rand(k, generator=gen) + 0.5
    full = _C.quant_linear(big, w, qtype, k, None, None, int8_activations=True)
    full_mlp = _C.quant_linear_silu_mul(big, wg, qtype, k, None, int8_activations=True)
    full_qkv = _C.quant_rmsnorm_qkv(big, norm_weight, w, qtype, k, None, 1e-5, int8_activations=True)
    t = big.shape[0]
    for lo, hi in [(0, 1), (13, 14), (5, 8), (20, 37), (t - 1, t)]:
        part = big[lo:hi]
        assert torch.equal(_C.quant_linear(part, w, qtype, k, None, None, int8_activations=True), full[lo:hi])
        assert torch.equal(_C.quant_linear_silu_mul(part, wg, qtype, k, None, int8_activations=True),
                           full_mlp[lo:hi])
        assert torch.equal(_C.quant_rmsnorm_qkv(part, norm_weight, w, qtype, k, None, 1e-5,
                                                int8_activations=True), full_qkv[lo:hi])


# Token counts that cross every tile edge of the int8 products: prefill takes tokens 8 (or 4) at a
# time and rows 2 at a time, a single token takes 4 rows in natural order.
TILE_EDGE_TOKENS = list(range(2, 20)) + [28, 33, 37]


def check_lone_bits_at_tile_edges(_C, w: torch.Tensor, qtype: int, k: int, x: torch.Tensor,
                                  name: str) -> torch.Tensor:
    """For every T of TILE_EDGE_TOKENS (x holds at least the largest), each token's int8-activation
    outputs of x[:T] are the bits of that token alone. Returns the lone outputs [T, N]."""
    alone = torch.cat([_C.quant_linear(x[t:t + 1], w, qtype, k, None, None, int8_activations=True)
                       for t in range(x.shape[0])])
    for t in TILE_EDGE_TOKENS:
        got = _C.quant_linear(x[:t], w, qtype, k, None, None, int8_activations=True)
        assert torch.equal(got, alone[:t]), f"{name} T={t}"
    return alone
