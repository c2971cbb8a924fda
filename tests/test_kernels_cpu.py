"""The CPU kernels of orca_ext._C against float64 torch references, on fresh random ragged batches
with awkward sizes. Ragged batches are checked request by request against that request alone."""
from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch

from orca_ext import modes, ops, reference

from kernel_cases import make_ragged_case, random_kinds, scattered_slabs

_C = pytest.importorskip("orca_ext._C")

DTYPES = [torch.float32, torch.bfloat16]
F32_PATHS = _C.cpu_f32_paths()
# (atol, rtol) of a kernel's output against the float64 reference.
TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 2e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.fixture(params=F32_PATHS)
def f32_path(request):
    """Runs the test on one float32 instruction path (attention's prefill tiles follow it), then
    restores the previous one."""
    before = _C.cpu_f32_path()
    _C.set_cpu_f32_path(request.param)
    yield request.param
    _C.set_cpu_f32_path(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 7, 83])
@pytest.mark.parametrize("hidden", [111, 576])
def test_rms_norm(dtype, n_tokens, hidden):
    gen = torch.Generator().manual_seed(n_tokens * 1000 + hidden)
    x = (torch.randn(n_tokens, hidden, generator=gen) * 3).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    out = _C.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, reference.rms_norm(x.double(), w.double(), 1e-5), dtype, "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 7, 16, 17, 83])  # both sides of the fused/GEMM switches
@pytest.mark.parametrize("hidden,heads", [(111, (3, 1, 16)), (576, (9, 3, 64))])
@pytest.mark.parametrize("bias", [False, True])
def test_rmsnorm_qkv(dtype, n_tokens, hidden, heads, bias):
    n_q, n_kv, d = heads
    n_out = (n_q + 2 * n_kv) * d
    gen = torch.Generator().manual_seed(hash((n_tokens, hidden, bias)) % 2**31)
    x = (torch.randn(n_tokens, hidden, generator=gen) * 2).to(dtype)
    nw = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    w = (torch.randn(n_out, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)
    b = torch.randn(n_out, generator=gen).to(dtype) if bias else None
    out = _C.rmsnorm_qkv(x, nw, w, b, 1e-6)
    assert out.shape == (n_tokens, n_out) and out.dtype == dtype
    expected = reference.rmsnorm_qkv(x.double(), nw.double(), w.double(), None if b is None else b.double(), 1e-6)
    assert_close(out, expected, dtype, "rmsnorm_qkv")


def test_rmsnorm_qkv_non_contiguous_input():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 7, generator=gen).t()  # [7, 64], non-contiguous
    nw, w = torch.randn(64, generator=gen), torch.randn(40, 64, generator=gen)
    assert_close(_C.rmsnorm_qkv(x, nw, w, None, 1e-6), reference.rmsnorm_qkv(x.double(), nw.double(), w.double(),
                                                                            None, 1e-6), torch.float32, "rmsnorm_qkv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n_tokens", [1, 7, 83])
