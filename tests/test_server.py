"""Server API (docs/DESIGN.md section 5) over the fake model: concurrency, streaming, asyncio, abort,
error isolation, validation, stop conditions, request-id lifecycle and slot accounting.

The fake model stores tokens in its KV slots and derives each next token from the request's
whole context read back from its slab, so `fake_reference` only matches if the engine passed the
right inputs and no two requests ever shared a slot.
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading
import time

import pytest

from fake_model import FakeModel, FakeSpec, FakeTokenizer, fake_reference
from orca_ext.config import EngineConfig
from orca_ext.engine import Engine
from orca_ext.executor import LocalExecutor
from orca_ext.errors import InvalidRequestError, ServerClosedError
from orca_ext.request import Request
from orca_ext.sampling import SamplingParams
from orca_ext.scheduler import make_scheduler
from orca_ext.server import Server

V = FakeSpec().vocab_size


def rand_prompt(rng: random.Random, lo=1, hi=30) -> list[int]:
    return [rng.randrange(V) for _ in range(rng.randint(lo, hi))]


def assert_idle(server: Server) -> None:
    st = server.stats()
    assert st["waiting"] == 0 and st["running"] == 0
    assert st["slots_reserved"] == 0 and st["slots_used"] == 0 and st["slots_allocated"] == 0


def check_monotone(snaps) -> None:
    for a, b in zip(snaps, snaps[1:]):
        assert b.token_ids[:len(a.token_ids)] == a.token_ids
        assert b.text.startswith(a.text)
        assert not a.finished
    assert snaps[-1].finished


# -- correctness under concurrency ----------------------------------------------------------------
def test_many_threads_with_staggered_arrivals_get_their_own_greedy_continuation(make_server):
    server = make_server(max_batch_size=5, n_slots=300, record_iterations=True)
    rng = random.Random(0)
    jobs = [(rand_prompt(rng), rng.randint(1, 25)) for _ in range(40)]
    results: dict[int, object] = {}

    def worker(i):
        time.sleep(random.Random(i).uniform(0, 0.02))
        prompt, n = jobs[i]
        results[i] = server.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (prompt, n) in enumerate(jobs):
        out = results[i]
        assert out.token_ids == fake_reference(prompt, n), i
        assert out.finish_reason == "length" and out.finished and out.error is None
        assert out.prompt_token_ids == prompt
        assert out.arrival_time <= out.first_token_time <= out.finish_time
    assert_idle(server)
    recs = server.iterations()
    assert all(len(r.request_ids) <= 5 and r.slots_reserved <= 300 for r in recs)
    assert server.stats()["finished"] == 40
    assert server.stats()["busy_seconds"] > 0  # engine steps are timed for the iteration-time metric


def test_generate_keeps_input_order_and_accepts_per_prompt_params(make_server):
    server = make_server()
    prompts = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 1, 9)]
    outs = server.generate(prompts, params)
    assert [o.token_ids for o in outs] == [fake_reference(p, n) for p, n in zip(prompts, (5, 1, 9))]
    single = server.generate([7, 7, 7], SamplingParams(max_tokens=3))  # a bare token list = one prompt
    assert len(single) == 1 and single[0].token_ids == fake_reference([7, 7, 7], 3)
    text = server.generate("abc", SamplingParams(max_tokens=2))[0]  # FakeTokenizer: a->26
    assert text.prompt_token_ids == [26, 27, 28]


def test_static_policy_gives_the_same_tokens(make_server):
    rng = random.Random(1)
    jobs = [(rand_prompt(rng), rng.randint(1, 12)) for _ in range(12)]
    server = make_server(scheduler="static", max_batch_size=4, record_iterations=True)
    outs = server.generate([p for p, _ in jobs], [SamplingParams(max_tokens=n) for _, n in jobs])
    assert [o.token_ids for o in outs] == [fake_reference(p, n) for p, n in jobs]
    assert_idle(server)
    assert server.stats()["scheduler"] == "static"


def test_iterations_mix_prefills_and_decodes_and_requests_join_mid_flight(make_server):
    gate = threading.Event()
    model = FakeModel(gate=gate)
    server = make_server(model, record_iterations=True)
    a = server.submit([1, 2, 3], SamplingParams(max_tokens=6))
    model.entered.wait(10)  # a's prefill is executing
    b = server.submit([4, 5], SamplingParams(max_tokens=3))
    gate.set()
    assert server.result(a).token_ids == fake_reference([1, 2, 3], 6)
    assert server.result(b).token_ids == fake_reference([4, 5], 3)
    recs = server.iterations()
    assert recs[0].request_ids == (a,) and recs[0].num_prefill_tokens == 3
    # b arrived during iteration 0 and joined iteration 1, next to a's decode.
    assert recs[1].request_ids == (a, b)
    assert (recs[1].num_prefill_tokens, recs[1].num_decode_tokens) == (2, 1)
    assert [r.index for r in recs] == list(range(len(recs)))
    assert recs[1].slots_reserved == 9 + 5


# -- streaming and asyncio ------------------------------------------------------------------------
def test_stream_snapshots_are_monotone_and_release_the_id(make_server):
    server = make_server()
    prompt = [10, 20, 30]
    rid = server.submit(prompt, SamplingParams(max_tokens=12), request_id="s1")
    snaps = list(server.stream(rid))
    check_monotone(snaps)
    want = fake_reference(prompt, 12)
    assert snaps[-1].token_ids == want
    assert snaps[-1].text == FakeTokenizer().decode(want)
    assert snaps[-1].finish_reason == "length"
    with pytest.raises(KeyError):  # delivered: the id is free again
        server.result("s1")
    assert server.submit(prompt, SamplingParams(max_tokens=2), request_id="s1") == "s1"
    assert server.result("s1").token_ids == want[:2]


class StepGate:
    """FakeModel's gate, one forward per `allow()`: the test decides how far the engine gets."""

    def __init__(self):
        self._steps = threading.Semaphore(0)

    def wait(self):
        assert self._steps.acquire(timeout=30), "the test never allowed this forward"

    def allow(self, n: int = 1):
        self._steps.release(n)


