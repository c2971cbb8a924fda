"""Prefix caching (orca_ext/prefix_cache.py and the scheduler's admission with hits).

The index alone: a block's key names its whole prefix, lookups find the longest cached prefix
(across block edges, never past the limit, never from rows whose tokens differ), entries leave
in least recently used order, and one client holds at most its share.

Through the engine with the fake model, whose next token is a hash of the whole context read
back from the request's slab: random traffic with shared prefixes, chat continuations and
evictions must give every request the tokens of `fake_reference`, so every copied row was the
right one, and an admission never waits while cache entries hold the slots it needs.
"""
from __future__ import annotations

import random

import pytest

from fake_model import FakeModel, fake_reference
from orca_ext.config import EngineConfig
from orca_ext.engine import Engine
from orca_ext.executor import LocalExecutor
from orca_ext.options import add_engine_arguments
from orca_ext.prefix_cache import PrefixCache, block_keys
from orca_ext.request import Request
from orca_ext.sampling import SamplingParams
from orca_ext.scheduler import make_scheduler


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100) for _ in range(n)]


# -- the index ----------------------------------------------------------------------------------
def test_a_block_key_depends_on_every_token_before_it():
    rng = random.Random(0)
    a = toks(rng, 50)
    keys = block_keys(a, 8)
    assert len(keys) == 6 and len(set(keys)) == 6
    for i in (0, 7, 8, 47):
        b = list(a)
        b[i] = (b[i] + 1) % 100
        other = block_keys(b, 8)
        first = i // 8
        assert other[:first] == keys[:first] and all(x != y for x, y in zip(other[first:], keys[first:]))
    assert block_keys(a[:48], 8) == keys  # the tail past the last full block adds no key


def test_lookup_finds_the_longest_prefix_across_block_edges_within_the_limit():
    rng = random.Random(1)
    cache = PrefixCache(1000, block_size=8)
    held = toks(rng, 37)
    cache.insert(0, held)
    for n_common in (0, 5, 8, 13, 16, 30, 37):
        prompt = held[:n_common] + [100 + i for i in range(10)]  # token 100+ is never in `held`
        hit = cache.lookup(prompt, len(prompt) - 1)
        expect = n_common if n_common >= 8 else 0
        assert (hit.n_tokens if hit else 0) == expect, n_common
    hit = cache.lookup(held, len(held) - 1)  # the whole entry: one token is left to compute
    assert hit.n_tokens == 36
    assert cache.lookup(held, 20).n_tokens == 20
    assert cache.lookup(held, 7) is None  # not even one block within the limit