def test_slab_write_scattered(dtype, index_dtype, n_tokens):
    rng = random.Random(n_tokens)
    gen = torch.Generator().manual_seed(n_tokens)
    n_kv, d = 3, 80
    # Tokens of a few requests, each request's tokens going to consecutive slots of its own slab.
    lengths = [len(c) for c in torch.arange(n_tokens).tensor_split(min(n_tokens, 4))]
    starts, n_slots = scattered_slabs(rng, [n + 5 for n in lengths])  # room for a start offset
    positions = [rng.randint(0, 5) for _ in lengths]
    slots = torch.tensor([s + p + i for s, p, n in zip(starts, positions, lengths) for i in range(n)], dtype=index_dtype)
    k_cache = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(n_slots, n_kv, d, generator=gen).to(dtype)
    k = torch.randn(n_tokens, n_kv, d, generator=gen).to(dtype)
    v = torch.randn(n_tokens, n_kv, d, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.slab_write(k_ref, v_ref, k, v, slots)
    _C.slab_write(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy is exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (7, 1), (14, 2)])  # GQA ratios 1, 3, 7, 7
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_ragged_attention_mixed_batch(f32_path, dtype, heads, head_dim):
    n_q, n_kv = heads
    seed = n_q * 131 + head_dim
    case = make_ragged_case(seed, random_kinds(seed, 7), n_q, n_kv, head_dim, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    q64, k64, v64 = case.q.double(), case.k_cache.double(), case.v_cache.double()
    for b, kind in enumerate(case.kinds):  # each request against that request computed alone
        qs, ql, ks, kl = (int(t[b]) for t in case.index_tensors())
        one = torch.tensor([0])
        expected = reference.ragged_attention(q64[qs:qs + ql], k64[ks:ks + kl], v64[ks:ks + kl], one,
                                              torch.tensor([ql]), one, torch.tensor([kl]), scale)
        assert_close(out[qs:qs + ql], expected, dtype, f"request {b} ({kind}, q_len {ql}, kv_len {kl})")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_ragged_attention_index_dtypes_and_mixed(index_dtype):
    case = make_ragged_case(11, random_kinds(11, 5), 6, 2, 64, torch.float32, index_dtype=index_dtype)
    expected = reference.ragged_attention(case.q.double(), case.k_cache.double(), case.v_cache.double(),
                                          *case.index_tensors(), 0.125)
    out = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.125)
    assert_close(out, expected, torch.float32, "ragged_attention")
    # Mixed int32/int64 index tensors are accepted too.
    mixed = (case.q_start.int(), case.q_len.long(), case.kv_start.int(), case.kv_len.long())
    assert_close(_C.ragged_attention(case.q, case.k_cache, case.v_cache, *mixed, 0.125), expected,
                 torch.float32, "ragged_attention (mixed index dtypes)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 4), 80), ((7, 1), 20), ((14, 2), 128),
                                            ((32, 8), 64), ((12, 2), 64)])
def test_ragged_attention_same_bits_on_every_float32_path(dtype, heads, head_dim):
    """Prefill tiles in 8-lane and in 16-lane registers perform the same float32 operations per
    query lane, so every path gives the same bits: tiles of every lane count (prompts of 1 to
    200 rows, over cached prefixes too) beside decodes."""
    if len(F32_PATHS) < 2:
        pytest.skip("this CPU has one float32 path")
    n_q, n_kv = heads
    seed = 7 * n_q + head_dim
    case = make_ragged_case(seed, random_kinds(seed, 9), n_q, n_kv, head_dim, dtype, max_context=200)
    before = _C.cpu_f32_path()
    outs = {}
    try:
        for path in F32_PATHS:
            _C.set_cpu_f32_path(path)
            outs[path] = _C.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.1)
    finally:
        _C.set_cpu_f32_path(before)
    first = outs[F32_PATHS[0]]
    for path in F32_PATHS[1:]:
        assert torch.equal(outs[path], first), f"ragged_attention on {path} differs from {F32_PATHS[0]}"


def test_ragged_attention_long_context_no_overflow():
    """Large logits over a long context: a softmax without a running max would overflow float32."""
    gen = torch.Generator().manual_seed(5)
    n_ctx, d = 3000, 64
    q = torch.randn(2, 2, d, generator=gen) * 30
    k = torch.randn(n_ctx, 1, d, generator=gen) * 30
    v = torch.randn(n_ctx, 1, d, generator=gen)
    idx = [torch.tensor(x, dtype=torch.int32) for x in ([0], [2], [0], [n_ctx])]
    out = _C.ragged_attention(q, k, v, *idx, 1.0)
    assert torch.isfinite(out).all()
    expected = reference.ragged_attention(q.double(), k.double(), v.double(), *idx, 1.0)
    assert_close(out, expected, torch.float32, "long context")


def requests_of(case) -> tuple[list, list, list, list, list]:
    """A ragged case's requests as lists (q_start, q_len, kv_start, kv_len) and its q rows, for a
    test to add requests of its own after them."""
    return (case.q_start.tolist(), case.q_len.tolist(), case.kv_start.tolist(), case.kv_len.tolist(), [case.q])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((8, 2), 80), ((10, 2), 64), ((5, 5), 20), ((7, 1), 128)])