def test_leaving_a_stream_early_does_not_abort(make_server):
    gate = StepGate()
    server = make_server(FakeModel(gate=gate))
    rid = server.submit([5, 6], SamplingParams(max_tokens=20))
    gate.allow(1)  # only the first token exists when the stream is left
    for snap in server.stream(rid):
        assert not snap.finished and len(snap.token_ids) == 1
        break
    gate.allow(19)
    out = server.result(rid)
    assert out.finish_reason == "length" and out.token_ids == fake_reference([5, 6], 20)


def test_unknown_ids(make_server):
    server = make_server()
    with pytest.raises(KeyError):
        server.stream("nope")  # raised at the call, before iterating
    with pytest.raises(KeyError):
        server.result("nope")
    assert server.abort("nope") is False
    rid = server.submit([1], SamplingParams(max_tokens=2))
    server.result(rid)
    assert server.abort(rid) is False


def test_generate_async_from_many_tasks(make_server):
    server = make_server(max_batch_size=6)
    rng = random.Random(2)
    jobs = [(rand_prompt(rng), rng.randint(1, 20)) for _ in range(25)]

    async def one(prompt, n):
        await asyncio.sleep(rng.uniform(0, 0.01))
        snaps = [s async for s in server.generate_async(prompt, SamplingParams(max_tokens=n))]
        check_monotone(snaps)
        return snaps[-1]

    async def main():
        return await asyncio.gather(*(one(p, n) for p, n in jobs))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == [fake_reference(p, n) for p, n in jobs]
    assert_idle(server)


def test_leaving_generate_async_early_aborts_and_frees_everything(make_server):
    server = make_server()

    async def main():
        agen = server.generate_async([1, 2], SamplingParams(max_tokens=500), request_id="early")
        async for snap in agen:
            assert not snap.finished
            break
        await agen.aclose()

    asyncio.run(main())
    assert server.stats()["running"] == 0  # aborted (its slab returns when its batch does)
    assert server.submit([3], SamplingParams(max_tokens=1), request_id="early") == "early"
    server.result("early")  # the loop has moved on: the aborted slab is back
    assert_idle(server)


def test_stream_async_of_a_submitted_request(make_server):
    server = make_server()
    rid = server.submit([8, 8], SamplingParams(max_tokens=7))

    async def main():
        return [s async for s in server.stream_async(rid)]

    snaps = asyncio.run(main())
    check_monotone(snaps)
    assert snaps[-1].token_ids == fake_reference([8, 8], 7)


