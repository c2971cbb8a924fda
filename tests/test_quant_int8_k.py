"""The int8-activation CPU products of Q4_K, Q5_K and Q6_K weights (`int8_activations=True` of
`_C.quant_linear`, `_C.quant_linear_silu_mul`, `_C.quant_rmsnorm_qkv`).

The reference quantizes the activations as the contract says (per 256-element super-block:
d = amax / 127 in float32, q = round-half-even(x * (1 / d)); sums of q per 16), reads the weights'
integer quants, scales and mins from the raw block bytes here (checked against the `gguf`
package's dequantization), takes exact integer sub-block dot products, then the float math in
float64. Weights are random bytes (every quant, scale and min value) with finite fp16 d and dmin.
Also: every instruction path gives the same bits, and a row's outputs are bit-identical whatever
shares the call."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from int8_epilogue_checks import (check_lone_bits_at_tile_edges, check_rows_batch_invariant,
                                  check_silu_mul_and_rmsnorm_qkv)

_C = pytest.importorskip("orca_ext._C")
gguf = pytest.importorskip("gguf")

Q4_K, Q5_K, Q6_K = 12, 13, 14
NAMES = {Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}
TYPES = list(NAMES)
QUANT_PATHS = _C.cpu_quant_paths()
INT8_TYPES = [int(t) for t in _C.quant_int8_types()]
pytestmark = pytest.mark.skipif(any(t not in INT8_TYPES for t in TYPES),
                                reason="no int8-activation K-quant kernels on this build/CPU")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _restore_path():
    before = _C.cpu_quant_path()
    yield
    _C.set_cpu_quant_path(before)


def fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row_bytes] uint8: random bytes, then finite fp16 scales of about 1 / (64 sqrt(k))."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    raw = rng.integers(0, 256, size=(n, nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scale = 1.0 / (64.0 * np.sqrt(k))
    if qtype in (Q4_K, Q5_K):
        raw[..., 0:2] = fp16_bytes(rng.uniform(0.1, 1.0, (n, nb)) * scale / 8)  # d
        raw[..., 2:4] = fp16_bytes(rng.uniform(0.1, 1.0, (n, nb)) * scale / 8)  # dmin
    else:
        raw[..., 208:210] = fp16_bytes(rng.uniform(0.1, 1.0, (n, nb)) * scale / 16)
    return raw.reshape(n, -1)


def q4k_parts(qweight: np.ndarray, k: int, qtype: int = Q4_K):
    """(codes [N, K] int64, sc, mn [N, K/32] int64, d, dmin [N, K/256] float64), read as ggml's
    get_scale_min_k4 and dequantize_row_q4_K (q5_K: the nibbles and bit s of qh[l] as bit 4 of
    element l of sub-block s) do."""
    n, nb = qweight.shape[0], k // 256
    blk = qweight.reshape(n, nb, BLOCK_BYTES[qtype])
    d = blk[..., 0:2].copy().view(np.float16).reshape(n, nb).astype(np.float64)
    dmin = blk[..., 2:4].copy().view(np.float16).reshape(n, nb).astype(np.float64)
    s = blk[..., 4:16].astype(np.int64)
    sc, mn = np.zeros((n, nb, 8), np.int64), np.zeros((n, nb, 8), np.int64)
    for j in range(8):
        if j < 4:
            sc[..., j], mn[..., j] = s[..., j] & 63, s[..., j + 4] & 63
        else:
            sc[..., j] = (s[..., j + 4] & 0x0F) | ((s[..., j - 4] >> 6) << 4)
            mn[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
    at = 48 if qtype == Q5_K else 16
    qs = blk[..., at:at + 128].reshape(n, nb, 4, 32).astype(np.int64)
    nib = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb, 8, 32)  # sub-block 2p / 2p+1
    if qtype == Q5_K:
        qh = blk[..., 16:48].astype(np.int64).reshape(n, nb, 1, 32)
        nib = nib | (((qh >> np.arange(8).reshape(8, 1)) & 1) << 4)
    return nib.reshape(n, k), sc.reshape(n, -1), mn.reshape(n, -1), d, dmin


def q6k_parts(qweight: np.ndarray, k: int):
    """(q6 [N, K] int64 in 0..63, sc [N, K/16] int64, d [N, K/256] float64), as ggml's
    dequantize_row_q6_K reads them (the weight is d * sc * (q6 - 32))."""
    n, nb = qweight.shape[0], k // 256
    blk = qweight.reshape(n, nb, 210)
    ql, qh = blk[..., 0:128].astype(np.int64), blk[..., 128:192].astype(np.int64)
    sc = blk[..., 192:208].view(np.int8).astype(np.int64)
    d = blk[..., 208:210].copy().view(np.float16).reshape(n, nb).astype(np.float64)
    q = np.zeros((n, nb, 256), np.int64)
    for h in range(2):
        l0, l1, hb = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        base = 128 * h
        q[..., base + 0:base + 32] = (l0 & 0xF) | (((hb >> 0) & 3) << 4)
        q[..., base + 32:base + 64] = (l1 & 0xF) | (((hb >> 2) & 3) << 4)
        q[..., base + 64:base + 96] = (l0 >> 4) | (((hb >> 4) & 3) << 4)
        q[..., base + 96:base + 128] = (l1 >> 4) | (((hb >> 6) & 3) << 4)
    return q.reshape(n, k), sc.reshape(n, -1), d


def dequantized_here(qtype: int, qweight: np.ndarray, k: int) -> np.ndarray:
    """The float32 weights from the parts above, in gguf's order of float32 operations."""
    f = np.float32
    if qtype in (Q4_K, Q5_K):
        nib, sc, mn, d, dmin = q4k_parts(qweight, k, qtype)
        dl = (np.repeat(d, 8, axis=1).astype(f) * sc.astype(f))
        ml = (np.repeat(dmin, 8, axis=1).astype(f) * mn.astype(f))
        return np.repeat(dl, 32, axis=1) * nib.astype(f) - np.repeat(ml, 32, axis=1)
    q, sc, d = q6k_parts(qweight, k)
    dl = np.repeat(d, 16, axis=1).astype(f) * sc.astype(f)
    return np.repeat(dl, 16, axis=1) * (q - 32).astype(f)


