"""The ggml block formats and the products of quantized weights.

`orca_ext.quant.formats.dequantize` against the `gguf` package's own dequantizer (bit for bit)
in every served format, and so the C++ dequantizers built for baseline x86-64 (no AVX2);
QuantizedWeight/QuantizedStack shapes, shards and errors; and the quantized linear /
linear_silu_mul / rmsnorm_qkv / embedding (the compiled kernels when built, else the fallback)
against float64 references on the dequantized blocks at awkward sizes, with each row's result
independent of the rows beside it.
"""
from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from orca_ext import modes, ops
from orca_ext.quant import FORMATS, QType, QuantizedStack, QuantizedWeight, block_format, dequantize, stack_rows

from gguf_models import random_blocks

ALL = list(FORMATS)


def blocks(qtype: QType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(random_blocks(gguf.GGMLQuantizationType(int(qtype)), n, k, rng))


def qweight(qtype: QType, n: int, blocks_per_row: int, seed: int = 0) -> QuantizedWeight:
    k = blocks_per_row * block_format(qtype).block_size
    return QuantizedWeight(qtype, blocks(qtype, n, k, seed), n, k)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_dequantize_matches_gguf_bit_for_bit(qtype):
    n, k = 13, 3 * block_format(qtype).block_size
    data = blocks(qtype, n, k, seed=int(qtype))
    ours = dequantize(data, qtype, k)
    theirs = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(int(qtype)))
    assert ours.dtype == torch.float32 and ours.shape == (n, k)
    assert np.array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1], ids=lambda q: q.name)
def test_dequantize_of_gguf_quantized_floats(qtype):
    w = np.random.default_rng(1).standard_normal((7, 160)).astype(np.float32)
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(qtype)))
    ours = dequantize(torch.from_numpy(data), qtype, 160).numpy()
    assert np.array_equal(ours, gguf.quants.dequantize(data, gguf.GGMLQuantizationType(int(qtype))))
    assert np.abs(ours - w).max() < 0.5  # the blocks do encode w


def test_formats_reject_bad_input():
    with pytest.raises(ValueError, match="not a served block format"):
        block_format(10)  # Q2_K
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), QType.Q4_0, 33)
    with pytest.raises(ValueError, match="take 36 bytes"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), QType.Q4_0, 64)
    with pytest.raises(ValueError, match="needs uint8 data"):
        QuantizedWeight(QType.Q8_0, torch.zeros(3, 33, dtype=torch.uint8), 3, 32)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_shards_are_the_dequantized_shards(qtype):
    w = qweight(qtype, 9, 3)
    full = w.dequantize()
    b = w.block_size
    assert torch.equal(w.rows(2, 7).dequantize(), full[2:7])
    assert torch.equal(w.columns(b, 3 * b).dequantize(), full[:, b:3 * b])
    with pytest.raises(ValueError, match="block boundaries"):
        w.columns(1, b)


def test_stack_rows_merges_equal_formats_and_stacks_mixed_ones():
    a, b, c = qweight(QType.Q4_K, 5, 1, 1), qweight(QType.Q4_K, 3, 1, 2), qweight(QType.Q6_K, 4, 1, 3)
    same = stack_rows([a, b])
    assert isinstance(same, QuantizedWeight) and same.shape == (8, 256)
    mixed = stack_rows([a, b, c])
    assert isinstance(mixed, QuantizedStack) and mixed.shape == (12, 256)
    assert [p.qtype for p in mixed.parts] == [QType.Q4_K, QType.Q6_K]
    assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), b.dequantize(), c.dequantize()]))
    assert mixed.nbytes == a.nbytes + b.nbytes + c.nbytes
    with pytest.raises(ValueError, match="share k"):
        stack_rows([a, qweight(QType.Q4_K, 2, 2)])


def _ref_linear(x, w, bias=None, residual=None):
    out = x.double() @ w.dequantize().double().T
    if bias is not None:
        out = out + bias.double()
    if residual is not None:
        out = out + residual.double()
    return out


def _close(ours, ref):
    scale = ref.abs().max().item() + 1e-6
    assert (ours.double() - ref).abs().max().item() <= 2e-5 * scale


# Awkward sizes: N not a multiple of anything, T from 1 to a prefill chunk.
CASES = [(QType.Q8_0, 37, 3), (QType.Q4_0, 29, 5), (QType.Q4_1, 41, 2), (QType.Q4_K, 19, 2), (QType.Q6_K, 23, 1)]