# -- abort ----------------------------------------------------------------------------------------
def test_abort_waiting_and_running_requests(make_server):
    gate = threading.Event()
    model = FakeModel(gate=gate)
    server = make_server(model, max_batch_size=1, n_slots=100)
    a = server.submit([1, 2, 3], SamplingParams(max_tokens=40))
    model.entered.wait(10)  # a's first iteration is executing
    b = server.submit([4, 5], SamplingParams(max_tokens=40))  # waits: max_batch_size 1
    st = server.stats()
    assert st["waiting"] == 1 and st["running"] == 1 and st["slots_reserved"] == 43
    assert server.abort(b) is True
    out_b = server.result(b, timeout=30)
    assert out_b.finish_reason == "abort" and out_b.token_ids == []
    assert server.abort(a) is True
    out_a = server.result(a, timeout=30)  # delivered at once, the batch is still executing
    assert out_a.finish_reason == "abort"
    # a's slab is still being written by the running batch: not freed yet.
    assert server.stats()["slots_reserved"] == 43
    gate.set()
    c = server.submit([7], SamplingParams(max_tokens=3))
    assert server.result(c).token_ids == fake_reference([7], 3)
    assert_idle(server)
    assert server.abort(a) is False


# -- error isolation ------------------------------------------------------------------------------
def test_non_finite_logits_fail_only_that_request(make_server):
    poison = 99
    server = make_server(FakeModel(nan_token=poison), max_batch_size=8)
    rng = random.Random(3)
    good = [[t for t in rand_prompt(rng) if t != poison] or [1] for _ in range(5)]
    good = [p for p in good if poison not in fake_reference(p, 10)]
    ids = [server.submit(p, SamplingParams(max_tokens=10)) for p in good[:2]]
    bad = server.submit([1, poison, 2], SamplingParams(max_tokens=10))
    ids += [server.submit(p, SamplingParams(max_tokens=10)) for p in good[2:]]
    out = server.result(bad)
    assert out.finish_reason == "error" and "non-finite" in out.error and out.token_ids == []
    for rid, p in zip(ids, good):
        o = server.result(rid)
        assert o.finish_reason == "length" and o.token_ids == fake_reference(p, 10)
    assert_idle(server)


def test_forward_exception_fails_its_batch_and_the_loop_continues(make_server, caplog):
    fail = 98
    gate = threading.Event()
    model = FakeModel(fail_token=fail, gate=gate)
    server = make_server(model)
    first = server.submit([1, 2], SamplingParams(max_tokens=5))
    model.entered.wait(10)
    # Both join the next iteration; fail's prefill makes that whole forward raise.
    victim = server.submit([3, fail], SamplingParams(max_tokens=5))
    with caplog.at_level(logging.ERROR, logger="orca_ext.engine"):
        gate.set()
        assert server.result(victim).finish_reason == "error"
        out = server.result(first)
    assert out.finish_reason == "error" and "injected forward failure" in out.error
    assert any("failed" in r.message for r in caplog.records)
    after = server.submit([4, 5], SamplingParams(max_tokens=4))
    assert server.result(after).token_ids == fake_reference([4, 5], 4)
    assert_idle(server)


def test_detokenizer_failure_fails_only_that_request(make_server):
    rng = random.Random(4)
    target = [11, 12, 13]
    bad_token = fake_reference(target, 4)[2]
    others = []
    while len(others) < 4:
        p = rand_prompt(rng)
        if bad_token not in fake_reference(p, 6) and bad_token not in p:
            others.append(p)
    server = make_server(tokenizer=FakeTokenizer(bad_token=bad_token))
    rid = server.submit(target, SamplingParams(max_tokens=4))
    oids = [server.submit(p, SamplingParams(max_tokens=6)) for p in others]
    out = server.result(rid)
    assert out.finish_reason == "error" and "injected detokenizer failure" in out.error
    assert len(out.token_ids) == 3  # it failed on its third token
    for oid, p in zip(oids, others):
        assert server.result(oid).token_ids == fake_reference(p, 6)
    assert_idle(server)