def quantize_activations(x: torch.Tensor):
    """The contract's int8 rows of float32 x [T, K]: (q [T, K] int64, d [T, K/256] float64)."""
    t, k = x.shape
    xb = x.float().reshape(t, k // 256, 256)
    d = xb.abs().amax(dim=-1) / 127.0  # float32 division
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1))  # float32 product, ties to even
    return q.reshape(t, k).to(torch.int64).numpy(), d.double().numpy()


def reference(x: torch.Tensor, qtype: int, qweight: np.ndarray, k: int):
    """(out [T, N] float64, mass [T, N]: a sum of magnitudes that bounds every partial sum the
    float32 accumulation forms)."""
    xq, xd = quantize_activations(x)
    t, n, nb = x.shape[0], qweight.shape[0], k // 256
    if qtype in (Q4_K, Q5_K):
        nib, sc, mn, d, dmin = q4k_parts(qweight, k, qtype)
        dots = np.einsum("tsi,nsi->tns", xq.reshape(t, -1, 32), nib.reshape(n, -1, 32))  # exact int64
        absdots = np.einsum("tsi,nsi->tns", np.abs(xq).reshape(t, -1, 32), nib.reshape(n, -1, 32))
        bsum = xq.reshape(t, -1, 32).sum(-1)  # [T, K/32]
        isum = (dots * sc[None]).reshape(t, n, nb, 8).sum(-1)  # [T, N, nb]
        imin = (bsum[:, None] * mn[None]).reshape(t, n, nb, 8).sum(-1)
        iabs = (absdots * sc[None]).reshape(t, n, nb, 8).sum(-1)
        iminabs = (np.abs(bsum)[:, None] * mn[None]).reshape(t, n, nb, 8).sum(-1)
        scale, mscale = d[None] * xd[:, None], dmin[None] * xd[:, None]
        out = (isum * scale - imin * mscale).sum(-1)
        mass = (iabs * np.abs(scale) + iminabs * np.abs(mscale)).sum(-1)
        return torch.from_numpy(out), torch.from_numpy(mass)
    q, sc, d = q6k_parts(qweight, k)
    dots = np.einsum("tsi,nsi->tns", xq.reshape(t, -1, 16), (q - 32).reshape(n, -1, 16))
    absdots = np.einsum("tsi,nsi->tns", np.abs(xq).reshape(t, -1, 16), (q + 32).reshape(n, -1, 16))
    isum = (dots * sc[None]).reshape(t, n, nb, 16).sum(-1)
    iabs = (absdots * np.abs(sc)[None]).reshape(t, n, nb, 16).sum(-1)
    scale = d[None] * xd[:, None]
    return torch.from_numpy((isum * scale).sum(-1)), torch.from_numpy((iabs * np.abs(scale)).sum(-1))