def test_ragged_attention_decodes_in_key_blocks(dtype, heads, head_dim):
    """Decodes over 1 to 3,000 keys (one to many 64-key blocks, with logits large enough that the
    blocks' maxima differ widely): every row against float64. And a decode's bits depend only on
    its own context: alone, beside other requests in another order, on one thread or two."""
    n_q, n_kv = heads
    seed = 17 * n_q + head_dim
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    contexts = [1, 63, 64, 65, 129, rng.randint(130, 1000), 3000]
    others = make_ragged_case(seed, ["prefill", "prefix", "decode"], n_q, n_kv, head_dim, dtype)
    starts, n_slots = scattered_slabs(rng, contexts)
    base = others.k_cache.shape[0]
    k_cache = torch.cat([others.k_cache, (4 * torch.randn(n_slots, n_kv, head_dim, generator=gen)).to(dtype)])
    v_cache = torch.cat([others.v_cache, torch.randn(n_slots, n_kv, head_dim, generator=gen).to(dtype)])
    q = (4 * torch.randn(len(contexts), n_q, head_dim, generator=gen)).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)

    def run(decodes: list[int], with_others: bool, threads: int) -> dict[int, torch.Tensor]:
        """The given decodes (indices into contexts), after the other requests or alone."""
        qs, ql, ks, kl, rows = requests_of(others) if with_others else ([], [], [], [], [])
        t = sum(r.shape[0] for r in rows)
        for j, i in enumerate(decodes):
            qs.append(t + j); ql.append(1); ks.append(base + starts[i]); kl.append(contexts[i])
            rows.append(q[i:i + 1])
        idx = [torch.tensor(v, dtype=torch.int32) for v in (qs, ql, ks, kl)]
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            out = _C.ragged_attention(torch.cat(rows), k_cache, v_cache, *idx, scale)
        finally:
            torch.set_num_threads(before)
        return {i: out[t + j] for j, i in enumerate(decodes)}

    every = list(range(len(contexts)))
    batch = run(every, True, 2)
    one = torch.tensor([0])
    for i, n in enumerate(contexts):
        s = base + starts[i]
        expected = reference.ragged_attention(q[i:i + 1].double(), k_cache[s:s + n].double(), v_cache[s:s + n].double(),
                                              one, torch.tensor([1]), one, torch.tensor([n]), scale)
        assert_close(batch[i], expected[0], dtype, f"decode over {n} keys")
    for threads in (1, 2):
        for i, row in run(every[::-1], False, threads).items():
            assert torch.equal(row, batch[i]), f"decode over {contexts[i]} keys, reversed batch, {threads} thread(s)"
        for i in (0, 3, 6):
            assert torch.equal(run([i], False, threads)[i], batch[i]), f"decode over {contexts[i]} keys alone"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((32, 8), 64), ((4, 4), 20), ((14, 2), 128)])
def test_ragged_attention_batch_invariant_decodes_over_many_blocks_equal_prefill_rows(dtype, heads, head_dim):
    """A batch-invariant decode is cut into key blocks that any thread may compute; merged in key
    order, it gives the bits of the same row inside one long prefill, alone or beside other
    decodes, on one thread or two, over contexts of up to 17 blocks."""
    n_q, n_kv = heads
    gen = torch.Generator().manual_seed(n_q + head_dim)
    rng = random.Random(n_q * head_dim)
    n_ctx = 1090
    k_cache = (3 * torch.randn(n_ctx + 5, n_kv, head_dim, generator=gen)).to(dtype)
    v_cache = torch.randn(n_ctx + 5, n_kv, head_dim, generator=gen).to(dtype)
    q = (3 * torch.randn(n_ctx, n_q, head_dim, generator=gen)).to(dtype)
    slab, scale = 5, 1.0 / math.sqrt(head_dim)

    def run(rows: list[int], threads: int) -> torch.Tensor:
        """Prompt rows as decodes (one request each, q_len 1 over kv_len row + 1), in one call."""
        idx = [torch.tensor(v, dtype=torch.int32) for v in
               (list(range(len(rows))), [1] * len(rows), [slab] * len(rows), [p + 1 for p in rows])]
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            return _C.ragged_attention(q[rows], k_cache, v_cache, *idx, scale, batch_invariant=True)
        finally:
            torch.set_num_threads(before)

    idx = [torch.tensor([v], dtype=torch.int32) for v in (0, n_ctx, slab, n_ctx)]
    whole = _C.ragged_attention(q, k_cache, v_cache, *idx, scale, batch_invariant=True)
    picks = [n_ctx - 1, 1023, 1024, 640] + rng.sample(range(n_ctx - 1), 4)
    for threads in (1, 2):
        for p in picks[:4]:
            assert torch.equal(run([p], threads)[0], whole[p]), f"decode at row {p} alone, {threads} thread(s)"
        together = run(picks, threads)
        for i, p in enumerate(picks):
            assert torch.equal(together[i], whole[p]), f"decode at row {p} beside others, {threads} thread(s)"


