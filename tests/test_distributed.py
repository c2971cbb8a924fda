"""Tensor and pipeline parallelism (orca_ext.distributed) on CPU workers over gloo.

Each parallel configuration runs a tiny random model on real worker processes and must produce,
request by request, the greedy tokens of the single-process model (float32), with requests
arriving while batches are running. One worker group is started per configuration and shared
by the tests that need it (module-scoped fixtures: pytest runs a parametrized fixture's tests
together, so only one group of each kind is alive at a time). Faults kill or break real workers.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from orca_ext.distributed.batch_trace import TRACE_ENV, read_traces
from orca_ext.engine import ScheduledBatch
from orca_ext.errors import EngineDeadError
from orca_ext.executor import BatchFuture
from orca_ext.models import load_model
from orca_ext.models.sharding import check_shardable, layer_ranges, make_shard
from orca_ext.request import Request
from orca_ext.sampling import SamplingParams
from orca_ext.server import Server
from tiny_models import ragged_greedy

REPO = Path(__file__).resolve().parents[1]

# (family, tp, pp, model overrides). tp=3 on one KV head replicates it on every rank, and its
# vocabulary (49157 = 3 * 16386 - 1) does not split evenly, so the last slice is padded.
CONFIGS = [
    ("llama", 2, 1, {}),
    ("llama", 2, 2, {}),
    ("qwen3", 1, 2, {}),
    ("qwen3", 2, 2, {}),
    ("qwen3", 3, 1, dict(num_key_value_heads=1, intermediate_size=162, vocab_size=49157)),
]


def _config_id(cfg) -> str:
    family, tp, pp, over = cfg
    return f"{family}-tp{tp}-pp{pp}" + ("-kv1" if over else "")


def start_server(model_dir, tp: int, pp: int, **kw) -> Server:
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("n_slots", 800)
    return Server(str(model_dir), device="cpu", dtype=kw.pop("dtype", "float32"), tensor_parallel_size=tp,
                  pipeline_parallel_size=pp, **kw)


@pytest.fixture(scope="module", params=CONFIGS, ids=_config_id)
def group(request, tiny_model_dir):
    family, tp, pp, over = request.param
    model_dir = tiny_model_dir(family, **over)
    server = start_server(model_dir, tp, pp, record_iterations=True)
    yield server, model_dir
    server.shutdown()


@pytest.fixture(scope="module")
def llama_pp2(tiny_model_dir, tmp_path_factory):
    """Two pipeline stages of the llama model, whose workers record when they run each batch
    (batch_trace.py, in `server.trace_dir`); its last user breaks it on purpose."""
    model_dir = tiny_model_dir("llama")
    trace_dir = tmp_path_factory.mktemp("pp2-trace")
    previous = os.environ.get(TRACE_ENV)
    os.environ[TRACE_ENV] = str(trace_dir)  # spawned workers take this process's environment
    try:
        server = start_server(model_dir, 1, 2, record_iterations=True, max_batch_size=3)
    finally:
        if previous is None:
            os.environ.pop(TRACE_ENV)
        else:
            os.environ[TRACE_ENV] = previous
    server.trace_dir = trace_dir
    yield server, model_dir
    server.shutdown()


@pytest.fixture(scope="module")
def local_models():
    """Single-process float32 models, one per folder (the reference of every parity test)."""
    cache: dict = {}

    def get(model_dir, dtype=torch.float32):
        key = (str(model_dir), dtype)
        if key not in cache:
            cache[key] = load_model(model_dir, "cpu", dtype)
        return cache[key]

    return get


# -- helpers ------------------------------------------------------------------------------------------
def make_jobs(seed: int, n: int = 9) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    jobs = [([rng.randrange(1000) for _ in range(rng.randint(1, 37))], rng.randint(3, 14)) for _ in range(n)]
    jobs[0] = (jobs[0][0], 17)  # the first two still decode when the mid-flight wave joins
    jobs[1] = (jobs[1][0], 12)
    return jobs


def pause_second_launch(server: Server):
    """Make the engine's 2nd launch wait for `resume` (set `paused` when it starts)."""
    executor = server.executor
    launch = executor.execute
    paused, resume = threading.Event(), threading.Event()
    calls = [0]

    def gated(batch, **kw):
        calls[0] += 1
        if calls[0] == 2:
            paused.set()
            resume.wait(60)
        return launch(batch, **kw)

    executor.execute = gated
    return paused, resume, lambda: setattr(executor, "execute", launch)