def assert_close(got, ref, mass, k, dtype, what):
    """|got - ref| <= half an output ulp + float32 rounding: the scale products, the int32 ->
    float32 conversions, two accumulations per super-block in each lane, 3 tree levels, bias and
    residual."""
    out_rtol = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    bound = out_rtol * ref.abs() + (4 * (k // 256) + 10) * 2.0 ** -24 * mass + 1e-30
    err = (got.double() - ref).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outside the bound; worst excess "
                           f"{float((err - bound).max()):.3g}, err {float(err.max()):.3g}")


def rows(gen, t, k, dtype, zero_row=None):
    x = torch.randn(t, k, generator=gen) * torch.rand(t, 1, generator=gen) * 3
    x[:, ::7] *= 5  # uneven magnitudes inside a super-block
    if zero_row is not None:
        x[zero_row] = 0.0  # amax = 0: every q and d is 0
    return x.to(dtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
def test_weight_reading_matches_gguf(qtype):
    """The reference's integer view of the blocks is gguf's dequantization, bit for bit."""
    k, n = 256 * 3, 5
    raw = random_blocks(qtype, n, k, seed=qtype)
    ours = dequantized_here(qtype, raw, k)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(n, k)
    assert np.array_equal(ours.astype(np.float32), theirs.astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", QUANT_PATHS)
def test_linear_matches_integer_reference(qtype, dtype, path):
    _C.set_cpu_quant_path(path)
    gen = torch.Generator().manual_seed(qtype * 7 + len(path))
    # (19, 256 * 8, 97): prefill over several L2 panels of rows (64 KiB of weights each);
    # (21, 256 * 32, 7): over several token tiles of the natural-order tiles (~128 KiB of rows)
    for t, k, n in [(1, 256, 1), (3, 256 * 3, 37), (17, 256 * 2, 13), (5, 256 * 9, 70), (1, 256 * 5, 9),
                    (15, 256, 6), (12, 256 * 2, 5), (19, 256 * 8, 97), (21, 256 * 32, 7)]:
        qweight = random_blocks(qtype, n, k, seed=t * 1000 + k + n)
        x = rows(gen, t, k, dtype, zero_row=t - 1 if t > 1 else None)
        bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
        residual = (torch.randn(t, n, generator=gen)).to(dtype)
        w = torch.from_numpy(qweight)
        ref, mass = reference(x, qtype, qweight, k)
        got = _C.quant_linear(x, w, qtype, k, None, None, int8_activations=True)
        assert_close(got, ref, mass, k, dtype, f"{NAMES[qtype]} T={t} K={k} N={n}")
        got = _C.quant_linear(x, w, qtype, k, bias, residual, int8_activations=True)
        assert_close(got, ref + bias.double() + residual.double(),
                     mass + bias.double().abs() + residual.double().abs(), k, dtype,
                     f"{NAMES[qtype]} +bias+residual T={t} K={k} N={n}")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
def test_near_the_float_activation_product(qtype):
    """8-bit activations per 256 change a product by about what they round, no more: the int8
    result tracks the float-activation one of the same weights."""
    gen = torch.Generator().manual_seed(3)
    k, n = 256 * 8, 64
    w = torch.from_numpy(random_blocks(qtype, n, k, seed=4))
    x = torch.randn(6, k, generator=gen)
    int8 = _C.quant_linear(x, w, qtype, k, None, None, int8_activations=True).double()
    flt = _C.quant_linear(x, w, qtype, k, None, None).double()
    assert not torch.equal(int8, flt)
    assert (int8 - flt).norm() < 0.05 * flt.norm()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_and_rmsnorm_qkv(qtype, dtype):
    gen = torch.Generator().manual_seed(qtype)
    t, k, inter = 6, 256 * 3, 29
    qweight = torch.from_numpy(random_blocks(qtype, 2 * inter, k, seed=qtype + 5))
    x = rows(gen, t, k, dtype)
    check_silu_mul_and_rmsnorm_qkv(_C, qweight, qtype, k, inter, x, gen)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
def test_paths_agree_bit_for_bit(qtype):
    if len(QUANT_PATHS) < 2:
        pytest.skip("one quantized path on this CPU")
    gen = torch.Generator().manual_seed(11)
    k, n = 256 * 7, 41
    w = torch.from_numpy(random_blocks(qtype, n, k, seed=3))
    outs = []
    for t in (1, 9, 13, 21):
        x = rows(gen, t, k, torch.float32)
        for path in QUANT_PATHS:
            _C.set_cpu_quant_path(path)
            outs.append(_C.quant_linear(x, w, qtype, k, None, None, int8_activations=True))
        assert all(torch.equal(outs[-1], o) for o in outs[-len(QUANT_PATHS):])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("path", QUANT_PATHS)
def test_rows_are_batch_invariant(qtype, path):
    _C.set_cpu_quant_path(path)
    gen = torch.Generator().manual_seed(5)
    k, n, inter = 256 * 4, 53, 23
    w = torch.from_numpy(random_blocks(qtype, n, k, seed=9))
    wg = torch.from_numpy(random_blocks(qtype, 2 * inter, k, seed=10))
    big = rows(gen, 70, k, torch.float32)
    check_rows_batch_invariant(_C, w, wg, qtype, k, big, gen)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("path", QUANT_PATHS)
def test_each_token_keeps_its_lone_bits_at_every_tile_edge(qtype, path):
    """At every tile edge (check_lone_bits_at_tile_edges), with a row count that leaves
    remainders, each token's outputs are its bits alone, and within the reference bound."""
    _C.set_cpu_quant_path(path)
    gen = torch.Generator().manual_seed(qtype + 31)
    k, n = 256 * 3, 11
    w = torch.from_numpy(random_blocks(qtype, n, k, seed=qtype + 17))
    x = rows(gen, 37, k, torch.float32, zero_row=6)
    alone = check_lone_bits_at_tile_edges(_C, w, qtype, k, x, NAMES[qtype])
    ref, mass = reference(x, qtype, w.numpy(), k)
    assert_close(alone, ref, mass, k, torch.float32, f"{NAMES[qtype]} tokens alone")