def test_ops_dispatch_uses_extension():
    assert ops.HAVE_EXTENSION
    case = make_ragged_case(2, ["decode", "prefill"], 2, 1, 64, torch.float32)
    a = ops.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.1)
    b = reference.ragged_attention(case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.1)
    assert_close(a, b, torch.float32, "ops.ragged_attention")


@pytest.mark.parametrize("n_tokens", [17, 96, 97])  # a tall lm_head-like shape, one and two token tiles
def test_rmsnorm_qkv_wide_output(n_tokens):
    gen = torch.Generator().manual_seed(n_tokens)
    hidden, n_out = 72, 16384 + 13
    x = torch.randn(n_tokens, hidden, generator=gen)
    nw = torch.randn(hidden, generator=gen)
    w = torch.randn(n_out, hidden, generator=gen) / math.sqrt(hidden)
    expected = reference.rmsnorm_qkv(x.double(), nw.double(), w.double(), None, 1e-6)
    assert_close(_C.rmsnorm_qkv(x, nw, w, None, 1e-6), expected, torch.float32, "rmsnorm_qkv (wide)")


# -- slab_move (slab compaction) ------------------------------------------------------------------
def random_moves(rng: random.Random, n_slots: int, n_moves: int) -> list[tuple[int, int, int]]:
    """Moves with disjoint and overlapping ranges in both directions, plus empty and self moves."""
    moves = []
    for i in range(n_moves):
        n = rng.randint(0, n_slots // 2)
        src = rng.randint(0, n_slots - n)
        dst = rng.randint(0, n_slots - n) if i % 2 else max(0, min(n_slots - n, src + rng.randint(-n, n)))
        moves.append((src, dst, n))
    return moves


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(1, 40, 1), (6, 97, 3, 16), (60, 250, 3, 64)])
def test_slab_move_matches_reference_bit_for_bit(dtype, shape):
    rng = random.Random(sum(shape))
    pools = (torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))) * 100).to(dtype)
    moves = random_moves(rng, shape[1], 9)
    expected = pools.clone()
    reference.slab_move(expected, moves)
    _C.slab_move(pools, torch.tensor(moves, dtype=torch.int64))
    assert torch.equal(pools, expected)


def test_slab_move_of_a_compaction_keeps_every_slab():
    """The moves an allocator's compact() returns, applied to pools holding each slab's owner id."""
    alloc = reference.SlabAllocatorReference(200)
    rng = random.Random(4)
    owner = {}
    for i in range(30):
        n = rng.randint(1, 12)
        start = alloc.allocate(n)
        if start >= 0:
            owner[start] = (i, n)
        if owner and rng.random() < 0.4:
            victim = rng.choice(sorted(owner))
            alloc.free(victim)
            del owner[victim]
    pools = torch.full((4, 200, 2), -1, dtype=torch.int64)
    for start, (i, n) in owner.items():
        pools[:, start:start + n] = i
    moves = alloc.compact()
    assert moves and alloc.largest_free == alloc.n_free
    _C.slab_move(pools, torch.tensor(moves, dtype=torch.int64))
    moved = {old: new for old, new, _ in moves}
    for start, (i, n) in owner.items():
        new = moved.get(start, start)
        assert (pools[:, new:new + n] == i).all(), f"slab {i} lost its rows"


