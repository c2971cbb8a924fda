"""The CUDA quantized-weight kernels (quant_linear, quant_linear_silu_mul, quant_embedding) against
float64 references on blocks dequantized by `gguf.quants.dequantize` (the independent reader of the
ggml layouts), for every format the kernels serve: random valid blocks (every quant value, signed
scales), awkward sizes (N not a multiple of the 32-row tile, K an odd number of blocks, T = 1, 3,
8, 17, 300), bf16, fp16 and float32 activations; batch invariance bit for bit; misaligned views.

The block decoding (csrc/cuda/quant/quant_blocks.cuh) is also checked without a GPU: its host side,
built by nvcc with the device's wide-load path switched on, against gguf bit for bit, from every
byte alignment.

Tolerances are error bounds, not guesses. The kernels dequantize in float32 exactly as gguf does,
round each weight once to the activation type for the tensor cores (relative error <= u = 2^-8
bf16, 2^-11 fp16, plus 2^-25 absolute below fp16's normal range), accumulate in float32 and round
the output once (<= u relative). So per output |out - ref| <= u * sum_k |x_k w_k| + u * |ref| +
the float32 accumulation (<= K * 2^-24 * sum_k |x_k w_k|); float32 activations keep the weights
exact. Each bound below is that with a 2x margin.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import zlib
from pathlib import Path

import gguf.quants as gguf_quants  # a dependency of orca_ext: missing, it must fail, not skip
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

try:
    from orca_ext import _C
except ImportError:  # the GPU tests then fail on _C; the host decoding test does not need it
    _C = None

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"
FORMATS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOKENS = [1, 3, 8, 17, 300]
# Unit roundoff of the weights and outputs per activation dtype (float32 weights are exact).
WEIGHT_U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}
OUT_U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
# Absolute rounding error of a weight below the normal range (fp16 subnormals are 2^-24 apart).
WEIGHT_SUBNORMAL = {torch.bfloat16: 0.0, torch.float16: 2.0 ** -25, torch.float32: 0.0}


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def awkward_k(qtype) -> int:
    """An odd number of blocks: 19 * 32 for the 32-element formats, 3 * 256 for the K-quants."""
    return 19 * 32 if GGML_QUANT_SIZES[qtype][0] == 32 else 3 * 256


def random_blocks(qtype, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] uint8 of valid random blocks: random quants everywhere, fp16 scales (and
    mins) drawn so that the dequantized weights are about 1/sqrt(k) in size."""
    qk, block_bytes = GGML_QUANT_SIZES[qtype]
    nb = (rows, k // qk)
    raw = rng.integers(0, 256, size=nb + (block_bytes,), dtype=np.uint8)

    def f16(scale):
        return (rng.normal(0.0, scale, size=nb) / np.sqrt(k)).astype(np.float16).view(np.uint8).reshape(nb + (2,))

    if qtype == Q.Q8_0:
        raw[..., 0:2] = f16(1 / 64)
    elif qtype == Q.Q4_0:
        raw[..., 0:2] = f16(1 / 4)
    elif qtype == Q.Q5_0:
        raw[..., 0:2] = f16(1 / 8)
    elif qtype in (Q.Q4_1, Q.Q5_1):
        raw[..., 0:2], raw[..., 2:4] = f16(1 / 8 if qtype == Q.Q4_1 else 1 / 16), f16(1.0)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        raw[..., 0:2], raw[..., 2:4] = f16(1 / 256 if qtype == Q.Q4_K else 1 / 512), f16(1 / 256)
    elif qtype == Q.Q6_K:
        raw[..., 208:210] = f16(1 / 2048)
    return raw.reshape(rows, -1)


def dequantized(raw: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf_quants.dequantize(raw, qtype).astype(np.float64))


class Case:
    """x [T, K], a quantized weight [N, K], and the float64 dequantized weight."""

    def __init__(self, qtype, n_tokens: int, n_rows: int, dtype, seed: int, k: int | None = None):
        rng = np.random.default_rng(seed)
        gen = torch.Generator().manual_seed(seed)
        self.k = awkward_k(qtype) if k is None else k
        self.qtype, self.dtype = qtype, dtype
        self.raw = random_blocks(qtype, n_rows, self.k, rng)
        self.w = dequantized(self.raw, qtype)                                 # [N, K] float64
        self.qweight = torch.from_numpy(self.raw).to(DEV)
        self.x = torch.randn(n_tokens, self.k, generator=gen).to(dtype)
        self.bias = torch.randn(n_rows, generator=gen).to(dtype)
        self.residual = torch.randn(n_tokens, n_rows, generator=gen).to(dtype)

    def dev(self, t):
        return None if t is None else t.to(DEV)

    def products(self, rows=slice(None)):
        """(x W^T in float64, |x| |W|^T (+ the subnormal weights' share): the scale of the
        rounding error of each output), for these weight rows."""
        xd, w = self.x.double(), self.w[rows]
        scale = xd.abs() @ w.abs().T
        scale += WEIGHT_SUBNORMAL[self.dtype] / max(WEIGHT_U[self.dtype], 2.0 ** -24) * xd.abs().sum(1, keepdim=True)
        return xd @ w.T, scale

    def bound(self, scale: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        accumulate = (self.k + 8) * 2.0 ** -24
        return 2 * ((WEIGHT_U[self.dtype] + accumulate) * scale + OUT_U[self.dtype] * ref.abs()) + 1e-6


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (actual.double().cpu() - expected).abs()
    bad = ~(err <= bound)  # NaN fails too
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.numel()} outputs out of bounds; first {i}: "
                             f"got {actual.double().cpu()[tuple(i)].item():.6g}, want {expected[tuple(i)].item():.6g}, "
                             f"bound {bound[tuple(i)].item():.3g}")