def test_a_digest_collision_never_hands_out_other_tokens(monkeypatch):
    import orca_ext.prefix_cache as pc

    monkeypatch.setattr(pc, "block_keys", lambda tokens, bs, n=None: [b"same"] * min(len(tokens) // bs, n or 99))
    cache = pc.PrefixCache(100, block_size=4)
    cache.insert(0, [1, 2, 3, 4, 5])
    assert cache.lookup([9, 9, 9, 9, 9, 9], 5) is None
    assert cache.lookup([1, 2, 3, 4, 5, 6], 5).n_tokens == 5


def test_entries_leave_in_lru_order_and_a_hit_refreshes_its_entry():
    cache = PrefixCache(1000, block_size=4)
    a, b, c = ([k] * 8 for k in (1, 2, 3))
    for start, t in zip((0, 100, 200), (a, b, c)):
        cache.insert(start, t)
    cache.record_lookup(cache.lookup(a + [0], 8), used=True)
    assert [cache.evict_lru().tokens[0] for _ in range(3)] == [2, 3, 1]
    assert cache.evict_lru() is None and cache.cached_slots == 0 and not cache.index
    assert cache.stats.evictions == 3 and cache.stats.hits == 1 and cache.stats.hit_tokens == 8


def test_a_newer_entry_supersedes_the_ones_it_contains():
    cache = PrefixCache(1000, block_size=4)
    turn1 = list(range(10))
    cache.insert(0, turn1)
    dropped = cache.insert(50, turn1 + [7, 7, 7, 7, 7])
    assert [e.slab_start for e in dropped] == [0] and len(cache) == 1 and cache.stats.superseded == 1
    assert not cache.worth_caching(turn1)  # adds no block the index lacks
    assert cache.worth_caching(turn1 + [8] * 10)


def test_one_client_holds_at_most_its_share_of_the_slots():
    cache = PrefixCache(100, block_size=4)
    cache.insert(0, [1] * 30, client="a")
    dropped = cache.insert(30, [2] * 30, client="a")  # a lone client may hold every slot
    assert not dropped
    dropped = cache.insert(60, [3] * 30, client="b")   # two clients: 50 slots each
    assert [e.slab_start for e in dropped] == []
    assert cache.slots_by_client == {"a": 60, "b": 30}
    dropped = cache.insert(90, [4] * 8, client="b")
    assert not dropped
    dropped = cache.insert(200, [5] * 40, client="b")  # b: 78 > 50: its own oldest go first
    assert [e.slab_start for e in dropped] == [60]
    assert cache.slots_by_client["b"] == 48 and cache.stats.share_evictions == 1
    dropped = cache.insert(300, [6] * 60, client="b")  # alone larger than the share: not kept
    assert [e.slab_start for e in dropped] == [90, 200, 300] and "b" not in cache.slots_by_client
    assert cache.slots_by_client == {"a": 60}


def test_block_size_is_checked():
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(10, block_size=0)
    with pytest.raises(ValueError, match="prefix_cache_block_size"):
        EngineConfig(prefix_cache_block_size=0)
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineConfig(prefix_caching="yes")


def test_command_line_switches_it_off():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args([])).prefix_caching is True
    cfg = EngineConfig.from_args(parser.parse_args(["--no-prefix-caching", "--prefix-cache-block-size", "32"]))
    assert cfg.prefix_caching is False and cfg.prefix_cache_block_size == 32


# -- through the engine ---------------------------------------------------------------------------
def make_engine(n_slots: int, *, budget=16, block_size=8, cache=True, max_bs=4, policy="orca"):
    config = EngineConfig(max_batch_size=max_bs, max_num_batched_tokens=budget, scheduler=policy)
    sched = make_scheduler(config, n_slots)
    return Engine(LocalExecutor(FakeModel()), sched,
                  prefix_cache=PrefixCache(n_slots, block_size) if cache else None)


def check_no_admission_waits_on_the_cache(sched):
    """Wrap admission: a refused request must be refused with an empty cache too."""
    admit = sched._admit

    def checked(req):
        ok = admit(req)
        if not ok and sched.n_rsrv + req.reservation <= sched.n_slots:
            assert len(sched.prefix_cache) == 0, "an admission waited while cache entries held slots"
        return ok

    sched._admit = checked


@pytest.mark.parametrize("policy,budget", [("orca", None), ("orca", 16), ("static", None)])
@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefix_traffic_gives_every_request_its_own_tokens(seed, policy, budget):
    rng = random.Random(seed)
    n_slots = rng.choice([120, 300])
    engine = make_engine(n_slots, budget=budget, block_size=rng.choice([4, 8, 16]), policy=policy)
    sched = engine.scheduler
    check_no_admission_waits_on_the_cache(sched)
    systems = [toks(rng, rng.randint(5, 40)) for _ in range(3)]
    reqs: list[Request] = []
    for i in range(40):
        kind = rng.random()
        done = [r for r in reqs if r.finish_reason == "length"]
        if kind < 0.3 and done:  # the next turn of a finished chat
            prev = rng.choice(done)
            prompt = prev.prompt_token_ids + prev.output_token_ids + toks(rng, rng.randint(1, 6))
        elif kind < 0.5 and reqs:  # the same prompt again
            prompt = list(rng.choice(reqs).prompt_token_ids)
        else:
            prompt = rng.choice(systems)[:rng.randint(1, 40)] + toks(rng, rng.randint(1, 10))
        max_tokens = rng.randint(1, 8)
        if len(prompt) + max_tokens > n_slots // 2:
            continue
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        reqs.append(r)
        engine.add_request(r)
        if rng.random() < 0.1 and len(reqs) > 1:
            engine.abort_request(rng.choice(reqs))
        for _ in range(rng.randint(0, 6)):
            engine.step()
    while engine.has_work():
        engine.step()
    for r in reqs:
        if r.finish_reason == "length":
            assert r.output_token_ids == fake_reference(r.prompt_token_ids, r.params.max_tokens), r
    stats = sched.prefix_cache.stats
    assert stats.hits > 0 and stats.hit_tokens == sum(r.num_prefix_hit for r in reqs)
    assert sched.n_rsrv == 0 and sched.slots_allocated == 0
    assert sched.allocator.n_used == sched.prefix_cache.cached_slots
    for entry in sched.prefix_cache.entries:  # every entry's rows hold its tokens
        rows = engine.executor.model.cache[entry.slab_start:entry.slab_start + entry.num_cached]
        assert rows.tolist() == list(entry.tokens)
    sched.clear_prefix_cache()
    assert sched.allocator.n_used == 0


def test_a_hit_prefills_only_the_rest_and_counts_only_that_against_the_budget():
    engine = make_engine(500, budget=16, block_size=8)
    engine.record_iterations = True
    rng = random.Random(5)
    prompt = toks(rng, 60)
    first = Request("first", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request(first)
    while engine.has_work():
        engine.step()
    again = Request("again", prompt[:50] + [100, 100, 100], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request(again)
    while engine.has_work():
        engine.step()
    assert again.num_prefix_hit == 50 and again.snapshot().num_cached_tokens == 50
    assert again.output_token_ids == fake_reference(again.prompt_token_ids, 3)
    prefill = [rec for rec in engine.records if rec.request_ids == ("again",)][0]
    assert prefill.num_prefill_tokens == 3  # one iteration: the three new tokens, no recompute


def test_requests_that_arrive_together_copy_the_prefix_the_first_computed():
    engine = make_engine(500, budget=16, block_size=8)
    system = toks(random.Random(3), 50)
    reqs = [Request(f"r{i}", system + [100, i], SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(3)]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    stats = engine.scheduler.prefix_cache.stats
    assert reqs[0].num_prefix_hit == 0 and reqs[1].num_prefix_hit >= 40 and reqs[2].num_prefix_hit >= 40
    assert stats.live_hits == 2 and stats.hits == 2
    for r in reqs:
        assert r.output_token_ids == fake_reference(r.prompt_token_ids, 3)


def test_a_full_hit_still_computes_the_last_prompt_token():
    engine = make_engine(500, block_size=4)
    prompt = list(range(1, 21))
    for rid in ("a", "b"):
        r = Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        engine.add_request(r)
        while engine.has_work():
            engine.step()
        assert r.output_token_ids == fake_reference(prompt, 2)
    assert r.num_prefix_hit == 19


def test_a_request_that_opts_out_takes_no_hit(monkeypatch):
    engine = make_engine(500, block_size=4)
    prompt = list(range(1, 30))
    for rid in ("a", "b"):
        r = Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        if rid == "b":
            monkeypatch.setattr(Request, "prefix_cache_limit", property(lambda self: 0))
        engine.add_request(r)
        while engine.has_work():
            engine.step()
    assert r.num_prefix_hit == 0 and r.output_token_ids == fake_reference(prompt, 2)


def test_the_hit_entry_is_taken_over_when_only_its_slots_are_left():
    """The cache is full of one entry; a request that hits it needs those very slots: it is
    evicted and the slab lands on its rows (or they are copied down), never recomputed."""
    engine = make_engine(40, budget=None, block_size=4)
    prompt = list(range(1, 31))
    a = Request("a", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request(a)
    while engine.has_work():
        engine.step()
    b = Request("b", prompt + [7], SamplingParams(max_tokens=9, ignore_eos=True))  # 40 slots: all
    engine.add_request(b)
    while engine.has_work():
        engine.step()
    assert b.num_prefix_hit == 30 and b.output_token_ids == fake_reference(b.prompt_token_ids, 9)


def test_an_error_leaves_nothing_in_the_cache():
    sched = make_scheduler(EngineConfig(max_batch_size=4, max_num_batched_tokens=None), 200)
    engine = Engine(LocalExecutor(FakeModel(fail_token=99)), sched, prefix_cache=PrefixCache(200, 4))
    r = Request("a", list(range(20)) + [99], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request(r)
    while engine.has_work():
        engine.step()
    assert r.finish_reason == "error" and len(sched.prefix_cache) == 0 and sched.allocator.n_used == 0


def test_server_reports_the_cache_and_can_switch_it_off():
    from orca_ext.server import Server

    prompt = list(range(1, 40))
    for on in (True, False):
        server = Server(FakeModel(), prefix_caching=on, n_slots=400, max_batch_size=4)
        try:
            outs = [server.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))[0] for _ in range(2)]
            st = server.stats()
        finally:
            server.shutdown()
        assert outs[0].token_ids == outs[1].token_ids == fake_reference(prompt, 4)
        assert st["slots_allocated"] == 0
        if on:
            pc = st["prefix_cache"]
            # blocks of 16: two match, the rest of the prompt extends the hit (one token computed)
            assert outs[1].num_cached_tokens == 38 and outs[0].num_cached_tokens == 0
            assert pc["lookups"] == 2 and pc["hits"] == 1 and pc["hit_tokens"] == 38
            assert pc["entries"] == 1 and pc["cached_tokens"] == 42 and pc["cached_bytes"] == 42 * 8
        else:
            assert st["prefix_cache"] is None and outs[1].num_cached_tokens == 0


def test_openai_usage_and_metrics_report_cached_tokens(make_server):
    """Through the HTTP app and the openai client: the second identical prompt reports its
    cached prompt tokens in usage.prompt_tokens_details, streamed or not; /metrics counts them."""
    from prometheus_client.parser import text_string_to_metric_families

    import asyncio

    import httpx
    import openai

    from orca_ext.http import create_app

    server = make_server(n_slots=400, max_model_len=200)
    app = create_app(server, model_name="m", max_queue=4, public_metrics=True, metrics_interval=0)
    prompt = list(range(1, 41))

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="none", max_retries=0, http_client=http)
            return await requests(client, http)

    async def requests(client, http):
        first = await client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0)
        second = await client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0)
        stream = await client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        usage = [c.usage async for c in stream if c.usage is not None]
        metrics = await http.get("/metrics")
        return first, second, usage, metrics.text

    first, second, streamed, metrics = asyncio.run(calls())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 39  # all but the last prompt token
    assert streamed[-1].prompt_tokens_details.cached_tokens == 39
    assert second.choices[0].text == first.choices[0].text
    values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert values["orca_prefix_cache_hit_tokens_total"] == 78 and values["orca_prefix_cache_lookups_total"] == 3
    assert values["orca_prefix_cache_entries"] == 1


def test_fair_admission_charges_only_the_computed_prompt_tokens():
    config = EngineConfig(max_batch_size=4, max_num_batched_tokens=16, admission="fair").scheduling_for("cpu")
    sched = make_scheduler(config, 300)
    engine = Engine(LocalExecutor(FakeModel()), sched, prefix_cache=PrefixCache(300, 8))
    charged = []
    take = sched.shares.take

    def spy(req, n_tokens):
        n = take(req, n_tokens)
        if req.prompt_remaining:
            charged.append((req.request_id, n, req.num_cached))
        return n

    sched.shares.take = spy
    prompt = list(range(1, 41))
    for rid, client in (("a", "x"), ("b", "y")):
        engine.add_request(Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True), client=client))
        while engine.has_work():
            engine.step()
    assert [c for c in charged if c[0] == "a"] == [("a", 16, 0), ("a", 16, 16), ("a", 8, 32)]
    assert [c for c in charged if c[0] == "b"] == [("b", 1, 39)]  # one token, at its position