# -- batch-invariant paths ------------------------------------------------------------------------
# Each checks (1) the values against the float64 reference and (2) that a row's bits do not depend
# on which other rows share the call, for random subsets of rows in random order. The projections
# run on the weight-streaming kernels (csrc/cpu/skinny_gemm.*), T-independent by default; their
# batch_invariant switch keeps them there even when the ATen crossover is lowered ("lowered").
def random_subsets(rng: random.Random, n: int, count: int = 6) -> list[list[int]]:
    sizes = [1, 2, 3, n] + [rng.randint(1, n) for _ in range(count)]
    return [rng.sample(range(n), k) for k in sizes]


@contextlib.contextmanager
def stream_crossover(dtype: torch.dtype, max_tokens: int | None):
    """With max_tokens, CPU projections of more tokens go to ATen until the block exits."""
    name = str(dtype).replace("torch.", "")
    old = _C.cpu_stream_max_tokens(name)
    if max_tokens is not None:
        _C.set_cpu_stream_max_tokens(name, max_tokens)
    try:
        yield
    finally:
        _C.set_cpu_stream_max_tokens(name, old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(37, 97), (576, 160)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("crossover", [None, 4], ids=["default", "lowered"])
def test_linear_rows_do_not_depend_on_the_batch(dtype, k, n, bias, crossover):
    rng = random.Random(k + n)
    gen = torch.Generator().manual_seed(k * n)
    x = torch.randn(131, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    invariant = crossover is not None  # the default needs no switch: every T is on our kernels
    with stream_crossover(dtype, crossover):
        full = _C.linear(x, w, b, batch_invariant=invariant)
        expected = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        assert_close(full, expected, dtype, "linear")
        for rows in random_subsets(rng, x.shape[0]):
            got = _C.linear(x[rows], w, b, batch_invariant=invariant)
            assert torch.equal(got, full[rows]), f"rows {rows[:5]}... of {len(rows)}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("crossover", [None, 4], ids=["default", "lowered"])
def test_rmsnorm_qkv_batch_invariant_rows(dtype, crossover):
    rng = random.Random(8)
    gen = torch.Generator().manual_seed(8)
    hidden, n_out = 96, 160
    x = torch.randn(150, hidden, generator=gen).to(dtype)
    nw = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    w = (torch.randn(n_out, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)
    with stream_crossover(dtype, crossover):
        full = _C.rmsnorm_qkv(x, nw, w, None, 1e-6, True)
        assert_close(full, reference.rmsnorm_qkv(x.double(), nw.double(), w.double(), None, 1e-6), dtype,
                     "rmsnorm_qkv")
        for rows in random_subsets(rng, x.shape[0]):
            assert torch.equal(_C.rmsnorm_qkv(x[rows], nw, w, None, 1e-6, True), full[rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_inter", [80, 37])
@pytest.mark.parametrize("crossover", [None, 4], ids=["default", "lowered"])
def test_linear_silu_mul_rows_do_not_depend_on_the_batch(dtype, n_inter, crossover):
    rng = random.Random(n_inter)
    gen = torch.Generator().manual_seed(n_inter)
    x = torch.randn(201, 72, generator=gen).to(dtype)
    w = (torch.randn(2 * n_inter, 72, generator=gen) / math.sqrt(72)).to(dtype)
    invariant = crossover is not None
    with stream_crossover(dtype, crossover):
        full = _C.linear_silu_mul(x, w, None, batch_invariant=invariant)
        assert_close(full, reference.linear_silu_mul(x.double(), w.double()), dtype, "linear_silu_mul")
        for rows in random_subsets(rng, x.shape[0]):
            assert torch.equal(_C.linear_silu_mul(x[rows], w, None, batch_invariant=invariant), full[rows])


@pytest.mark.parametrize("dtype", DTYPES)
# GQA ratios 3, 1, 4, 8 and 2: the decode blocks' register blocks split 4 and 8 query heads differently
# from the prefill tiles' lanes, and take 1 to 3 heads left over as a shorter block
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 2), (16, 2), (6, 3)])
@pytest.mark.parametrize("d", [64, 20])  # 20: K blocks whose width is not a multiple of the 8-wide transpose
def test_ragged_attention_batch_invariant_rows_ignore_chunks_and_batch_mates(f32_path, dtype, heads, d):
    """One request's prompt rows, computed as one prefill, as chunks over its cached prefix, as
    one-row decodes, and beside other requests: the same bits every time."""
    n_q, n_kv = heads
    rng = random.Random(n_q)
    gen = torch.Generator().manual_seed(n_q)
    n_ctx, start = 150, 7
    others = make_ragged_case(n_q, random_kinds(n_q, 5), n_q, n_kv, d, dtype)
    k_cache = torch.cat([others.k_cache, torch.randn(start + n_ctx, n_kv, d, generator=gen).to(dtype)])
    v_cache = torch.cat([others.v_cache, torch.randn(start + n_ctx, n_kv, d, generator=gen).to(dtype)])
    slab = others.k_cache.shape[0] + start
    q = torch.randn(n_ctx, n_q, d, generator=gen).to(dtype)

    def run(pieces: list[tuple[int, int]], with_others: bool) -> torch.Tensor:
        """Rows [lo, hi) of the prompt as requests (q_len hi-lo over kv_len hi), in one call."""
        qs, ql, ks, kl, rows = requests_of(others) if with_others else ([], [], [], [], [])
        base = sum(r.shape[0] for r in rows)
        for lo, hi in pieces:
            qs.append(base); ql.append(hi - lo); ks.append(slab); kl.append(hi)
            rows.append(q[lo:hi])
            base += hi - lo
        idx = [torch.tensor(v, dtype=torch.int32) for v in (qs, ql, ks, kl)]
        plan = _C.ragged_attention_plan(*idx, base, k_cache.shape[0], n_q, n_kv, d, dtype, batch_invariant=True)
        out = _C.ragged_attention(torch.cat(rows), k_cache, v_cache, *idx, 0.125, plan=plan, batch_invariant=True)
        return out[base - sum(hi - lo for lo, hi in pieces):]

    whole = run([(0, n_ctx)], False)
    expected = reference.ragged_attention(q.double(), k_cache[slab:].double(), v_cache[slab:].double(),
                                          *(torch.tensor([v]) for v in (0, n_ctx, 0, n_ctx)), 0.125)
    assert_close(whole, expected, dtype, "ragged_attention (batch-invariant)")
    cuts = sorted(rng.sample(range(1, n_ctx), 6))
    chunks = list(zip([0] + cuts, cuts + [n_ctx]))
    assert torch.equal(run(chunks, True), whole)             # chunks beside other requests
    assert torch.equal(run([(0, 40)], True), whole[:40])     # a prompt cut short
    for p in (0, 1, 63, 64, 100, n_ctx - 1):                 # one-row decodes
        assert torch.equal(run([(p, p + 1)], rng.random() < 0.5), whole[p:p + 1]), f"row {p}"


def _logit_rows(n_rows: int, n_cols: int, seed: int) -> torch.Tensor:
    """Random logits with the hard cases planted: ties of the maximum, NaN, +inf, all -inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, n_cols, generator=gen) * 8
    rng = random.Random(seed)
    for r in range(n_rows):
        kind = rng.choice(["plain", "tie", "tie", "nan", "inf", "all_neg_inf", "neg_inf_and_finite"])
        cols = sorted(rng.sample(range(n_cols), min(3, n_cols)))
        if kind == "tie":        # the same maximum at several columns: the first one counts
            x[r, cols] = x[r].max() + 1.0
        elif kind == "nan":      # NaN wins over anything, and its first column counts
            x[r, cols[-1]] = float("nan")
            x[r, cols[0]] = float("inf")
        elif kind == "inf":
            x[r, cols[0]] = float("inf")
        elif kind == "all_neg_inf":
            x[r] = float("-inf")
        elif kind == "neg_inf_and_finite":
            x[r] = float("-inf")
            x[r, cols[-1]] = -1e30
    return x


@pytest.mark.parametrize("n_rows,n_cols", [(1, 1), (1, 7), (3, 49157), (17, 100), (33, 8191)])  # 33 x 8191: threaded
def test_row_argmax(n_rows, n_cols):
    x = _logit_rows(n_rows, n_cols, seed=n_rows * 7919 + n_cols)
    index, value = _C.row_argmax(x)
    ref_index, ref_value = reference.row_argmax(x.double())
    assert index.dtype == torch.int64 and value.dtype == torch.float32 and index.shape == value.shape == (n_rows,)
    assert torch.equal(index, ref_index)
    torch.testing.assert_close(value.double(), ref_value, equal_nan=True, atol=0, rtol=0)
    # ATen's max agrees on every row without NaN (the sampler used it before).
    plain = ~torch.isnan(x).any(dim=-1)
    aten_value, aten_index = x.max(dim=-1)
    assert torch.equal(index[plain], aten_index[plain]) and torch.equal(value[plain], aten_value[plain])
    # A non-contiguous view gives the same answer.
    t_index, t_value = _C.row_argmax(x.t().contiguous().t())
    assert torch.equal(t_index, index) and torch.equal(torch.isnan(t_value), torch.isnan(value))


@pytest.mark.parametrize("x,match", [
    (torch.zeros(5), r"x must be 2-D \[R, V\]"),
    (torch.zeros(2, 5, dtype=torch.float64), "x must be float32"),
    (torch.zeros(2, 0), "x has 0 columns"),
])
def test_row_argmax_bad_input(x, match):
    with pytest.raises(ValueError, match=match):
        _C.row_argmax(x)


class RecordingExtension:
    """Stands in for _C in orca_ext.ops: records each call's arguments, returns nothing."""

    def __init__(self):
        self.calls: dict[str, tuple] = {}

    def __getattr__(self, name):
        return lambda *args: self.calls.__setitem__(name, args)


@pytest.mark.parametrize("invariant", [False, True])
def test_ops_pass_the_batch_invariant_mode_to_every_kernel_that_takes_it(monkeypatch, invariant):
    fake = RecordingExtension()
    monkeypatch.setattr(ops, "_C", fake)
    monkeypatch.setattr(ops, "ATTENTION_DECODE_STAGES", 2)
    x, idx = torch.zeros(1, 4), [torch.zeros(1, dtype=torch.int32)] * 4
    with modes.using(batch_invariant=invariant):
        ops.rmsnorm_qkv(x, x[0], x, None, 1e-6)
        ops.linear(x, x)
        ops.linear_silu_mul(x, x)
        ops.ragged_attention_plan(*idx, 1, 1, 1, 1, 4, torch.float32)
        ops.ragged_attention(x, x, x, *idx, 1.0)
    assert set(fake.calls) == {"rmsnorm_qkv", "linear", "linear_silu_mul", "ragged_attention_plan", "ragged_attention"}
    assert all(args[-1] is invariant for args in fake.calls.values()), fake.calls
    # The invariant work list runs on the shared kernel whatever the environment asks for.
    assert fake.calls["ragged_attention_plan"][-2] == (0 if invariant else 2)


def test_a_plan_is_used_only_in_the_mode_it_was_built_in():
    case = make_ragged_case(5, ["decode", "prefill", "decode"], 4, 2, 64, torch.float32)
    args = (case.q, case.k_cache, case.v_cache, *case.index_tensors(), 0.1)
    plans = {}
    for invariant in (False, True):
        with modes.using(batch_invariant=invariant):
            plans[invariant] = ops.ragged_attention_plan(*case.index_tensors(), case.q.shape[0],
                                                         case.k_cache.shape[0], 4, 2, 64, torch.float32)
        assert plans[invariant].batch_invariant is invariant
    expected = reference.ragged_attention(case.q.double(), case.k_cache.double(), case.v_cache.double(),
                                          *case.index_tensors(), 0.1)
    for invariant in (False, True):
        with modes.using(batch_invariant=invariant):
            assert_close(ops.ragged_attention(*args, plan=plans[invariant]), expected, torch.float32,
                         f"ops.ragged_attention, batch_invariant={invariant}")
            with pytest.raises(ValueError, match="batch_invariant"):
                ops.ragged_attention(*args, plan=plans[not invariant])