def run_staggered(server: Server, jobs, seed: int, params=None) -> list:
    """jobs[0:2] start first; jobs[2:4] are submitted while the 2nd launch is held, so they join
    running requests; the rest arrive from threads at random times. Outputs in job order."""
    params = params or (lambda i: SamplingParams(max_tokens=jobs[i][1], ignore_eos=True))
    paused, resume, restore = pause_second_launch(server)
    results: list = [None] * len(jobs)
    try:
        ids = [server.submit(jobs[i][0], params(i)) for i in (0, 1)]
        assert paused.wait(60)
        ids += [server.submit(jobs[i][0], params(i)) for i in (2, 3)]

        def staggered(i):
            time.sleep(random.Random(seed + i).uniform(0.0, 0.05))
            results[i] = server.generate([jobs[i][0]], params(i))[0]

        threads = [threading.Thread(target=staggered, args=(i,)) for i in range(4, len(jobs))]
        for t in threads:
            t.start()
        resume.set()
        for i, rid in enumerate(ids):
            results[i] = server.result(rid, timeout=120)
        for t in threads:
            t.join(120)
    finally:
        resume.set()
        restore()
    return results


def assert_idle(server: Server) -> None:
    st = server.stats()
    assert (st["waiting"], st["running"], st["slots_reserved"], st["slots_used"], st["slots_allocated"]) \
        == (0, 0, 0, 0, 0), st
    assert st["healthy"] and st["error"] is None


def forward_logits(server: Server, inputs: list) -> torch.Tensor:
    """Last-token logits [B, V] of one batch run on the workers (the KV slots it writes must be
    free: only call this on an idle server)."""
    return server.executor.forward_logits(inputs).result(timeout=60)