# ---- quant_linear ------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_tokens", TOKENS)
def test_quant_linear_matches_float64_on_gguf_dequantized_blocks(qtype, dtype, n_tokens):
    extras = n_tokens % 2 == 1  # bias and residual at odd T
    n_rows = 40 if extras else 77
    case = Case(qtype, n_tokens, n_rows, dtype, seed_of("linear", qtype, dtype, n_tokens, n_rows))
    bias, residual = (case.bias, case.residual) if extras else (None, None)
    out = _C.quant_linear(case.dev(case.x), case.qweight, int(qtype), case.k, bias=case.dev(bias),
                          residual=case.dev(residual))
    assert out.shape == (n_tokens, n_rows) and out.dtype == dtype and out.device.type == torch.device(DEV).type
    ref, scale = case.products()
    if extras:
        ref = ref + case.bias.double() + case.residual.double()
        scale = scale + case.bias.double().abs() + case.residual.double().abs()
    assert_within(out, ref, case.bound(scale, ref), f"quant_linear {qtype.name} {dtype} T={n_tokens}")


@needs_cuda
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_tokens", TOKENS)
def test_quant_linear_silu_mul_matches_float64(qtype, dtype, n_tokens):
    with_bias = n_tokens % 2 == 0  # a bias at even T
    n_inter = 16 if with_bias else 45
    case = Case(qtype, n_tokens, 2 * n_inter, dtype, seed_of("silu", qtype, dtype, n_tokens, n_inter))
    bias = case.bias if with_bias else None
    out = _C.quant_linear_silu_mul(case.dev(case.x), case.qweight, int(qtype), case.k, bias=case.dev(bias))
    assert out.shape == (n_tokens, n_inter) and out.dtype == dtype
    gate_up, scale = case.products()
    if with_bias:
        gate_up = gate_up + case.bias.double()
        scale = scale + case.bias.double().abs()
    gate, up = gate_up[:, :n_inter], gate_up[:, n_inter:]
    ref = torch.nn.functional.silu(gate) * up
    # gate and up each carry the projection's error e (bound without the output rounding); silu's
    # slope is below 1.1, and __expf adds a few float32 ulps to silu(gate).
    e = case.bound(scale, torch.zeros_like(scale)) / 2
    e_gate, e_up = e[:, :n_inter], e[:, n_inter:]
    bound = 2 * (1.1 * e_gate * (up.abs() + e_up) + torch.nn.functional.silu(gate).abs() * e_up
                 + (OUT_U[dtype] + 2.0 ** -20) * ref.abs()) + 1e-6
    assert_within(out, ref, bound, f"quant_linear_silu_mul {qtype.name} {dtype} T={n_tokens}")


