"""The int8-activation CPU products of Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weights (Q4_K, Q5_K and
Q6_K in test_quant_int8_k.py): `int8_activations=True` of `_C.quant_linear`, `_C.quant_linear_silu_mul`, `_C.quant_rmsnorm_qkv`; the process-wide mode
`quant_activations` ("auto", "float32", "int8") in orca_ext/quant/kernels.py.

The reference quantizes the activations as the contract says (per 32-block: d = amax / 127 in
float32, q = round-half-even(x * (1 / d)), s = d * sum(q)), takes exact integer block dot products
against the weight quants read from the raw block bytes here, then sums in float64. Weights are
random bytes (every quant value, Q8_0's -128 included) with finite fp16 scales. Also: every
instruction path gives the same bits, a row's outputs are bit-identical whatever shares the call,
and the mode reaches the kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from int8_epilogue_checks import (check_lone_bits_at_tile_edges, check_rows_batch_invariant,
                                  check_silu_mul_and_rmsnorm_qkv)

from orca_ext import modes
from orca_ext.quant import kernels
from orca_ext.quant.weight import QuantizedWeight

_C = pytest.importorskip("orca_ext._C")

INT8_TYPES = [int(t) for t in _C.quant_int8_types()]
pytestmark = pytest.mark.skipif(8 not in INT8_TYPES, reason="no int8-activation kernels on this build/CPU")
QUANT_PATHS = _C.cpu_quant_paths()
BLOCK_BYTES = {8: 34, 2: 18, 3: 20, 6: 22, 7: 24}
NAMES = {8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1"}
TYPES = list(NAMES)
WITH_MIN = (3, 7)  # Q4_1, Q5_1: w = d * q + m
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _restore_path():
    before = _C.cpu_quant_path()
    yield
    _C.set_cpu_quant_path(before)


def random_blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row_bytes] uint8: random quants, finite fp16 d (and Q4_1's or Q5_1's m, either sign)."""
    rng = np.random.default_rng(seed)
    nb, nbytes = k // 32, BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n, nb, nbytes), dtype=np.uint8)
    scale = 1.0 / (32.0 * np.sqrt(k))
    raw[..., 0:2] = (rng.uniform(0.2, 1.0, (n, nb)) * scale).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    if qtype in WITH_MIN:
        raw[..., 2:4] = (rng.uniform(-8, 8, (n, nb)) * scale).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, -1)


def weight_quants(qtype: int, qweight: np.ndarray, k: int):
    """(integer quants [N, K] int64, d [N, K/32] float64, m [N, K/32] float64 or None)."""
    n, nb = qweight.shape[0], k // 32
    blocks = qweight.reshape(n, nb, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].copy().view(np.float16).reshape(n, nb).astype(np.float64)
    if qtype == 8:
        q = blocks[..., 2:34].view(np.int8).astype(np.int64)
        return q.reshape(n, k), d, None
    head = 2 + 2 * (qtype in WITH_MIN) + 4 * (qtype in (6, 7))  # fp16 d [, m] [, uint32 qh]
    packed = blocks[..., head:head + 16]
    nib = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int64)  # elements 0..15, 16..31
    if qtype in (6, 7):  # bit 4 of element i: bit i of the little-endian qh before the nibbles
        qh = blocks[..., head - 4:head].copy().view("<u4").astype(np.int64)  # [n, nb, 1]
        nib = nib | (((qh >> np.arange(32)) & 1) << 4)
    if qtype in (2, 6):
        return (nib - (8 if qtype == 2 else 16)).reshape(n, k), d, None
    m = blocks[..., 2:4].copy().view(np.float16).reshape(n, nb).astype(np.float64)
    return nib.reshape(n, k), d, m


def quantize_activations(x: torch.Tensor):
    """The contract's int8 rows of float32 x [T, K]: (q [T, K] int64, d [T, K/32], s [T, K/32]),
    d and s as the float32 values the kernels hold."""
    t, k = x.shape
    xb = x.float().reshape(t, k // 32, 32)
    amax = xb.abs().amax(dim=-1)
    d = amax / 127.0  # float32 division
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1))  # float32 product, ties to even
    s = d * q.sum(dim=-1)  # float32 product of the exact integer sum
    return q.reshape(t, k).to(torch.int64).numpy(), d.double().numpy(), s.double().numpy()