@pytest.mark.parametrize("qtype,n,bpr", CASES, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("t", [1, 3, 17])
def test_quantized_linear_matches_float64(qtype, n, bpr, t):
    w = qweight(qtype, n, bpr, seed=t)
    x = torch.randn(t, w.k)
    bias, residual = torch.randn(n), torch.randn(t, n)
    _close(ops.linear(x, w), _ref_linear(x, w))
    _close(ops.linear(x, w, bias, residual), _ref_linear(x, w, bias, residual))


@pytest.mark.parametrize("qtype,n,bpr", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_quantized_linear_silu_mul_and_rmsnorm_qkv_match_float64(qtype, n, bpr):
    t = 7
    w = qweight(qtype, 2 * n, bpr)
    x = torch.randn(t, w.k)
    bias = torch.randn(2 * n)
    gate, up = _ref_linear(x, w, bias).chunk(2, dim=-1)
    _close(ops.linear_silu_mul(x, w, bias), torch.nn.functional.silu(gate) * up)
    norm_w = 1 + 0.3 * torch.randn(w.k)
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()).float()
    _close(ops.rmsnorm_qkv(x, norm_w, w, bias, 1e-6), _ref_linear(normed, w, bias))


def test_stack_products_are_the_concatenated_parts():
    parts = [qweight(QType.Q4_K, 6, 1, 1), qweight(QType.Q6_K, 4, 1, 2), qweight(QType.Q4_K, 2, 1, 3)]
    w = stack_rows(parts)
    assert isinstance(w, QuantizedStack)
    x, bias, residual = torch.randn(5, 256), torch.randn(12), torch.randn(5, 12)
    ref = torch.cat([_ref_linear(x, p) for p in parts], dim=-1) + bias.double()
    _close(ops.linear(x, w, bias), ref)
    _close(ops.linear(x, w, bias, residual), ref + residual.double())
    gate, up = ref.chunk(2, dim=-1)
    _close(ops.linear_silu_mul(x, w, bias), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_quantized_embedding_decodes_the_rows(qtype):
    w = qweight(qtype, 50, 2)
    ids = torch.tensor([3, 49, 0, 3, 17])
    assert torch.equal(ops.embedding(ids, w, torch.float32), w.dequantize()[ids])
    assert torch.equal(ops.embedding(ids, w, torch.bfloat16), w.dequantize()[ids].to(torch.bfloat16))


@pytest.mark.parametrize("qtype,n,bpr", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_a_rows_result_does_not_depend_on_its_batch_mates(qtype, n, bpr):
    w = qweight(qtype, 2 * n, bpr)
    norm_w = torch.rand(w.k) + 0.5
    x = torch.randn(19, w.k)
    with modes.using(batch_invariant=True):
        for op in (lambda a: ops.linear(a, w), lambda a: ops.linear_silu_mul(a, w),
                   lambda a: ops.rmsnorm_qkv(a, norm_w, w, None, 1e-6)):
            whole = op(x)
            for lo, hi in ((0, 1), (5, 6), (3, 12), (18, 19)):
                assert torch.equal(op(x[lo:hi]), whole[lo:hi])


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_K], ids=lambda q: q.name)
def test_bfloat16_activations(qtype):
    w = qweight(qtype, 24, 2)
    x = torch.randn(5, w.k).to(torch.bfloat16)
    out = ops.linear(x, w)
    assert out.dtype == torch.bfloat16
    ref = x.double() @ w.dequantize().to(torch.bfloat16).double().T  # the weights in the activation dtype
    assert (out.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


# -- the portable dequantizers ----------------------------------------------------------------------

_PORTABLE_SHIM = r"""
#include "cpu/quant_formats.h"
using namespace orca::cpu::detail;
// Row `row` of k elements of ggml type t, dequantized unit by unit as the panels do; false for a
// type the kernels do not take.
extern "C" bool dequantize_row(int t, const uint8_t* row, int64_t k, float* out) {
  bool known = false;
  dispatch_quant_format(t, [&](auto q) {
    constexpr int F = decltype(q)::value;
    for (int64_t u = 0; u < k / kDequantUnit<F>; ++u) dequant_unit<F>(row, u, out + u * kDequantUnit<F>);
    known = true;
  });
  return known;
}
"""


@pytest.fixture(scope="module")
def portable_dequantize(tmp_path_factory):
    """csrc/cpu/quant_formats.h built for baseline x86-64 (no AVX2): the plain loops that targets
    without AVX2 compile, which the extension built here never runs."""
    gxx = shutil.which("g++")
    if gxx is None or platform.machine() != "x86_64":
        pytest.skip("needs g++ on x86-64 to build the baseline dequantizers")
    folder = tmp_path_factory.mktemp("portable_dequantize")
    (folder / "shim.cpp").write_text(_PORTABLE_SHIM)
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    subprocess.run([gxx, "-std=c++17", "-O1", "-march=x86-64", "-ffp-contract=off", "-shared", "-fPIC",
                    f"-I{csrc}", str(folder / "shim.cpp"), "-o", str(folder / "shim.so")],
                   check=True, capture_output=True, timeout=120)
    fn = ctypes.CDLL(str(folder / "shim.so")).dequantize_row
    fn.restype = ctypes.c_bool
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return fn


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_portable_dequantizers_read_every_format_as_gguf(portable_dequantize, qtype):
    k = 3 * block_format(qtype).block_size
    data = np.ascontiguousarray(blocks(qtype, 5, k, seed=int(qtype) + 100).numpy())
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(int(qtype)))
    for row in range(data.shape[0]):
        ours = np.zeros(k, dtype=np.float32)
        assert portable_dequantize(int(qtype), data[row].ctypes.data, k, ours.ctypes.data)
        assert np.array_equal(ours, theirs[row]), f"{qtype.name} row {row}"
    assert not portable_dequantize(10, data[0].ctypes.data, k, np.zeros(k, dtype=np.float32).ctypes.data)