def test_an_admission_evicts_its_own_clients_entries_before_anyone_elses():
    cache = PrefixCache(1000, block_size=4)
    cache.insert(0, [1] * 8, client="victim")
    cache.insert(10, [2] * 8, client="thrasher")
    cache.insert(20, [3] * 8, client="thrasher")
    assert cache.evict_lru(client="thrasher").slab_start == 10
    assert cache.evict_lru(client="thrasher").slab_start == 20
    assert cache.evict_lru(client="thrasher").slab_start == 0  # only then the others', LRU
    cache.insert(0, [1] * 8, client="victim")
    assert cache.evict_lru(client="nobody").slab_start == 0


def test_a_cache_thrashing_client_leaves_the_others_entries_alone():
    """A client sending unique prompts back to back (each leaves an entry) never pushes out
    another client's entry while its own entries can make room."""
    n_slots = 150  # the victim's entry (42) + one of the thrasher's (61) leave too little for the next
    sched = make_scheduler(EngineConfig(max_batch_size=4, max_num_batched_tokens=16), n_slots)
    engine = Engine(LocalExecutor(FakeModel()), sched, prefix_cache=PrefixCache(n_slots, 8))
    rng = random.Random(9)
    system = toks(rng, 40)
    victim = Request("v0", system + [1], SamplingParams(max_tokens=2, ignore_eos=True), client="victim")
    engine.add_request(victim)
    while engine.has_work():
        engine.step()
    for i in range(30):
        r = Request(f"t{i}", toks(rng, 60), SamplingParams(max_tokens=2, ignore_eos=True), client="thrasher")
        engine.add_request(r)
        while engine.has_work():
            engine.step()
        held = sched.prefix_cache.slots_by_client
        assert held.get("thrasher", 0) <= n_slots // 2 and held.get("victim") == 42
    again = Request("v1", system + [2], SamplingParams(max_tokens=2, ignore_eos=True), client="victim")
    engine.add_request(again)
    while engine.has_work():
        engine.step()
    assert again.num_prefix_hit == 40 and again.output_token_ids == fake_reference(again.prompt_token_ids, 2)
    assert sched.prefix_cache.stats.evictions >= 29


def test_compaction_carries_cache_entries_with_their_rows():
    engine = make_engine(300, budget=None, block_size=4)
    sched = engine.scheduler
    rng = random.Random(4)
    prompts = [toks(rng, 20) for _ in range(3)]
    for i, p in enumerate(prompts):
        r = Request(f"r{i}", p, SamplingParams(max_tokens=2, ignore_eos=True))
        engine.add_request(r)
        while engine.has_work():
            engine.step()
    first = next(iter(sched.prefix_cache.entries))
    sched.prefix_cache.evict(first)  # a hole before the other entries
    sched.allocator.free(first.slab_start)
    before = {e: e.slab_start for e in sched.prefix_cache.entries}
    assert sched._compact() and sched.allocator.n_free_runs == 1
    assert any(e.slab_start != start for e, start in before.items())
    for e in sched.prefix_cache.entries:
        assert engine.executor.model.cache[e.slab_start:e.slab_start + e.num_cached].tolist() == list(e.tokens)
    again = Request("again", prompts[2] + [100], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request(again)
    while engine.has_work():
        engine.step()
    assert again.num_prefix_hit == 20 and again.output_token_ids == fake_reference(again.prompt_token_ids, 2)