def reference(x: torch.Tensor, qtype: int, qweight: np.ndarray, k: int):
    """(out [T, N] float64, mass [T, N]: the sum of |x_i w_i| and |m s| terms, which bounds every
    partial sum the float32 accumulation forms)."""
    wq, wd, wm = weight_quants(qtype, qweight, k)
    xq, xd, xs = quantize_activations(x)
    t, n, nb = x.shape[0], wq.shape[0], k // 32
    isum = np.einsum("tbi,nbi->tnb", xq.reshape(t, nb, 32), wq.reshape(n, nb, 32))  # exact int64
    abs_isum = np.einsum("tbi,nbi->tnb", np.abs(xq).reshape(t, nb, 32), np.abs(wq).reshape(n, nb, 32))
    scales = wd[None] * xd[:, None]
    out, mass = (isum * scales).sum(-1), (abs_isum * scales).sum(-1)
    if wm is not None:
        mins = wm[None] * xs[:, None]
        out, mass = out + mins.sum(-1), mass + np.abs(mins).sum(-1)
    return torch.from_numpy(out), torch.from_numpy(mass)


def assert_close(got, ref, mass, k, dtype, what):
    """|got - ref| <= half an output ulp + float32 rounding of the block scale products and of the
    accumulation (k/32 additions per lane or to the minimum sum, 3 tree levels, the minimum term,
    bias and residual)."""
    out_rtol = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    bound = out_rtol * ref.abs() + (k // 32 + 7) * 2.0 ** -24 * mass + 1e-30
    err = (got.double() - ref).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outside the bound; worst excess "
                           f"{float((err - bound).max()):.3g}, err {float(err.max()):.3g}")