# -- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, params, field", [
    ("", None, "prompt"),
    ([], None, "prompt"),
    ([1, V], None, r"prompt\[1\].*\[0, 101\)"),
    ([-1], None, r"prompt\[0\].*\[0, 101\)"),
    ([1, 2.5], None, r"prompt\[1\]"),
    (7, None, "prompt"),
    ([1] * 40, SamplingParams(max_tokens=30), r"max_model_len = 64"),
    ([1] * 61, SamplingParams(max_tokens=4), r"max_model_len = 64"),  # 65 > 64
    ([1], SamplingParams(stop_token_ids=[V]), r"stop_token_ids\[0\]"),
    ([1], {"max_tokens": 3}, "params"),
])
def test_invalid_requests_are_rejected_at_submit(make_server, prompt, params, field):
    server = make_server(max_model_len=64, n_slots=100)
    with pytest.raises(InvalidRequestError, match=field):
        server.submit(prompt, params)
    st = server.stats()
    assert st["waiting"] == 0 and st["iterations"] == 0  # nothing reached the loop


def test_limits_name_n_slots_and_sampling_fields(make_server):
    server = make_server(n_slots=50)  # max_model_len defaults to min(4096, n_slots) = 50
    assert server.max_model_len == 50
    server2 = make_server(n_slots=50, max_model_len=100)
    with pytest.raises(InvalidRequestError, match="n_slots = 50"):
        server2.submit([1] * 40, SamplingParams(max_tokens=20))
    for kwargs, field in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                          (dict(temperature=float("nan")), "temperature"), (dict(top_p=0), "top_p"),
                          (dict(top_p=1.01), "top_p"), (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop"),
                          (dict(stop=[None]), "stop")]:
        with pytest.raises(InvalidRequestError, match=field):
            server.submit([1], SamplingParams(**kwargs))