@needs_cuda
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_quant_linear_on_llama_sized_rows(qtype):
    """A K of 2048 (many chunks) and N = 300 (ten row tiles, the last one partial)."""
    case = Case(qtype, 5, 300, torch.bfloat16, seed_of("llama", qtype), k=2048)
    out = _C.quant_linear(case.dev(case.x), case.qweight, int(qtype), case.k)
    ref, scale = case.products()
    assert_within(out, ref, case.bound(scale, ref), f"quant_linear {qtype.name} K=2048")


# ---- batch invariance ----------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tokens_output_does_not_depend_on_its_batch(qtype, dtype):
    """Every row of a 300-token call equals, bit for bit, the same row computed alone and inside
    ragged sub-batches of awkward sizes (which cross every token-tile size the kernels use)."""
    case = Case(qtype, 300, 70, dtype, seed_of("invariance", qtype, dtype))
    x, bias, residual = case.dev(case.x), case.dev(case.bias), case.dev(case.residual)
    full = _C.quant_linear(x, case.qweight, int(qtype), case.k, bias=bias, residual=residual)
    full_silu = _C.quant_linear_silu_mul(x, case.qweight, int(qtype), case.k, bias=bias)
    start = 0
    for size in [1, 3, 8, 17, 33, 65, 100, 73]:
        rows = slice(start, start + size)
        part = _C.quant_linear(x[rows].contiguous(), case.qweight, int(qtype), case.k, bias=bias,
                               residual=residual[rows].contiguous())
        part_silu = _C.quant_linear_silu_mul(x[rows].contiguous(), case.qweight, int(qtype), case.k, bias=bias)
        assert torch.equal(part, full[rows]), f"quant_linear rows {rows} differ from the full batch"
        assert torch.equal(part_silu, full_silu[rows]), f"quant_linear_silu_mul rows {rows} differ"
        start += size
    assert start == 300
    for t in [0, 150, 299]:
        alone = _C.quant_linear(x[t:t + 1].contiguous(), case.qweight, int(qtype), case.k, bias=bias,
                                residual=residual[t:t + 1].contiguous())
        assert torch.equal(alone, full[t:t + 1]), f"token {t} alone differs from its row in the batch"


# ---- views that start anywhere -------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_activations_and_weight_rows(dtype):
    """x starting 2 bytes past an allocation and a weight that is a row slice (rows of 19 * 34 bytes
    start at odd multiples of 2) give the same result as aligned copies."""
    qtype = Q.Q8_0
    case = Case(qtype, 9, 33, dtype, seed_of("misaligned", dtype))
    x = case.dev(case.x)
    flat = torch.empty(x.numel() + 1, dtype=dtype, device=DEV)
    x_view = flat[1:].view_as(x)
    x_view.copy_(x)
    assert x_view.data_ptr() % 16 != 0
    w_view = case.qweight[1:]
    assert w_view.is_contiguous() and w_view.data_ptr() % 4 != 0
    expected = _C.quant_linear(x, w_view.clone(), int(qtype), case.k)
    assert torch.equal(_C.quant_linear(x_view, w_view, int(qtype), case.k), expected)
    ref, scale = case.products(slice(1, None))
    assert_within(expected, ref, case.bound(scale, ref), "quant_linear on a row slice")


# ---- quant_embedding -------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_quant_embedding_is_gguf_dequantize_rounded_once(qtype):
    """float32 rows are bit for bit gguf.quants.dequantize's; fp16 / bf16 rows are those rounded once."""
    rng = np.random.default_rng(seed_of("embedding", qtype))
    vocab, k = 37, awkward_k(qtype)
    raw = random_blocks(qtype, vocab, k, rng)
    table = torch.from_numpy(gguf_quants.dequantize(raw, qtype).astype(np.float32))
    ids = torch.tensor([0, 36, 5, 5, 17, 1, 36, 2, 30, 11, 0], dtype=torch.int64)
    for dtype in DTYPES:
        out = _C.quant_embedding(torch.from_numpy(raw).to(DEV), int(qtype), k, ids.to(DEV), dtype)
        assert out.shape == (len(ids), k) and out.dtype == dtype
        assert torch.equal(out.cpu(), table[ids].to(dtype)), f"quant_embedding {qtype.name} {dtype}"