def rows(gen, t, k, dtype, zero_row=None):
    x = torch.randn(t, k, generator=gen) * torch.rand(t, 1, generator=gen) * 3
    if zero_row is not None:
        x[zero_row] = 0.0  # amax = 0: every q and d is 0
    return x.to(dtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", QUANT_PATHS)
def test_linear_matches_integer_reference(qtype, dtype, path):
    _C.set_cpu_quant_path(path)
    gen = torch.Generator().manual_seed(qtype * 7 + len(path))
    # (19, 32 * 64, 97): prefill over several L2 panels of rows (64 KiB of weights each);
    # (21, 32 * 256, 7): over several token tiles of the natural-order tiles (~128 KiB of rows)
    # (1, 32 * 18, 45): one token over 4-row tiles (two rows per zmm register) and a row left over
    for t, k, n in [(1, 32, 1), (1, 32 * 18, 45), (3, 32 * 9, 37), (17, 32 * 23, 13), (5, 32 * 48, 70), (19, 32 * 64, 97),
                    (21, 32 * 256, 7)]:
        qweight = random_blocks(qtype, n, k, seed=t * 1000 + k + n)
        x = rows(gen, t, k, dtype, zero_row=t - 1 if t > 1 else None)
        bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
        residual = (torch.randn(t, n, generator=gen)).to(dtype)
        w = torch.from_numpy(qweight)
        ref, mass = reference(x, qtype, qweight, k)
        got = _C.quant_linear(x, w, qtype, k, None, None, int8_activations=True)
        assert_close(got, ref, mass, k, dtype, f"{NAMES[qtype]} T={t} K={k} N={n}")
        got = _C.quant_linear(x, w, qtype, k, bias, residual, int8_activations=True)
        ref_br = ref + bias.double() + residual.double()
        assert_close(got, ref_br, mass + bias.double().abs() + residual.double().abs(), k, dtype,
                     f"{NAMES[qtype]} +bias+residual T={t} K={k} N={n}")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_and_rmsnorm_qkv(qtype, dtype):
    gen = torch.Generator().manual_seed(qtype)
    t, k, inter = 6, 32 * 11, 29
    qweight = torch.from_numpy(random_blocks(qtype, 2 * inter, k, seed=qtype + 5))
    x = rows(gen, t, k, dtype)
    check_silu_mul_and_rmsnorm_qkv(_C, qweight, qtype, k, inter, x, gen)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
def test_paths_agree_bit_for_bit(qtype):
    if len(QUANT_PATHS) < 2:
        pytest.skip("one quantized path on this CPU")
    gen = torch.Generator().manual_seed(11)
    k, n = 32 * 27, 41
    w = torch.from_numpy(random_blocks(qtype, n, k, seed=3))
    for t in (1, 9, 13, 21):
        x = rows(gen, t, k, torch.float32)
        outs = []
        for path in QUANT_PATHS:
            _C.set_cpu_quant_path(path)
            outs.append(_C.quant_linear(x, w, qtype, k, None, None, int8_activations=True))
        assert all(torch.equal(outs[0], o) for o in outs[1:]), f"T={t}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("path", QUANT_PATHS)
def test_each_token_keeps_its_lone_bits_at_every_tile_edge(qtype, path):
    """At every tile edge (check_lone_bits_at_tile_edges), with a row count that leaves
    remainders, each token's outputs are its bits alone, and within the reference bound."""
    _C.set_cpu_quant_path(path)
    gen = torch.Generator().manual_seed(qtype + 31)
    k, n = 32 * 13, 11
    w = torch.from_numpy(random_blocks(qtype, n, k, seed=qtype + 17))
    x = rows(gen, 37, k, torch.float32, zero_row=6)
    alone = check_lone_bits_at_tile_edges(_C, w, qtype, k, x, NAMES[qtype])
    ref, mass = reference(x, qtype, w.numpy(), k)
    assert_close(alone, ref, mass, k, torch.float32, f"{NAMES[qtype]} tokens alone")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("path", QUANT_PATHS)
def test_rows_are_batch_invariant(qtype, path):
    _C.set_cpu_quant_path(path)
    gen = torch.Generator().manual_seed(5)
    k, n, inter = 32 * 18, 53, 23
    w = torch.from_numpy(random_blocks(qtype, n, k, seed=9))
    wg = torch.from_numpy(random_blocks(qtype, 2 * inter, k, seed=10))
    big = rows(gen, 70, k, torch.float32)
    check_rows_batch_invariant(_C, w, wg, qtype, k, big, gen)


def test_mode_selects_the_int8_products():
    gen = torch.Generator().manual_seed(2)
    k, n = 32 * 10, 19
    w = QuantizedWeight(3, torch.from_numpy(random_blocks(3, n, k, seed=1)), n, k)
    x = rows(gen, 4, k, torch.float32)
    with modes.using(quant_activations="int8"):
        int8 = kernels.linear(x, w)
    with modes.using(quant_activations="float32"):
        flt = kernels.linear(x, w)
    assert torch.equal(int8, _C.quant_linear(x, w.data, 3, k, None, None, int8_activations=True))
    assert torch.equal(flt, _C.quant_linear(x, w.data, 3, k, None, None))
    assert not torch.equal(int8, flt)


def any_format_blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row_bytes] of random bytes in any fast format, with finite fp16 scales."""
    if qtype in BLOCK_BYTES:
        return random_blocks(qtype, n, k, seed)
    rng = np.random.default_rng(seed)
    size = {12: 144, 13: 176, 14: 210}[qtype]
    raw = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    for at in ((0, 2) if qtype in (12, 13) else (208,)):  # Q4_K, Q5_K: d, dmin; Q6_K: d
        raw[..., at:at + 2] = (rng.uniform(0.1, 1.0, raw.shape[:2]) / (512 * np.sqrt(k))).astype(
            np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def test_auto_mode_takes_int8_for_k_quants_and_float32_for_32_element_blocks():
    """quant_activations="auto": the products of Q4_K, Q5_K and Q6_K blocks are the int8 ones,
    those of Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 the float32 ones, bit for bit; in a fused matrix each part by its own
    format, whatever the number of tokens."""
    from orca_ext.quant.weight import QuantizedStack

    gen = torch.Generator().manual_seed(3)
    k, n = 256 * 3, 21
    weights = {t: QuantizedWeight(t, torch.from_numpy(any_format_blocks(t, n, k, seed=t)), n, k)
               for t in (2, 3, 6, 7, 8, 12, 13, 14)}
    for t_tokens in (1, 5, 19):
        x = rows(gen, t_tokens, k, torch.float32)
        for qtype, w in weights.items():
            with modes.using(quant_activations="auto"):
                auto = kernels.linear(x, w)
            int8 = _C.quant_linear(x, w.data, qtype, k, None, None, int8_activations=True)
            flt = _C.quant_linear(x, w.data, qtype, k, None, None)
            assert not torch.equal(int8, flt)
            assert torch.equal(auto, int8 if qtype in (12, 13, 14) else flt), (qtype, t_tokens)
        stack = QuantizedStack((weights[12], weights[3], weights[14]))
        with modes.using(quant_activations="auto"):
            got = kernels.linear(x, stack)
        want = torch.cat([_C.quant_linear(x, weights[12].data, 12, k, None, None, int8_activations=True),
                          _C.quant_linear(x, weights[3].data, 3, k, None, None),
                          _C.quant_linear(x, weights[14].data, 14, k, None, None, int8_activations=True)], dim=-1)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="quant_activations"):
        modes.Modes(quant_activations="int4")


def test_every_compiled_format_has_int8_kernels():
    """The mode covers every format the compiled kernels take: a model's products all change."""
    assert sorted(INT8_TYPES) == sorted(int(t) for t in _C.quant_types())


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q4_K_M", "Q5_K_M"])
def test_a_models_logits_with_int8_activations(tmp_path, fmt):
    """A tiny GGUF model with the mode on: a request's logits are the same bits alone and among
    batch-mates (prefill and decode), and stay near the float-activation logits (the rounding of
    8-bit activations, not a different computation). Q4_K_M (Q5_K_M): Q4_K (Q5_K) matrices with
    attn_v and ffn_down in Q6_K, as llama.cpp's files mix them."""
    from gguf import GGMLQuantizationType as T
    from gguf_models import LARGE, VOCAB, write_gguf

    from orca_ext.models import load_model
    from orca_ext.models.batch import ForwardBatch

    path = tmp_path / "m.gguf"
    if fmt in ("Q4_K_M", "Q5_K_M"):
        main = T.Q4_K if fmt == "Q4_K_M" else T.Q5_K
        write_gguf(path, "llama", lambda name: T.Q6_K if "attn_v" in name or "ffn_down" in name else main,
                   seed=3, **LARGE)
    else:
        write_gguf(path, "llama", lambda name: T[fmt], seed=3)
    model = load_model(path)
    model.allocate_kv_cache(192)
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 14, 2))
    with modes.using(quant_activations="int8", batch_invariant=True):
        alone = model(ForwardBatch.build([(a, 0, 0)]))[0]
        alone_next = model(ForwardBatch.build([([5], len(a), 0)]))[0]
        mixed = model(ForwardBatch.build([(b, 0, 0), (a, 0, 64), (c, 0, 128)]))[1]
        mixed_next = model(ForwardBatch.build([([9], len(b), 0), ([5], len(a), 64), ([1, 2], len(c), 128)]))[1]
    with modes.using(quant_activations="float32", batch_invariant=True):
        float_acts = model(ForwardBatch.build([(a, 0, 0)]))[0]
    assert torch.equal(alone, mixed)
    assert torch.equal(alone_next, mixed_next)
    assert not torch.equal(alone, float_acts)
    # measured: 1.8% of the norm for Q4_1 (32-blocks), 3.6% for Q4_K_M (256-blocks); a wrong
    # product (one sub-block's scale off) moves the logits by the order of their norm
    assert (alone - float_acts).norm().item() < 0.06 * float_acts.norm().item()