def test_duplicate_request_id_and_closed_server(make_server):
    gate = threading.Event()
    server = make_server(FakeModel(gate=gate))
    server.submit([1], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(InvalidRequestError, match="dup"):
        server.submit([2], request_id="dup")
    with pytest.raises(InvalidRequestError, match="request_id"):
        server.submit([2], request_id="")
    gate.set()
    server.result("dup")
    server.shutdown()
    with pytest.raises(ServerClosedError):
        server.submit([1])
    server.shutdown()  # idempotent


def test_stop_strings_need_a_tokenizer():
    server = Server(FakeModel(), n_slots=100)
    try:
        with pytest.raises(InvalidRequestError, match="stop"):
            server.submit([1], SamplingParams(stop=["x"]))
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            server.submit("abc")
        assert server.generate([[1, 2]], SamplingParams(max_tokens=3))[0].token_ids == fake_reference([1, 2], 3)
    finally:
        server.shutdown()


# -- stop conditions ------------------------------------------------------------------------------
def test_stop_string_is_excluded_and_streamed_text_never_shows_it(make_server):
    tok = FakeTokenizer()
    prompt = [30, 31, 32]
    want = fake_reference(prompt, 20)
    stop = tok.decode(want[5:7])  # the text of tokens 5 and 6
    first = tok.decode(want).find(stop)
    server = make_server(tokenizer=tok)
    rid = server.submit(prompt, SamplingParams(max_tokens=20, stop=["zzzzzzzz", stop]))
    snaps = list(server.stream(rid))
    check_monotone(snaps)
    out = snaps[-1]
    assert out.finish_reason == "stop"
    assert out.text == tok.decode(want)[:first]
    end = len(tok.decode(want)[:first + len(stop)])  # the token that completed the stop string
    assert out.token_ids == want[:end]
    assert all(stop not in s.text for s in snaps)


def test_stop_token_ids_and_eos(make_server):
    prompt = [40, 41]
    want = fake_reference(prompt, 12)
    stop_tok = want[3]
    k = want.index(stop_tok)
    server = make_server()
    out = server.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == want[:k + 1]
    assert out.text == FakeTokenizer().decode(want[:k])  # the stop token adds no text
    # EOS from the model config stops unless ignore_eos.
    eos = want[5]
    k = want.index(eos)
    eos_server = make_server(FakeModel(FakeSpec(eos_token_ids=(eos,))))
    out = eos_server.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert out.finish_reason == "stop" and out.token_ids == want[:k + 1]
    out = eos_server.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == want
    # The tokenizer's eos counts too.
    tok_server = make_server(tokenizer=FakeTokenizer(eos_token_id=eos))
    out = tok_server.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert out.token_ids == want[:k + 1]


# -- sampling -----------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_regardless_of_batch_mates(make_server):
    server = make_server(FakeModel(spread=10.0))
    params = SamplingParams(max_tokens=25, temperature=1.0, top_k=20, seed=77)
    alone = server.generate([[1, 2, 3]], params)[0].token_ids
    assert alone != fake_reference([1, 2, 3], 25)  # it really sampled
    rng = random.Random(5)
    mates = [server.submit(rand_prompt(rng), SamplingParams(max_tokens=rng.randint(1, 30),
                                                          temperature=rng.choice([0.0, 0.8, 1.5])))
             for _ in range(6)]
    rid = server.submit([1, 2, 3], params)
    mates += [server.submit(rand_prompt(rng), SamplingParams(max_tokens=10, temperature=1.0, seed=3))
              for _ in range(3)]
    assert server.result(rid).token_ids == alone
    for m in mates:
        server.result(m)
    other = server.generate([[1, 2, 3]], SamplingParams(max_tokens=25, temperature=1.0, top_k=20, seed=78))
    assert other[0].token_ids != alone


# -- lifecycle and bookkeeping -------------------------------------------------------------------
def test_shutdown_aborts_pending_requests_and_wakes_every_waiter(make_server):
    gate = threading.Event()
    model = FakeModel(gate=gate)
    server = make_server(model, max_batch_size=2)
    ids = [server.submit([i + 1], SamplingParams(max_tokens=50)) for i in range(5)]
    model.entered.wait(10)
    got = {}

    def wait(rid):
        got[rid] = server.result(rid)

    waiters = [threading.Thread(target=wait, args=(rid,)) for rid in ids]
    for t in waiters:
        t.start()
    stopper = threading.Thread(target=server.shutdown)
    stopper.start()
    gate.set()  # let the executing batch return so the loop can stop
    stopper.join(30)
    for t in waiters:
        t.join(30)
    assert not stopper.is_alive() and not any(t.is_alive() for t in waiters)
    assert all(got[rid].finish_reason == "abort" for rid in ids)
    assert_idle(server)
    assert server.stats()["closed"] is True


def test_undelivered_outputs_are_bounded(make_server, caplog):
    server = make_server(max_batch_size=1, max_undelivered_outputs=3)
    ids = [server.submit([i + 1], SamplingParams(max_tokens=2)) for i in range(5)]
    last = server.submit([9], SamplingParams(max_tokens=1))
    with caplog.at_level(logging.WARNING, logger="orca_ext.delivery"):
        server.result(last)  # FCFS with batch size 1: all earlier requests have finished
    assert sum("dropping" in r.message for r in caplog.records) == 1  # later drops are summarised
    assert server.stats()["dropped_outputs"] == 2
    for rid in ids[:2]:
        with pytest.raises(KeyError):
            server.result(rid)
    for i, rid in enumerate(ids[2:], start=2):
        assert server.result(rid).token_ids == fake_reference([i + 1], 2)
    assert server.stats()["undelivered_outputs"] == 0


def test_engine_with_two_batches_in_flight():
    model = FakeModel()
    sched = make_scheduler(EngineConfig(max_batch_size=3, max_num_batched_tokens=None), 500, n_workers=2)
    engine = Engine(LocalExecutor(model), sched, record_iterations=True)
    rng = random.Random(6)
    jobs = [(rand_prompt(rng), rng.randint(1, 9)) for _ in range(10)]
    reqs = [Request(f"e{i}", p, SamplingParams(max_tokens=n)) for i, (p, n) in enumerate(jobs)]
    for r in reqs:
        engine.add_request(r)
    in_flight_at_completion = []
    complete = sched.complete

    def counting_complete(batch):
        in_flight_at_completion.append(sched.n_scheduled)
        complete(batch)

    sched.complete = counting_complete
    while engine.has_work():
        engine.step()
    # Each batch is postprocessed only once a second one (of other requests) has been launched,
    # except the last ones, when nothing else can be selected.
    assert max(in_flight_at_completion) == 2
    assert in_flight_at_completion.count(2) >= len(in_flight_at_completion) // 2
    for r, (p, n) in zip(reqs, jobs):
        assert r.output_token_ids == fake_reference(p, n)
    recs = engine.records
    assert set(recs[0].request_ids).isdisjoint(recs[1].request_ids)
    assert sched.n_rsrv == 0 and sched.allocator.n_used == 0 and sched.n_scheduled == 0


def test_kv_budget_sizes_n_slots(make_server, monkeypatch):
    server = make_server(n_slots=None, kv_cache_memory="800", max_batch_size=4)
    assert server.n_slots == 100 and server.stats()["n_slots"] == 100  # 8 bytes per fake slot
    assert server.max_model_len == 100
    monkeypatch.setenv("ORCA_EXT_KV_CACHE_MEMORY", "1KiB")
    assert make_server(n_slots=None).n_slots == 128
    capped = make_server(n_slots=None, kv_cache_memory="1GiB", max_batch_size=2, max_model_len=300)
    assert capped.n_slots == 600  # never more than max_batch_size full-length requests
    with pytest.raises(ValueError, match="kv_cache_memory"):
        Server(FakeModel(), kv_cache_memory="lots")
    monkeypatch.setenv("ORCA_EXT_KV_CACHE_MEMORY", "4")
    with pytest.raises(ValueError, match="holds no KV slot"):
        Server(FakeModel())


def test_bad_server_configuration():
    with pytest.raises(ValueError, match="max_batch_size"):
        Server(FakeModel(), max_batch_size=0)
    with pytest.raises(ValueError, match="scheduler"):
        Server(FakeModel(), scheduler="fifo", n_slots=10)
    with pytest.raises(ValueError, match="max_model_len"):
        Server(FakeModel(), max_model_len=10**6, n_slots=10)
    with pytest.raises(ValueError, match="device"):
        Server("/nonexistent-model-folder", device="tpu")
    with pytest.raises(ValueError, match="dtype"):
        Server("/nonexistent-model-folder", device="cpu", dtype="int8")


def test_model_folder_without_tokenizer_serves_token_ids(tiny_model_dir, tmp_path):
    import shutil

    src = tiny_model_dir("mistral")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(src / name, bare / name)
    with Server(str(bare), device="cpu", n_slots=64) as server:
        assert server.tokenizer is None
        out = server.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3 and out.text == ""
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            server.submit("text")


def test_one_thread_loads_allocates_and_runs_the_model():
    """The kernels' OpenMP pools are per calling thread: the model's load, its KV allocation and
    every forward run on the Server's loop thread, not on the thread that built the Server."""
    seen = {}

    class Recording(FakeModel):
        def allocate_kv_cache(self, n_slots):
            seen.setdefault("allocate", threading.current_thread())
            return super().allocate_kv_cache(n_slots)

        def forward(self, batch):
            seen.setdefault("forward", threading.current_thread())
            return super().forward(batch)

    with Server(Recording(), n_slots=64) as server:
        server.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert seen["allocate"] is server._thread and seen["forward"] is server._thread
        assert server._thread is not threading.current_thread()


def test_a_failed_start_leaves_no_loop_thread():
    def loops() -> int:
        return sum(t.name == "orca-engine-loop" for t in threading.enumerate())

    class NoMemory(FakeModel):
        def allocate_kv_cache(self, n_slots):
            raise MemoryError("no room for the KV cache")

    before = loops()
    with pytest.raises(MemoryError, match="no room"):
        Server(NoMemory(), n_slots=64)
    deadline = time.monotonic() + 10
    while loops() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loops() == before


def test_shutdown_puts_back_the_kernel_modes_it_replaced(make_server):
    """A server's modes are in force while it runs; at shutdown it puts back the ones it found,
    unless modes were set since (by a later server), which then stay. A failed start puts them
    back too."""
    from orca_ext import modes

    class NoMemory(FakeModel):
        def allocate_kv_cache(self, n_slots):
            raise MemoryError("no room for the KV cache")

    found = modes.current()
    assert not found.batch_invariant
    with pytest.raises(MemoryError):
        Server(NoMemory(), n_slots=64, batch_invariant=True)
    assert modes.current() is found
    first = make_server(batch_invariant=True)
    assert modes.current().batch_invariant
    second = make_server(batch_invariant=True)   # equal modes, set anew
    first.shutdown()
    assert modes.current().batch_invariant       # the second server's modes stay
    second.shutdown()
    assert modes.current().batch_invariant       # what the second one found: the first's
    inner_found = modes.current()
    inner = make_server(batch_invariant=False)
    assert not modes.current().batch_invariant
    inner.shutdown()
    inner.shutdown()                              # idempotent: nothing changes
    assert modes.current() is inner_found