# ---- the block decoding, on the host (no GPU needed) ------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
DECODE_DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cuda/quant/quant_blocks.cuh"
using namespace orca::kernels::quant;
// decode QTYPE ROWS K IN OUT: float32 rows of IN (raw blocks) into OUT, decoding from each of the 16
// byte alignments of the buffer; exit status 3 when two alignments disagree.
int main(int argc, char** argv) {
  const int qtype = std::atoi(argv[1]);
  const long rows = std::atol(argv[2]), k = std::atol(argv[3]);
  std::FILE* f = std::fopen(argv[4], "rb");
  std::vector<unsigned char> in;
  for (int c; (c = std::fgetc(f)) != EOF;) in.push_back(static_cast<unsigned char>(c));
  std::fclose(f);
  std::vector<float> first(rows * k), out(rows * k);
  std::vector<unsigned char> buf(in.size() + 32);
  for (int shift = 0; shift < 16; ++shift) {
    unsigned char* base = buf.data() + ((16 - (reinterpret_cast<uintptr_t>(buf.data()) & 15)) & 15) + shift;
    std::copy(in.begin(), in.end(), base);
    const bool known = visit_format(qtype, [&](auto fmt) {
      using F = decltype(fmt);
      const long row_bytes = k / F::kBlockElems * F::kBlockBytes;
      for (long r = 0; r < rows; ++r)
        for (long c = 0; c < k; c += 8) {
          float w[8];
          F::dequant(F::load(base + r * row_bytes, c), w);
          for (int e = 0; e < 8; ++e) out[r * k + c + e] = w[e];
        }
    });
    if (!known) return 2;
    if (shift == 0) first = out;
    else if (out != first) return 3;
  }
  f = std::fopen(argv[5], "wb");
  std::fwrite(first.data(), sizeof(float), first.size(), f);
  std::fclose(f);
  return 0;
}
"""


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for candidate in (shutil.which("nvcc"), os.path.join(cuda_home, "bin", "nvcc")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc to build the host side of quant_blocks.cuh")
    folder = tmp_path_factory.mktemp("quant_decode")
    (folder / "decode.cu").write_text(DECODE_DRIVER)
    # ORCA_QUANT_HOST_WIDE_LOADS: the host takes the device's 8-, 4- and 2-byte load paths too.
    subprocess.run([nvcc, "-std=c++17", "-O1", "-DORCA_QUANT_HOST_WIDE_LOADS", f"-I{ROOT / 'csrc'}",
                    str(folder / "decode.cu"), "-o", str(folder / "decode")],
                   check=True, capture_output=True, timeout=300)
    return folder / "decode"


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_block_decoding_is_gguf_dequantize_bit_for_bit_at_every_alignment(decoder, qtype, tmp_path):
    rng = np.random.default_rng(seed_of("decode", qtype))
    rows, k = 5, awkward_k(qtype)
    raw = random_blocks(qtype, rows, k, rng)
    raw.tofile(tmp_path / "blocks.bin")
    proc = subprocess.run([str(decoder), str(int(qtype)), str(rows), str(k), str(tmp_path / "blocks.bin"),
                           str(tmp_path / "rows.bin")], capture_output=True, timeout=60)
    assert proc.returncode == 0, f"decode exited with {proc.returncode} (3: the alignments disagree)"
    ours = np.fromfile(tmp_path / "rows.bin", dtype=np.float32).reshape(rows, k)
    want = gguf_quants.dequantize(raw, qtype).astype(np.float32)
    assert np.array_equal(ours.view(np.uint32), want.view(np.uint32)), f"{qtype.name} decodes differently from gguf"