def test_quant_activations_option_sets_the_servers_mode(tmp_path):
    """`quant_activations` is validated, parsed from --quant-activations (default auto), sets the
    process's mode, and a Server built with 'int8' serves its GGUF with the int8 products (the
    tokens of the mode set by hand)."""
    import argparse

    from gguf import GGMLQuantizationType as T
    from gguf_models import write_gguf

    from orca_ext import SamplingParams, Server
    from orca_ext.config import EngineConfig
    from orca_ext.options import add_engine_arguments

    with pytest.raises(ValueError, match="quant_activations"):
        EngineConfig(quant_activations="int4")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args([])).quant_activations == "auto"
    assert EngineConfig.from_args(parser.parse_args(["--quant-activations", "int8"])).quant_activations == "int8"

    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", lambda name: T.Q4_1, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [3, 17, 40, 2, 9, 11, 5]

    def tokens(mode: str, **options):
        """The Server's greedy tokens; it runs in `mode` and puts back the modes it found."""
        before = modes.current()
        with Server(str(path), device="cpu", n_slots=128, **options) as server:
            assert modes.current().quant_activations == mode
            out = list(server.generate(prompt, params)[0].token_ids)
        assert modes.current() is before
        return out

    as_int8 = tokens("int8", quant_activations="int8")
    tokens("float32", quant_activations="float32")
    tokens("auto")
    with modes.using(quant_activations="int8"):
        from orca_ext.models import load_model
        from orca_ext.models.batch import ForwardBatch
        model = load_model(path)
        model.allocate_kv_cache(64)
        ids, reference = list(prompt), []
        for step in range(12):
            logits = model(ForwardBatch.build([(ids if step == 0 else ids[-1:], 0 if step == 0 else len(ids) - 1, 0)]))
            reference.append(int(logits[0].argmax()))
            ids.append(reference[-1])
    assert as_int8 == reference