def local_logits(model, *batches: list) -> torch.Tensor:
    """The single-process model's logits of the last of `batches`, run in order on a fresh cache."""
    from orca_ext.models import ForwardBatch

    model.allocate_kv_cache(800)
    for inputs in batches:
        logits = model.forward(ForwardBatch.build(inputs, "cpu"))
    return logits


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, command) of the live child processes of `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append((int(entry.name), cmd))
    return found


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


# -- no processes -------------------------------------------------------------------------------------
def test_layer_split_and_shards(tiny_model_dir):
    assert layer_ranges(3, 2) == [(0, 2), (2, 3)]
    assert layer_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    from orca_ext.models import ModelSpec

    spec = ModelSpec.from_pretrained(tiny_model_dir("qwen3", num_key_value_heads=1, intermediate_size=162,
                                                    vocab_size=49157))
    shards = [make_shard(spec, 3, 1, r, 0) for r in range(3)]
    assert [(s.q_head_start, s.num_q_heads) for s in shards] == [(0, 2), (2, 2), (4, 2)]
    assert [(s.kv_head_start, s.num_kv_heads) for s in shards] == [(0, 1)] * 3  # replicated KV head
    assert [(s.vocab_start, s.vocab_end) for s in shards] == [(0, 16386), (16386, 32772), (32772, 49157)]
    assert [s.keeps_row_parallel_bias for s in shards] == [True, False, False]


def test_unshardable_configs_name_the_rule(tiny_model_dir):
    from orca_ext.models import ModelSpec

    spec = ModelSpec.from_pretrained(tiny_model_dir("llama"))  # 6 heads, 2 KV heads, I=160, 3 layers
    with pytest.raises(ValueError, match=r"num_attention_heads=6 must be divisible by tensor_parallel_size=4"):
        check_shardable(spec, 4, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 exceeds num_key_value_heads=2, so it must be a "
                                         r"multiple of it"):
        check_shardable(spec, 3, 1)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=4 exceeds the model's 3 layers"):
        check_shardable(spec, 1, 4)
    spec7 = ModelSpec.from_pretrained(tiny_model_dir("llama", intermediate_size=161))
    with pytest.raises(ValueError, match=r"intermediate_size=161 must be divisible by tensor_parallel_size=2"):
        check_shardable(spec7, 2, 1)
    # Rejected before any worker starts.
    with pytest.raises(ValueError, match=r"num_attention_heads=6 must be divisible"):
        Server(str(tiny_model_dir("llama")), device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="model folder"):
        Server(load_model(tiny_model_dir("llama")), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cuda:w"):
        Server(str(tiny_model_dir("llama")), device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        Server(str(tiny_model_dir("llama")), device="cpu", tensor_parallel_size=0)


def test_control_message_round_trip():
    from orca_ext.distributed.messages import SamplingRow, pack_forward, payload_len, unpack_forward

    rows = [SamplingRow(3, None, 0.0, 0, 1.0), SamplingRow(9, 2**64 - 5, 0.7, 5, 0.9),
            SamplingRow(10, -3, 1.5, 0, 0.5)]
    inputs = [([1, 2, 3], 0, 10), ([7], 5, 40), ([4, 4], 0, 0)]
    hdr, payload = pack_forward(12, inputs, rows, [5, 6])
    assert payload.numel() == payload_len(hdr)
    msg = unpack_forward(hdr, payload)
    assert (msg.index, msg.inputs, msg.free) == (12, inputs, [5, 6])
    assert [r.seed for r in msg.rows] == [None, 2**64 - 5, (-3) % 2**64]  # what manual_seed gets
    assert [(r.temperature, r.top_k, r.top_p) for r in msg.rows] == [(0.0, 0, 1.0), (0.7, 5, 0.9), (1.5, 0, 0.5)]
    # A non-final prompt chunk's row says so, with or without a seed.
    flagged = [SamplingRow(3, None, 0.0, 0, 1.0, False), SamplingRow(9, 7, 0.7, 5, 0.9, False), rows[2]]
    msg = unpack_forward(*pack_forward(13, inputs, flagged, []))
    assert [(r.seed, r.emits_token) for r in msg.rows] == [(None, False), (7, False), ((-3) % 2**64, True)]
    # The sampling worker follows SamplingParams' greedy rule (tiny temperatures are greedy).
    for t in (0.0, 1e-7, 1e-5, 0.5):
        assert SamplingRow(0, None, t, 0, 1.0).greedy == SamplingParams(temperature=t).greedy
    # Per-row sampling errors travel back with their own message.
    from orca_ext.distributed.messages import pack_row_errors, unpack_row_errors

    errors = [None, "non-finite logits", None, "sampling failed: ValueError: a\nb"]
    tokens = [5, -1, 7, -1]
    assert unpack_row_errors(pack_row_errors(errors), tokens) == errors
    assert pack_row_errors([None, None]).numel() == 0 and unpack_row_errors(None, [1, 2]) == [None, None]
    # The logits request carries the same inputs under its own op; a slab move its (src, dst, n) rows.
    from orca_ext.distributed.messages import (OP_FORWARD, OP_LOGITS, OP_MOVE, pack_logits_request, pack_moves,
                                               unpack_moves)

    hdr, payload = pack_logits_request(4, inputs)
    assert int(hdr[0]) == OP_LOGITS and payload.numel() == payload_len(hdr)
    assert unpack_forward(hdr, payload).inputs == inputs and int(pack_forward(4, inputs, rows, [])[0][0]) == OP_FORWARD
    moves = torch.tensor([[30, 0, 32], [70, 32, 5]])
    hdr, payload = pack_moves(moves)
    assert int(hdr[0]) == OP_MOVE and payload.numel() == payload_len(hdr) == 6
    assert torch.equal(unpack_moves(hdr, payload), moves)


def test_one_torchrun_detector():
    from orca_ext.distributed import is_torchrun_worker
    from orca_ext.distributed.torchrun import launched_by_torchrun, torchrun_env

    rank = lambda r: {"TORCHELASTIC_RUN_ID": "x", "RANK": str(r), "WORLD_SIZE": "3", "MASTER_ADDR": "h",  # noqa: E731
                      "MASTER_PORT": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert launched_by_torchrun(rank(0)) and not is_torchrun_worker(rank(0))  # rank 0 is the driver
    assert launched_by_torchrun(rank(2)) and is_torchrun_worker(rank(2))
    env = torchrun_env(rank(2))
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (2, 3, 1, 2, 1)
    # A plain torch.distributed job (no torchrun agent), or a partial environment, is no launch.
    plain = {k: v for k, v in rank(2).items() if k != "TORCHELASTIC_RUN_ID"}
    partial = {k: v for k, v in rank(2).items() if k != "MASTER_PORT"}
    for env in (plain, partial, {}):
        assert not launched_by_torchrun(env) and not is_torchrun_worker(env) and torchrun_env(env) is None


# -- parity ---------------------------------------------------------------------------------------------
def check_parity(server: Server, model_dir, local_models, seed: int) -> None:
    jobs = make_jobs(seed)
    outs = run_staggered(server, jobs, seed)
    want, _ = ragged_greedy(local_models(model_dir), [p for p, _ in jobs], [n for _, n in jobs])
    for (prompt, n), out, ref in zip(jobs, outs, want):
        assert out.finish_reason == "length", out
        assert out.token_ids == ref, (prompt, out.token_ids, ref)
    recs = server.iterations()
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in recs), "no prefill joined running decodes"
    assert_idle(server)


def test_greedy_matches_single_process(group, local_models):
    server, model_dir = group
    check_parity(server, model_dir, local_models, seed=11)
    # The logits themselves, of a ragged batch with a prefill and a context over a cached prefix.
    inputs = [([5, 9, 200, 31, 7], 0, 0), ([44], 3, 100), ([8, 8, 9], 0, 300)]
    prefix = [([1, 2, 3], 0, 100)]
    forward_logits(server, prefix)  # caches the prefix of the second request
    got = forward_logits(server, inputs)
    want = local_logits(local_models(model_dir), prefix, inputs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_pipeline_parity_with_two_batches_in_flight(llama_pp2, local_models):
    server, model_dir = llama_pp2
    check_parity(server, model_dir, local_models, seed=5)
    recs = server.iterations()
    assert all(r.complete_time is not None and r.complete_time >= r.launch_time for r in recs)
    # Orca's n_workers = pp: a batch is launched while the previous one is still in the pipeline,
    # and the two share no request.
    overlapping = [(a, b) for a, b in zip(recs, recs[1:]) if b.launch_time < a.complete_time]
    assert overlapping, "no batch was launched before the previous one returned"
    for a, b in overlapping:
        assert set(a.request_ids).isdisjoint(b.request_ids)
    # Never more than two in flight.
    for i, rec in enumerate(recs):
        in_flight = [r for r in recs[:i] if r.complete_time > rec.launch_time]
        assert len(in_flight) <= 1, (rec, in_flight)
    # The same from the workers' side, which no launch bookkeeping can fake: stage 0 started a
    # batch while stage 1 was still running the one before it.
    indices = {r.index for r in recs}
    traces = read_traces(server.trace_dir)
    first = [t for t in traces[0] if t[0] in indices]
    last = {index: end for index, _, end in traces[1] if index in indices}
    assert [t[0] for t in first] == sorted(indices) == sorted(last)  # every batch ran on both stages
    overlaps = [(a[0], b[0]) for a, b in zip(first, first[1:]) if b[1] < last[a[0]]]
    assert overlaps, "stage 0 never started a batch before stage 1 finished the previous one"


def resolved_after(release: threading.Event, real) -> BatchFuture:
    """A future that gets `real`'s outcome only once `release` is set: holds a batch's result back."""
    proxy = BatchFuture()

    def relay():
        release.wait(60)
        try:
            proxy.resolve(real.result(timeout=60))
        except Exception as exc:
            proxy.resolve(exc)

    threading.Thread(target=relay, daemon=True).start()
    return proxy


def test_abort_while_its_batch_is_in_flight(llama_pp2):
    server, _ = llama_pp2
    executor = server.executor
    launch = executor.execute
    held, release = threading.Event(), threading.Event()

    def gated(batch, **kw):  # hold back the result of the batch that carries "abort-me"
        real = launch(batch, **kw)
        if any(r.request_id == "abort-me" for r in batch.requests) and not held.is_set():
            held.set()
            return resolved_after(release, real)
        return real

    executor.execute = gated
    try:
        rid = server.submit([3, 1, 4, 1, 5], SamplingParams(max_tokens=50, ignore_eos=True), request_id="abort-me")
        other = server.submit([2, 7, 1, 8], SamplingParams(max_tokens=20, ignore_eos=True))
        assert held.wait(60)
        assert server.abort(rid)
        st = server.stats()
        # Its batch is still running: the slab stays reserved until the batch returns.
        assert st["slots_reserved"] >= 55 and st["slots_allocated"] >= 1
        out = server.result(rid, timeout=60)
        assert out.finish_reason == "abort" and len(out.token_ids) < 50
        release.set()
        assert server.result(other, timeout=60).finish_reason == "length"
    finally:
        release.set()
        executor.execute = launch
    deadline = time.monotonic() + 30
    while server.stats()["slots_allocated"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_idle(server)


def test_a_free_stage_takes_a_new_request_at_once(llama_pp2):
    """With one batch in the pipeline and nothing else to run, a request that arrives is launched
    into the free stage at once, not after that batch returns."""
    server, _ = llama_pp2
    executor = server.executor
    launch = executor.execute
    launches: list = []
    release = threading.Event()

    def gated(batch, **kw):
        launches.append([r.request_id for r in batch.requests])
        real = launch(batch, **kw)
        if len(launches) == 1:  # hold back the first batch's tokens
            return resolved_after(release, real)
        return real

    executor.execute = gated
    try:
        first = server.submit([4, 4, 2], SamplingParams(max_tokens=3, ignore_eos=True))
        deadline = time.monotonic() + 30
        while not launches and time.monotonic() < deadline:
            time.sleep(0.01)
        second = server.submit([9, 1], SamplingParams(max_tokens=3, ignore_eos=True))
        while len(launches) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert launches[:2] == [[first], [second]]  # launched while the first is still held
        release.set()
        assert server.result(first, timeout=60).finish_reason == "length"
        assert server.result(second, timeout=60).finish_reason == "length"
    finally:
        release.set()
        executor.execute = launch
    assert_idle(server)


def test_seeded_sampling_matches_single_process(llama_pp2, tiny_model_dir):
    server, model_dir = llama_pp2
    jobs = make_jobs(3, n=5)

    def params(i):
        return SamplingParams(max_tokens=jobs[i][1], temperature=0.9, top_k=40, top_p=0.95, seed=100 + i,
                              ignore_eos=True)

    got = [o.token_ids for o in server.generate([p for p, _ in jobs], [params(i) for i in range(len(jobs))])]
    with Server(str(model_dir), device="cpu", dtype="float32", max_batch_size=4, n_slots=800) as local:
        want = [o.token_ids for o in local.generate([p for p, _ in jobs], [params(i) for i in range(len(jobs))])]
    assert got == want
    assert_idle(server)


def test_seeded_sampling_under_chunked_prefill_matches_single_process(tiny_model_dir):
    """A prompt chunk that is not the last draws nothing on the sampling worker either, so a
    seeded request samples the same stream as in one process with whole prompts."""
    model_dir = tiny_model_dir("llama")
    jobs = make_jobs(4, n=5)
    params = [SamplingParams(max_tokens=n, temperature=0.9, top_k=40, top_p=0.95, seed=200 + i, ignore_eos=True)
              for i, (_, n) in enumerate(jobs)]
    with start_server(model_dir, 1, 2, max_num_batched_tokens=8, prefill_only_tokens=None,
                      record_iterations=True) as server:
        got = [o.token_ids for o in server.generate([p for p, _ in jobs], params)]
        # Every chunk fit the budget, and some prompt was longer: it was split.
        assert max(c for rec in server.iterations() for c in rec.chunk_sizes) <= 8 < max(len(p) for p, _ in jobs)
    with Server(str(model_dir), device="cpu", dtype="float32", max_batch_size=4, n_slots=800,
                max_num_batched_tokens=None) as local:
        want = [o.token_ids for o in local.generate([p for p, _ in jobs], params)]
    assert got == want


def test_bfloat16_logits_close_to_single_process(tiny_model_dir, local_models):
    model_dir = tiny_model_dir("llama")
    inputs = [([5, 9, 200, 31, 7, 1, 2], 0, 0), ([44, 45], 0, 100), ([8], 0, 300)]
    with start_server(model_dir, 2, 2, dtype="bfloat16") as server:
        got = forward_logits(server, inputs)
        outs = server.generate([ids for ids, _, _ in inputs], SamplingParams(max_tokens=6, ignore_eos=True))
        assert all(o.finish_reason == "length" for o in outs)
        assert server.stats()["dtype"] == "bfloat16"
    want = local_logits(local_models(model_dir, torch.bfloat16), inputs)
    ref = local_logits(local_models(model_dir), inputs)  # float32: how far bfloat16 itself is off
    # Sharding changes only the summation order of bfloat16 partial sums.
    assert (got - want).abs().max() <= 2 * (want - ref).abs().max() + 0.05
    assert (got - want).abs().mean() <= 0.02


# -- faults ---------------------------------------------------------------------------------------------
def test_killed_worker_fails_every_waiter_and_leaves_no_process(tiny_model_dir):
    server = start_server(tiny_model_dir("llama"), 2, 1, max_batch_size=4)
    workers = server.stats()["workers"]
    assert len(workers) == 2 and all(w["alive"] for w in workers)
    ids = [server.submit([7, i + 1, 9], SamplingParams(max_tokens=500, ignore_eos=True)) for i in range(6)]
    results: dict = {}

    def wait(rid):
        results[rid] = server.result(rid, timeout=60)

    waiters = [threading.Thread(target=wait, args=(rid,)) for rid in ids]
    for t in waiters:
        t.start()
    deadline = time.monotonic() + 60
    while server.stats()["generated_tokens"] < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(workers[1]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    for t in waiters:
        t.join(10)
    assert time.monotonic() - killed < 10 and not any(t.is_alive() for t in waiters)
    for rid in ids:
        out = results[rid]
        assert out.finish_reason == "error"
        assert "worker 1 (pipeline stage 0 of 1, tensor rank 1 of 2" in out.error and "SIGKILL" in out.error
    st = server.stats()
    assert not st["healthy"] and "worker 1" in st["error"] and st["running"] == 0 and st["slots_allocated"] == 0
    with pytest.raises(EngineDeadError, match="worker 1"):
        server.submit([1, 2, 3])
    # Over HTTP: /health turns 503 and a new completion gets 503 naming the worker.
    import asyncio

    import httpx

    from orca_ext.http.app import create_app

    async def ask():
        app = create_app(server, model_name="tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return (await c.get("/health"),
                    await c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2}))

    health, completion = asyncio.run(ask())
    assert health.status_code == 503 and "worker 1" in health.json()["detail"]
    assert completion.status_code == 503 and "worker 1" in completion.text
    server.shutdown()
    assert all(gone(w["pid"]) for w in workers)
    assert not {w["pid"] for w in workers} & {pid for pid, _ in children_of(os.getpid())}


def test_worker_exception_fails_the_batch_naming_the_worker(llama_pp2):
    """Runs last on the shared pipeline group: it breaks it."""
    server, _ = llama_pp2
    executor = server.executor
    rid = server.submit([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
    deadline = time.monotonic() + 60
    while server.stats()["generated_tokens"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    # A batch that did not come through the engine's input check reaches the workers: stage 0
    # rejects its KV slot.
    bad = [Request("bad", [5], SamplingParams(max_tokens=1))]
    future = executor.execute(ScheduledBatch(10**6, bad, [([5], 0, server.n_slots + 7)]))
    failure = executor.wait(future)
    assert "worker 0 (pipeline stage 0 of 2, tensor rank 0 of 1" in str(failure)
    assert f"failed in iteration {10**6}: ValueError: batch writes KV slot {server.n_slots + 7}" in str(failure)
    out = server.result(rid, timeout=10)
    assert out.finish_reason == "error" and "ValueError: batch writes KV slot" in out.error
    st = server.stats()
    assert not st["healthy"] and "worker 0" in st["error"]
    pids = [w["pid"] for w in st["workers"]]
    server.shutdown()
    assert all(gone(pid) for pid in pids)


# -- entry points ---------------------------------------------------------------------------------------
def test_serve_tp2_answers_the_openai_client(tiny_model_dir):
    import openai
    from http_utils import ServerProcess

    model_dir = tiny_model_dir("llama")
    with Server(str(model_dir), device="cpu", dtype="float32", n_slots=800) as local:
        want = local.generate("The capital of France is", SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    with ServerProcess("--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "-tp", "2",
                       "--n-slots", "800", env={"OMP_NUM_THREADS": "1"}) as proc:
        client = openai.OpenAI(base_url=proc.url("/v1"), api_key="none", max_retries=0, timeout=120)
        got = client.completions.create(model=Path(model_dir).name, prompt="The capital of France is",
                                        max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        workers = [pid for pid, cmd in children_of(proc.proc.pid) if "resource_tracker" not in cmd]
        assert len(workers) == 2
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in workers)


def test_two_torchrun_nodes_on_loopback(tiny_model_dir, tmp_path):
    """Multi-node path: two torchrun launches (--nnodes 2) rendezvous on 127.0.0.1; node 0 runs
    the driver and stage 0, node 1 runs stage 1."""
    import socket

    model_dir = tiny_model_dir("llama")
    with Server(str(model_dir), device="cpu", dtype="float32", n_slots=800) as local:
        want = local.generate("Once upon a time", SamplingParams(max_tokens=8))[0].text
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = ["generate", "Once upon a time", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
           "--no-chat", "--max-tokens", "8", "--n-slots", "800", "-pp", "2"]
    procs = []
    for node, nproc in ((0, 2), (1, 1)):
        log = open(tmp_path / f"node{node}.log", "w")
        procs.append(subprocess.Popen(
            [str(torchrun), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc),
             "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "orca_ext", *cmd],
            cwd=REPO, env=env, stdout=subprocess.PIPE if node == 0 else log, stderr=log, text=True))
    try:
        out, _ = procs[0].communicate(timeout=300)
        assert procs[1].wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert procs[0].returncode == 0, logs
    assert out.strip() == want.strip(), logs