def test_auto_is_resolved_from_the_models_main_block_format():
    """resolve_quant_activations: "float32" and "int8" stand; "auto" stays the per-format rule for
    a model whose blocks are mostly Q4_0 or Q4_1 (bytes decide, a smaller Q8_0 lm_head included)
    and becomes "int8" for every other model; a model without blocks keeps it."""
    from orca_ext.quant.formats import resolve_quant_activations

    for mode in ("float32", "int8"):
        assert resolve_quant_activations(mode, {8: 100}) == mode
    assert resolve_quant_activations("auto", {}) == "auto"
    assert resolve_quant_activations("auto", {3: 66, 8: 30}) == "auto"   # the embedded Q4_1 file's mix
    assert resolve_quant_activations("auto", {2: 10}) == "auto"
    assert resolve_quant_activations("auto", {8: 1313}) == "int8"
    assert resolve_quant_activations("auto", {12: 467, 14: 332}) == "int8"  # Q4_K_M
    assert resolve_quant_activations("auto", {6: 60, 8: 15, 12: 10, 14: 15}) == "int8"  # SmolLM2's Q4_K_M
    assert resolve_quant_activations("auto", {3: 30, 8: 66}) == "int8"    # mostly Q8_0
    with pytest.raises(ValueError, match="quant_activations"):
        resolve_quant_activations("int4", {8: 1})


def _greedy_with_logprobs(path, **options):
    from orca_ext import SamplingParams, Server

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    with Server(str(path), device="cpu", n_slots=128, **options) as server:
        out = server.generate([3, 17, 40, 2, 9, 11, 5], params)[0]
        return server.config.quant_activations, modes.current().quant_activations, out.token_ids, [
            (lp.logprob, lp.top) for lp in out.logprobs]


def test_a_q8_0_file_is_served_with_int8_activations_by_default(tmp_path):
    """Under the default quant_activations="auto", a Server resolves the mode from the spec's
    block bytes: a Q8_0 file runs the int8 products (the config, the process's mode and the
    numbers of an explicit "int8" Server, not those of "float32"), on one process and on
    pipeline workers alike; a Q4_1 file with a Q8_0 lm_head keeps "auto" (its Q8_0 head takes
    float32 activations: the numbers of an explicit "float32" Server)."""
    from gguf import GGMLQuantizationType as T
    from gguf_models import write_gguf

    from orca_ext.models import load_model
    from orca_ext.models.config import ModelSpec

    q8 = tmp_path / "q8.gguf"
    write_gguf(q8, "llama", lambda name: T.Q8_0, seed=7)
    mixed = tmp_path / "mixed.gguf"
    write_gguf(mixed, "llama", lambda name: T.Q8_0 if name == "output.weight" else T.Q4_1, seed=7)
    spec = ModelSpec.from_pretrained(q8)
    assert [t for t, _ in spec.block_bytes] == [8] and spec.block_bytes[0][1] > 0
    assert {t for t, _ in ModelSpec.from_pretrained(mixed).block_bytes} == {3, 8}
    for path in (q8, mixed):  # a loaded model keeps exactly the file's blocks
        assert load_model(path).block_bytes() == dict(ModelSpec.from_pretrained(path).block_bytes)

    with modes.using():  # the Servers set the process's modes; restore them after
        auto = _greedy_with_logprobs(q8)
        int8 = _greedy_with_logprobs(q8, quant_activations="int8")
        as_float = _greedy_with_logprobs(q8, quant_activations="float32")
        assert auto[:2] == ("int8", "int8")
        assert auto[2:] == int8[2:]
        assert auto[3] != as_float[3]
        pipelined = _greedy_with_logprobs(q8, pipeline_parallel_size=2)
        assert pipelined[0] == "int8" and pipelined[2:] == int8[2:]

        mixed_auto = _greedy_with_logprobs(mixed)
        assert mixed_auto[:2] == ("auto", "auto")
        assert mixed_auto[2:] == _greedy_with_logprobs(mixed, quant_activations="float32")[2:]
        assert mixed_auto[3] != _greedy_with_logprobs(mixed, quant_activations="int8")[3]
