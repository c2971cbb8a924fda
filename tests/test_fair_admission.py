"""Client-aware admission (`admission="fair"`, orca_ext/fairness.py) and pipeline balance.

The scheduler is driven directly with real Request objects (as in test_scheduler.py), then the
engine with the fake model, whose outputs must equal the request run alone whatever the policy.
Fair admission: a victim behind a hog client is admitted within a bounded number of iterations
(under FCFS it waits behind the hog), prompt chunks are shared between clients, the per-client KV
cap (a share of the cache by default) holds while another client is present and never binds a
client alone, one client alone gets Algorithm 1's batches, counters bank no idle credit, a
client that is ahead takes decode rows worth no more than the others' (its streams in turn, a
row costing more the longer its context; CPU's default), and nothing starves (hypothesis
property tests).
Balance: with two batches in flight a burst is split over both; with one, nothing changes.
"""
from __future__ import annotations

import argparse
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_model import FakeModel, fake_reference
from scheduler_driver import advance, random_operations
from orca_ext import InvalidRequestError, Server
from orca_ext.config import EngineConfig
from orca_ext.engine import Engine
from orca_ext.executor import LocalExecutor
from orca_ext.fairness import (CONTEXT_COST_TOKENS, DECODE_CONTEXT_COST_TOKENS, DEFAULT_KV_SHARE, MAX_IDLE_COUNTERS, OUTPUT_WEIGHT,
                               PROMPT_WEIGHT, FairShares, kv_cap_slots)
from orca_ext.options import add_engine_arguments
from orca_ext.reference import SlabAllocatorReference
from orca_ext.request import Request, RequestState
from orca_ext.sampling import SamplingParams
from orca_ext.scheduler import FairScheduler, OrcaScheduler, make_scheduler

_ids = iter(range(10**9))


def mk(prompt_len: int, max_tokens: int, client=None, name: str | None = None) -> Request:
    name = name or f"{client}-{next(_ids)}"
    return Request(name, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), client=client)


def sched(admission="fair", max_bs=8, n_slots=1000, n_workers=1, budget=None, cap=None, share_rows=None):
    """A scheduler of `admission` whose decode-row sharing is CPU's default (share_rows=None)."""
    config = EngineConfig(max_batch_size=max_bs, max_num_batched_tokens=budget, admission=admission,
                          max_kv_per_client=cap, share_decode_rows=share_rows,
                          prefill_only_tokens=None).scheduling_for("cpu")
    return make_scheduler(config, n_slots, n_workers, SlabAllocatorReference(n_slots))


def run_batch(s, batch=None) -> list[Request]:
    batch = s.schedule() if batch is None else batch
    advance(batch)
    s.complete(batch)
    return batch


def reserved_by(s, client) -> int:
    return sum(r.reservation for r in s.pool if r.slab_start >= 0 and r.client == client)


# -- admission order ------------------------------------------------------------------------------
def first_iteration_of(victim, s, limit=200) -> int:
    for i in range(limit):
        if victim in run_batch(s):
            return i
    raise AssertionError(f"{victim.request_id} not scheduled in {limit} iterations")


@pytest.mark.parametrize("admission", ["fcfs", "fair"])
def test_a_victim_behind_a_hog_waits_under_fcfs_and_is_admitted_next_under_fair(admission):
    # 100 slots; the hog's five requests reserve 30 each, so three run and two wait.
    s = sched(admission, n_slots=100)
    hog = [mk(10, 20, "hog") for _ in range(5)]
    for r in hog:
        s.add(r)
    run_batch(s), run_batch(s)
    victim = mk(4, 6, "victim")  # reserves 10: it fits next to the three running hog requests
    s.add(victim)
    waited = first_iteration_of(victim, s)
    if admission == "fcfs":
        # Arrival order: the victim is admitted only after both waiting hog requests.
        assert waited >= 18 and hog[4].slab_start >= 0
    else:
        # Lifted to the hog's counter on arrival (a tie that the hog's older head wins), and
        # ahead of it once the hog's decodes were charged: one iteration.
        assert waited <= 1 and hog[3].slab_start == -1
    assert s.n_rsrv <= s.n_slots
    while s.has_unfinished():  # the hog still gets all its work done
        run_batch(s)
    assert all(r.finished for r in hog + [victim])


def test_fair_shares_of_admission_alternate_between_two_busy_clients():
    # Room for two requests at a time; each client keeps four queued.
    s = sched(n_slots=40)
    for i in range(4):
        s.add(mk(5, 5, "a")), s.add(mk(5, 5, "b"))
    admitted = []
    while s.has_unfinished():
        for r in run_batch(s):
            if r.num_cached == 5 and len(r.output_token_ids) == 1:
                admitted.append(r.client)
    assert admitted == ["a", "b"] * 4


@pytest.mark.parametrize("admission", ["fcfs", "fair"])
def test_prompt_chunks_are_shared_between_clients(admission):
    # Budget 16: the hog's 400-token prompt takes 25 iterations of chunks.
    s = sched(admission, n_slots=1000, budget=16)
    hog = mk(400, 4, "hog")
    s.add(hog)
    run_batch(s), run_batch(s)
    victim = mk(6, 4, "victim")
    s.add(victim)
    waited = first_iteration_of(victim, s)
    if admission == "fcfs":
        assert waited >= 20 and hog.prompt_remaining == 0
    else:
        assert waited <= 1 and hog.prompt_remaining > 300
        # The hog, ahead by more than a token budget, now takes a chunk that costs at most what
        # the victim gets (its decode counts OUTPUT_WEIGHT): a chunk at context L costs
        # (1 + L / CONTEXT_COST_TOKENS) per token, so past L = 0 that is one token.
        assert 0 < hog.num_cached < CONTEXT_COST_TOKENS
        batch = s.schedule()
        assert [(r.client, r.num_scheduled) for r in batch] == [("victim", 1), ("hog", 1)]
        run_batch(s, batch)
        victim.mark_finished("abort"), s.remove(victim)
        assert [(r.client, r.num_scheduled) for r in s.schedule()] == [("hog", 16)]  # alone: the whole budget


def test_many_clients_each_get_a_share_of_one_iterations_chunks():
    s = sched(max_bs=8, n_slots=1000, budget=24)
    reqs = {c: mk(40, 2, c) for c in "abc"}
    for r in reqs.values():
        s.add(r)
    for _ in range(3):
        run_batch(s)
    # 72 prompt tokens over three iterations: each client got 24, whatever the arrival order.
    assert [r.num_cached for r in reqs.values()] == [24, 24, 24]


# -- the cost of a chunk at a long context ----------------------------------------------------------
def test_a_chunk_costs_its_tokens_scaled_by_its_context():
    shares = FairShares(token_budget=128, context_cost_tokens=100)
    assert [shares.chunk_cost(n, 0) for n in (1, 8, 128)] == [PROMPT_WEIGHT * n for n in (1, 8, 128)]
    assert shares.chunk_cost(10, 100) == 20 * PROMPT_WEIGHT      # L = the constant: twice the tokens
    assert shares.chunk_cost(8, 250) == 28 * PROMPT_WEIGHT       # 8 x 3.5
    assert shares.chunk_cost(3, 10) == -(-33 * PROMPT_WEIGHT // 10)  # 3.3 rounds up
    for context in (0, 1, 99, 100, 350, 1200):
        for cost in range(0, 40):
            n = shares.chunk_fitting(cost, context)
            # The most tokens whose cost fits, checked against the definition.
            assert n * PROMPT_WEIGHT * (100 + context) <= cost * 100 < (n + 1) * PROMPT_WEIGHT * (100 + context)
            assert shares.chunk_cost(n, context) <= cost


def hog_at_context(context: int, n_victims: int = 4):
    """A hog client whose 2,000-token prompt has `context` tokens cached (run alone under a budget
    of 128), then n_victims clients, each with one request that is decoding; the hog is now more
    than a token budget ahead of them."""
    s = sched(max_bs=16, n_slots=4000, budget=128)
    hog = mk(2000, 1, "hog")
    s.add(hog)
    while hog.num_cached < context:
        run_batch(s)
    assert hog.num_cached == context
    victims = [mk(1, 50, f"v{i}") for i in range(n_victims)]
    for v in victims:
        s.add(v)
    run_batch(s)  # the victims' one-token prompts, and the rest of the budget for the hog
    run_batch(s)  # the hog, still within one token budget of the victims, takes what is left
    return s, hog, victims


@pytest.mark.parametrize("context", [0, 128, 640, 1280])
def test_a_hog_chunk_costs_no_more_than_any_one_other_clients_tokens_at_any_context(context):
    """An equal share per client: the hog, ahead, takes a chunk that costs no more than the
    busiest other client in the batch (one victim's decode here), however many others there are."""
    s, hog, victims = hog_at_context(context)
    for _ in range(5):
        before = hog.num_cached
        batch = s.schedule()
        per_client = {r.client: r.num_scheduled * OUTPUT_WEIGHT for r in batch if r.client != "hog"}
        assert sorted(per_client.values()) == [OUTPUT_WEIGHT] * 4  # the four victims' decodes
        share = max(per_client.values())
        (chunk,) = [r.num_scheduled for r in batch if r is hog]
        # The independent bound: tokens x (1 + L / CONTEXT_COST_TOKENS) <= one client's weight,
        # and one more token would not fit (or the chunk is the one token always allowed).
        per_token = PROMPT_WEIGHT * (CONTEXT_COST_TOKENS + before) / CONTEXT_COST_TOKENS
        assert chunk == 1 or chunk * per_token <= share + 1e-9
        assert (chunk + 1) * per_token > share
        run_batch(s, batch)
    # Far into a long prompt its chunks are smaller than its tokens alone would allow.
    if context >= 640:
        assert chunk < sum(per_client.values()) // PROMPT_WEIGHT


def test_a_hog_alone_takes_the_whole_budget_at_any_context():
    s, hog, victims = hog_at_context(1280, n_victims=1)
    victims[0].mark_finished("abort"), s.remove(victims[0])
    assert [(r.client, r.num_scheduled) for r in s.schedule()] == [("hog", 128)]


def test_counters_charge_a_chunk_by_its_context():
    s, hog, victims = hog_at_context(1280)
    before = s.shares.counters["hog"]
    context = hog.num_cached
    batch = s.schedule()
    (chunk,) = [r.num_scheduled for r in batch if r is hog]
    charged = s.shares.counters["hog"] - before
    assert charged == -(-chunk * PROMPT_WEIGHT * (CONTEXT_COST_TOKENS + context) // CONTEXT_COST_TOKENS)
    assert charged > chunk * PROMPT_WEIGHT
    for v in victims:
        assert v.num_scheduled == 1


def test_a_big_head_blocks_later_clients_so_it_never_starves():
    # A needs 80 of 100 slots while B keeps 30 busy with a stream of small requests.
    s = sched(n_slots=100)
    s.add(mk(5, 25, "b"))
    run_batch(s)
    big = mk(40, 40, "a")
    s.add(big)
    for i in range(200):
        if s.num_waiting < 3:
            s.add(mk(5, 5, "b"))
        run_batch(s)
        if big.slab_start >= 0:
            break
    assert big.slab_start >= 0 and i < 40


def test_no_request_skips_an_older_one_of_its_own_client():
    s = sched(n_slots=100)
    s.add(mk(5, 55, "b"))
    run_batch(s)
    big, small = mk(30, 20, "a"), mk(2, 2, "a")  # big does not fit next to b's 60; small would
    s.add(big), s.add(small)
    for _ in range(5):
        run_batch(s)
        assert big.slab_start == -1 and small.slab_start == -1


# -- the per-client KV cap -----------------------------------------------------------------------
def test_the_kv_cap_holds_a_client_back_and_lets_the_others_go_ahead():
    s = sched(n_slots=300, cap=70)
    hog = [mk(10, 20, "hog") for _ in range(5)]  # 30 each: two fit under the cap, 60
    for r in hog:
        s.add(r)
    victim = mk(5, 5, "victim")
    s.add(victim)
    batch = s.schedule()
    assert {r.request_id for r in batch} == {hog[0].request_id, hog[1].request_id, victim.request_id}
    assert reserved_by(s, "hog") == 60 and hog[2].state is RequestState.INITIATION
    s.complete(batch)
    while s.has_unfinished():
        if s.shares.active - {"hog"}:  # the victim in the pool, or between two requests
            assert reserved_by(s, "hog") <= 70
        run_batch(s)
    assert all(r.finished for r in hog)  # waited, never rejected


def test_a_request_larger_than_the_cap_runs_alone_for_its_client():
    s = sched(n_slots=300, cap=50)
    other = mk(2, 20, "b")  # present, decoding
    s.add(other)
    run_batch(s)
    large, later = mk(60, 20, "a"), mk(5, 5, "a")
    s.add(large), s.add(later)
    assert [r.request_id for r in s.schedule()] == [other.request_id, large.request_id]
    assert later.slab_start == -1


def test_a_share_cap_resolves_to_slots_of_the_cache():
    assert kv_cap_slots(0.5, 1000) == 500 and kv_cap_slots(0.25, 1001) == 250
    assert kv_cap_slots("auto", 301) == int(DEFAULT_KV_SHARE * 301) == 150
    assert kv_cap_slots(1.0, 77) == 77 and kv_cap_slots(1e-9, 77) == 1  # at least one slot
    assert kv_cap_slots(64, 1000) == 64 and kv_cap_slots(None, 1000) is None
    assert sched(cap=0.25, n_slots=400).shares.max_kv_per_client == 100
    # The default config is fair admission's default share, resolved by the scheduler.
    default = make_scheduler(EngineConfig(admission="fair", max_num_batched_tokens=None).scheduling_for("cpu"), 1234,
                             allocator=SlabAllocatorReference(1234))
    assert default.max_kv_per_client == default.shares.max_kv_per_client == 617


def test_a_lone_client_is_not_capped():
    s = sched(max_bs=16, n_slots=300, cap=0.5)
    burst = [mk(10, 20, "a") for _ in range(12)]  # 30 slots each: ten fill the cache
    for r in burst:
        s.add(r)
    run_batch(s)
    assert reserved_by(s, "a") == 300 and s.shares.max_kv_per_client == 150


def test_a_second_client_arriving_makes_the_cap_bind_for_new_admissions():
    s = sched(max_bs=16, n_slots=300, cap=0.5)  # 150 slots
    hog = [mk(10, 20, "hog") for _ in range(6)]
    for r in hog:
        s.add(r)
    run_batch(s)
    assert reserved_by(s, "hog") == 180  # alone: past the cap
    other = mk(2, 50, "b")
    s.add(other)
    run_batch(s)
    assert other.slab_start >= 0 and s.n_rsrv == 232
    later = [mk(10, 20, "hog") for _ in range(2)]  # 60 slots: they would fit in the 68 free
    for r in later:
        s.add(r)
    for _ in range(5):
        run_batch(s)
        # Admitted before b came, the hog keeps its slots (no preemption); no new one joins them.
        assert reserved_by(s, "hog") == 180 and all(r.slab_start < 0 for r in later)
    other.mark_finished("abort"), s.remove(other)  # alone again: the free slots are the hog's
    run_batch(s)
    assert all(r.slab_start >= 0 for r in later)


def test_the_cap_stops_binding_when_the_other_client_leaves():
    s = sched(max_bs=16, n_slots=300, cap=0.5)
    other = mk(2, 100, "b")
    s.add(other)
    run_batch(s)
    hog = [mk(10, 20, "hog") for _ in range(8)]
    for r in hog:
        s.add(r)
    run_batch(s)
    assert reserved_by(s, "hog") == 150  # five of 30: the cap, while b is present
    other.mark_finished("abort"), s.remove(other)  # gone (an abort: not between two requests)
    run_batch(s)
    assert reserved_by(s, "hog") == 240  # all eight: alone, the whole cache is its own


def test_a_client_between_two_requests_still_caps_the_others():
    s = sched(max_bs=16, n_slots=300, cap=0.5)
    other = mk(2, 2, "b")
    s.add(other)
    run_batch(s), run_batch(s)
    assert other.finished and other.finish_reason == "length"  # b left the pool after its length
    hog = [mk(10, 20, "hog") for _ in range(8)]
    for r in hog:
        s.add(r)
    run_batch(s)
    assert reserved_by(s, "hog") == 150  # b may send its next request at once: it counts as present


def test_kv_cap_config_values():
    assert EngineConfig().max_kv_per_client == "auto"
    for value in ("auto", None, 0.5, 1.0, 1, 4096):
        assert EngineConfig(admission="fair", max_kv_per_client=value).max_kv_per_client == value
    EngineConfig(admission="fcfs", max_kv_per_client="auto")  # the default means no cap under fcfs
    EngineConfig(admission="fcfs", max_kv_per_client=None)
    for bad in (0, -3, 0.0, 1.5, float("nan"), True, "half", "0.5"):
        with pytest.raises(ValueError, match=r"max_kv_per_client must be 'auto', None, a share of the KV "
                                             r"slots in \(0, 1\] \(a float\) or a slot count >= 1"):
            EngineConfig(admission="fair", max_kv_per_client=bad)
    with pytest.raises(ValueError, match="max_kv_per_client=0.5 needs admission='fair'"):
        EngineConfig(admission="fcfs", max_kv_per_client=0.5)


def test_cap_needs_fair_admission_and_fair_needs_the_orca_scheduler():
    with pytest.raises(ValueError, match="max_kv_per_client=100 needs admission='fair'"):
        EngineConfig(admission="fcfs", max_kv_per_client=100)
    with pytest.raises(ValueError, match="admission must be one of 'fcfs', 'fair'"):
        EngineConfig(admission="lottery")
    with pytest.raises(ValueError, match="admission='fair' needs scheduler='orca'"):
        EngineConfig(admission="fair", scheduler="static")
    assert type(sched("fcfs")) is OrcaScheduler and type(sched("fair")) is FairScheduler


def test_cli_flags_build_the_config():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = EngineConfig.from_args(parser.parse_args(["--admission", "fair", "--max-kv-per-client", "4096"]))
    assert (config.admission, config.max_kv_per_client) == ("fair", 4096)
    config = EngineConfig.from_args(parser.parse_args(["--admission", "fair", "--max-kv-per-client", "0.25"]))
    assert config.max_kv_per_client == 0.25
    defaults = EngineConfig.from_args(parser.parse_args([]))
    assert (defaults.admission, defaults.max_kv_per_client) == (EngineConfig().admission, "auto")
    assert EngineConfig.from_args(parser.parse_args(["--max-kv-per-client", "none"])).max_kv_per_client is None
    assert EngineConfig.from_args(parser.parse_args(["--max-kv-per-client", "AUTO"])).max_kv_per_client == "auto"


@pytest.mark.parametrize("value, message", [
    ("0", "a slot count must be >= 1, got 0"),
    ("1.5", r"a share of the KV slots must be in \(0, 1\], got 1.5"),
    ("0.0", r"a share of the KV slots must be in \(0, 1\], got 0.0"),
    ("half", r"expected a share of the KV slots in \(0, 1\] such as 0.5, a slot count >= 1, 'auto' or 'none'"),
])
def test_cli_rejects_bad_caps_naming_the_flag_and_the_limit(value, message, capsys):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-kv-per-client", value])
    err = capsys.readouterr().err
    assert "argument --max-kv-per-client:" in err
    assert re.search(message, err), err


# -- counters ------------------------------------------------------------------------------------
def test_counters_charge_weighted_tokens_and_lift_newcomers_without_banked_credit():
    s = sched(n_slots=1000)
    a = mk(10, 5, "a")
    s.add(a)
    run_batch(s)  # a's prompt
    run_batch(s)  # one decode, its token at position 10
    decode = lambda L: OUTPUT_WEIGHT * (1 + L / DECODE_CONTEXT_COST_TOKENS)  # noqa: E731
    assert s.shares.counters["a"] == pytest.approx(10 * PROMPT_WEIGHT + decode(10))
    s.add(mk(3, 5, "b"))
    s.schedule()
    # b arrived while a was active: lifted to a's counter (with this selection's decode), then
    # charged its prompt.
    assert s.shares.floor == s.shares.counters["a"] == pytest.approx(10 * PROMPT_WEIGHT + decode(10) + decode(11))
    assert s.shares.counters["b"] == s.shares.floor + 3 * PROMPT_WEIGHT


def test_an_idle_client_keeps_its_counter_so_pausing_does_not_reset_it():
    shares = FairShares()
    shares._track({"hog", "victim"})
    shares.counters.update(hog=500, victim=10)
    shares._track({"victim"})  # the hog goes idle
    shares.counters["victim"] = 40
    shares._track({"victim", "hog"})  # and comes back: its 500 stays, the victim still goes first
    assert shares.counters["hog"] == 500 and shares.floor == 40
    shares._track({"victim", "newcomer"})
    assert shares.counters["newcomer"] == 40


def test_idle_counters_are_bounded():
    shares = FairShares()
    for i in range(MAX_IDLE_COUNTERS + 50):
        shares._track({f"c{i}"})
        shares.counters[f"c{i}"] += i
    assert len(shares.counters) <= MAX_IDLE_COUNTERS + 1
    assert f"c{MAX_IDLE_COUNTERS + 40}" in shares.counters and "c0" not in shares.counters


# -- pipeline balance ----------------------------------------------------------------------------
@pytest.mark.parametrize("admission", ["fcfs", "fair"])
def test_with_two_stages_a_burst_is_split_over_both_batches_in_flight(admission):
    s = sched(admission, max_bs=16, n_workers=2)
    burst = [mk(4, 10, "c") for _ in range(8)]
    for r in burst:
        s.add(r)
    first = s.schedule()
    assert len(first) == 8 and s.schedule() == []  # all prompts in one batch, nothing left
    run_batch(s, first)
    b1, b2 = s.schedule(), s.schedule()
    assert len(b1) == 4 and len(b2) == 4 and set(b1).isdisjoint(b2)
    for _ in range(5):  # and it stays balanced as the batches come back in turn
        run_batch(s, b1)
        b1, b2 = b2, s.schedule()
        assert len(b2) == 4


def test_with_one_stage_a_burst_stays_in_one_batch():
    s = sched(max_bs=16, n_workers=1)
    for _ in range(8):
        s.add(mk(4, 10, "c"))
    for _ in range(6):
        assert len(run_batch(s)) == 8


# -- one client: fair admission is Algorithm 1 ----------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_bs=st.integers(1, 8), n_slots=st.integers(40, 200),
       budget=st.one_of(st.none(), st.integers(0, 40)))
def test_with_one_client_fair_admission_selects_the_same_batches_as_fcfs(seed, max_bs, n_slots, budget):
    """Alone, a client is never capped and has no one to share with: the default fair policy
    (its default cap included) selects exactly Algorithm 1's batches under the same budgets."""
    def batches(admission):
        rng = random.Random(seed)
        config = EngineConfig(max_batch_size=max_bs, admission=admission, prefill_only_tokens=None,
                              max_num_batched_tokens=None if budget is None else max_bs + budget).scheduling_for("cpu")
        s = make_scheduler(config, n_slots, 1, SlabAllocatorReference(n_slots))
        out = []
        for step in range(60):
            if rng.random() < 0.5:
                p = rng.randint(1, n_slots // 2)
                s.add(mk(p, rng.randint(1, n_slots - p), "only", name=f"r{step}"))
            if s.has_unfinished():
                out.append([(r.request_id, r.num_scheduled) for r in run_batch(s)])
        while s.has_unfinished():
            out.append([(r.request_id, r.num_scheduled) for r in run_batch(s)])
        return out

    assert batches("fair") == batches("fcfs")


# -- random workloads ----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_workers=st.integers(1, 3), max_bs=st.integers(1, 6),
       n_slots=st.integers(16, 150), budget=st.one_of(st.none(), st.integers(0, 40)),
       cap=st.one_of(st.none(), st.integers(1, 150)), n_clients=st.integers(1, 4))
def test_random_workloads_keep_caps_and_counters_and_starve_nobody(seed, n_workers, max_bs, n_slots, budget,
                                                                   cap, n_clients):
    rng = random.Random(seed)
    s = sched("fair", max_bs, n_slots, n_workers, None if budget is None else max_bs + budget, cap)
    clients = [None] + [f"c{i}" for i in range(n_clients - 1)]
    last_counters: dict = {}
    holding: set = set()  # requests holding a slab at the last check

    def check(inflight=None, all_reqs=None) -> None:
        assert s.n_rsrv <= s.n_slots
        holders = [r for r in s.pool if r.slab_start >= 0]
        assert s.n_rsrv == sum(r.reservation for r in holders) == s.allocator.n_used
        for c in clients:
            mine = [r for r in s.pool if r.client == c]
            # No skipping within a client: its admitted requests are the oldest of its own.
            admitted = [r.slab_start >= 0 for r in mine]
            assert admitted == sorted(admitted, reverse=True)
        for c, v in s.shares.counters.items():
            assert v >= last_counters.get(c, 0) or c not in s.shares.active, "an active counter fell"
        for c in s.shares.active:
            assert s.shares.counters[c] >= s.shares.floor
        last_counters.clear()
        last_counters.update(s.shares.counters)
        holding.clear()
        holding.update(r.request_id for r in holders)

    def new_request():
        p = rng.randint(1, n_slots // 2)
        return mk(p, rng.randint(1, n_slots - p), rng.choice(clients))

    def on_batch(batch):
        # The cap: while another client is present, a client's admissions in this selection
        # keep its reserved slots within the cap (or are one request while it held none).
        for c in clients:
            held = [r for r in s.pool if r.client == c and r.slab_start >= 0]
            new = [r for r in held if r.request_id not in holding]
            if cap is not None and new and s.shares.active - {c}:
                before = sum(r.reservation for r in held) - sum(r.reservation for r in new)
                assert before + sum(r.reservation for r in new) <= cap or (before == 0 and len(new) == 1), \
                    "a client went over its KV cap while another was present"
        assert len(batch) <= s.max_batch_size
        if s.max_num_batched_tokens is not None:
            assert sum(r.num_scheduled for r in batch) <= s.max_num_batched_tokens

    all_reqs, inflight = random_operations(s, rng, 150, new_request, run_batch, on_batch, check)
    # Liveness: with no new arrivals every request finishes within a bounded number of iterations.
    while inflight:
        run_batch(s, inflight.pop())
    bound = sum(r.prompt_remaining + r.params.max_tokens for r in s.pool) + 10
    for _ in range(bound):
        if not s.has_unfinished():
            break
        run_batch(s)
        check()
    assert not s.pool and s.n_rsrv == 0 and s.allocator.n_used == 0


# -- the engine and the server -------------------------------------------------------------------
def engine_run(admission: str, cap=None, bystander: bool = False):
    """A hog client with six long requests, then a victim with one short one, through the engine
    and the fake model; returns the requests and the index of the victim's first iteration.
    `bystander`: a third client's short request (10 more slots) is there before the hog's, and
    prompts run whole (no chunk limit slows the hog's admissions: only the cap can)."""
    config = EngineConfig(max_batch_size=8, max_num_batched_tokens=None if bystander else 32, admission=admission,
                          max_kv_per_client=cap).scheduling_for("cpu")
    engine = Engine(LocalExecutor(FakeModel()), make_scheduler(config, 210 if bystander else 200),
                    record_iterations=True)
    rng = random.Random(3)
    hog = [Request(f"hog{i}", [rng.randrange(101) for _ in range(40)], SamplingParams(max_tokens=25, ignore_eos=True),
                   client="hog") for i in range(6)]
    victim = Request("victim", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True), client="victim")
    others = [Request("bystander", [9], SamplingParams(max_tokens=9, ignore_eos=True), client="b")] if bystander else []
    for r in others + hog:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    engine.add_request(victim)
    while engine.has_work():
        engine.step()
    first = next(rec.index for rec in engine.records if "victim" in rec.request_ids)
    for r in others + hog + [victim]:
        assert r.output_token_ids == fake_reference(r.prompt_token_ids, r.params.max_tokens), r.request_id
    return engine, first


def test_engine_fair_admission_serves_the_victim_within_bounded_iterations():
    _, fcfs_first = engine_run("fcfs")
    fair, fair_first = engine_run("fair")
    _, uncapped_first = engine_run("fair", bystander=True)
    _, capped_first = engine_run("fair", cap=130, bystander=True)
    _, alone_first = engine_run("fair", cap=130)
    # The hog's 65-slot requests: three fill 195 of 200 slots. Under FCFS the victim waits for
    # the other three; under fair it waits only for the first slab to come free; with the cap
    # and another client present (two hog requests at a time) it is admitted at once, where
    # without the cap it waits for the bystander's slots.
    assert fcfs_first > 45
    assert fair_first <= 30
    assert capped_first <= 4 < uncapped_first
    # The cap holds a client back only while another is present: the hog that filled the cache
    # alone keeps its slots (no preemption), so the victim waits as without a cap.
    assert alone_first > 4
    # The hog kept its share while the victim ran: every iteration carried hog work.
    assert all(any(rid.startswith("hog") for rid in rec.request_ids) for rec in fair.records[:60])


def test_server_submit_takes_the_client_key():
    with Server(FakeModel(), n_slots=200, max_batch_size=4, max_num_batched_tokens=None,
                admission="fair", max_kv_per_client=60) as server:
        rids = [server.submit([1, 2, 3], SamplingParams(max_tokens=4), client=c) for c in ("k1", "k2", None)]
        for rid in rids:
            assert server.result(rid, timeout=60).token_ids == fake_reference([1, 2, 3], 4)
        with pytest.raises(InvalidRequestError, match="client must be a string or None") as err:
            server.submit([1], SamplingParams(max_tokens=1), client=7)
        assert err.value.param == "client"


# -- clients between two requests -----------------------------------------------------------------
def streaming_victims_and_hog(n_victims: int = 4, prompt: int = 3000, budget: int = 128):
    """A hog whose long prompt ran alone for a while, then n_victims clients that decode; the hog
    is now more than a token budget ahead of them."""
    s = sched(max_bs=16, n_slots=8000, budget=budget)
    hog = mk(prompt, 1, "hog")
    s.add(hog)
    for _ in range(3):
        run_batch(s)
    victims = [mk(2, 3, f"v{i}") for i in range(n_victims)]
    for v in victims:
        s.add(v)
    return s, hog, victims


def test_a_client_between_two_requests_still_holds_back_a_hog_that_is_ahead():
    """Victims whose requests all finish in the same iteration leave the hog alone for a moment:
    it must not take a whole token budget then (an iteration many times longer than a decode
    that the victims' next requests wait through), and the victims keep their lead over it."""
    s, hog, victims = streaming_victims_and_hog()
    while not all(v.finished for v in victims):
        run_batch(s)
    assert not any(v in s.pool for v in victims) and hog in s.pool
    victim_counters = {v.client: s.shares.counters[v.client] for v in victims}
    assert s.shares.counters["hog"] > max(victim_counters.values()) + 128
    alone = s.schedule()
    assert [(r.client, r.num_scheduled) for r in alone] == [("hog", 1)]
    run_batch(s, alone)
    back = [mk(2, 3, v.client) for v in victims]
    for v in back:
        s.add(v)
    batch = s.schedule()
    # The victims were not lifted to the hog's counter: their prompts go first, and the hog,
    # still ahead, takes a chunk no costlier than one victim's prompt.
    assert [r.client for r in batch] == [v.client for v in back] + ["hog"]
    assert {c: s.shares.counters[c] for c in victim_counters} == {
        c: n + 2 * PROMPT_WEIGHT for c, n in victim_counters.items()}
    assert [r.num_scheduled for r in batch if r is hog] == [1]


def test_a_hog_left_alone_gets_the_whole_budget_once_the_others_stay_away():
    s, hog, victims = streaming_victims_and_hog()
    while not all(v.finished for v in victims):
        run_batch(s)
    chunks = [run_batch(s)[0].num_scheduled for _ in range(24)]
    # A few one-token iterations while the victims may still come back, then whole budgets.
    assert chunks[0] == 1 and chunks[-1] == 128
    assert chunks.index(128) <= 20 and set(chunks[chunks.index(128):]) == {128}


def test_a_hog_beside_back_to_back_victims_still_finishes_its_prompt():
    """Fair is not starvation: the hog's 3,000-token prompt beside four victims that send 3-token
    requests back to back is done within a bounded number of iterations, the victims never
    wait (a request every 3 iterations), and the hog's weighted service grew no faster than a
    victim's times what one token deep in its prompt costs against one decode (it always gets
    at least one token)."""
    s, hog, victims = streaming_victims_and_hog()
    got = {v.client: 0 for v in victims}
    run_batch(s)  # the victims' first prompts: now every client has a counter
    start = dict(s.shares.counters)
    for iteration in range(1, 20000):
        for r in run_batch(s):
            if r.client != "hog" and r.finished:
                got[r.client] += 1
                s.add(mk(2, 3, r.client))
        if hog.finished:
            break
    assert hog.finished and hog.output_token_ids and iteration < 3000
    assert min(got.values()) >= iteration // 3 - 1
    gained = {c: s.shares.counters[c] - start[c] for c in start}
    ratio = s.shares.chunk_cost(1, 3000) / OUTPUT_WEIGHT
    slack = 128 + s.shares.chunk_cost(128, 3000)
    assert all(gained["hog"] <= ratio * gained[c] + slack for c in got), gained


def test_a_hog_ahead_takes_no_more_than_the_least_any_other_client_takes():
    """A newcomer's 16-token prompt beside three victims' decodes: the hog, ahead, is held to a
    decode's weight, not to the newcomer's prompt (else it would match every prompt of clients
    whose prompts arrive in different iterations, getting several prompts' worth to their one)."""
    s, hog, victims = hog_at_context(128)
    late = mk(16, 5, "late")
    s.add(late)
    context = hog.num_cached
    batch = s.schedule()
    taken = {r.client: r.num_scheduled for r in batch}
    assert taken["late"] == 16 and all(taken[v.client] == 1 for v in victims)
    assert taken["hog"] == 1 or s.shares.chunk_cost(taken["hog"], context) <= OUTPUT_WEIGHT


def test_a_client_held_at_its_cap_does_not_throttle_the_others_prompts():
    # The hog's one admitted stream (its others wait at the cap) is charged one decode an
    # iteration; two victims streaming short requests back to back are charged their prompts as
    # well, so their counters pass the hog's. The cap, not the fair order, holds the hog back:
    # its counter banks no credit, and the victims' prompts are never cut into chunks for it.
    s = sched(max_bs=16, n_slots=2000, budget=16, cap=500)
    hog = [mk(10, 400, "hog") for _ in range(5)]  # 410 slots each: one fits under the cap
    for r in hog:
        s.add(r)
    victims = {c: mk(6, 4, c) for c in ("a", "b")}
    for r in victims.values():
        s.add(r)
    chunks = []  # prompt tokens a victim request took in the iteration that began its prompt
    for _ in range(300):
        batch = run_batch(s)
        chunks += [r.num_scheduled for r in batch if r.client in victims and r.num_cached == r.num_scheduled]
        for client, r in victims.items():
            if r.finished:  # the client sends its next request at once
                victims[client] = mk(6, 4, client)
                s.add(victims[client])
        assert reserved_by(s, "hog") == 410
    assert set(chunks) == {6} and len(chunks) > 100


# -- decode rows -----------------------------------------------------------------------------------
def decoding_clients(streams: dict, share_rows=None, budget: int = 32):
    """Clients (name -> number of streams) whose one-token prompts ran; every stream now decodes."""
    s = sched(max_bs=32, n_slots=8000, budget=budget, share_rows=share_rows)
    reqs = {c: [mk(1, 500, c) for _ in range(n)] for c, n in streams.items()}
    for mine in reqs.values():
        for r in mine:
            s.add(r)
    run_batch(s)
    assert all(r.output_token_ids for mine in reqs.values() for r in mine)
    return s, reqs


def rows_per_client(batch) -> dict:
    rows: dict = {}
    for r in batch:
        rows[r.client] = rows.get(r.client, 0) + 1
    return rows


@pytest.mark.parametrize("share_rows", [True, False])
def test_a_client_ahead_takes_no_more_decode_rows_than_any_other_client(share_rows):
    """Three streams of one client beside four one-stream clients: once its counter is more than a
    token budget ahead, the hog takes one row per iteration, each of its streams in turn, and its
    lead stops growing; without row sharing (CUDA's default) it keeps all three rows."""
    s, reqs = decoding_clients({"hog": 3, "v0": 1, "v1": 1, "v2": 1, "v3": 1}, share_rows)
    hog = reqs.pop("hog")
    lead = lambda: s.shares.counters["hog"] - min(s.shares.counters[c] for c in reqs)  # noqa: E731
    while lead() <= 32:
        assert rows_per_client(run_batch(s))["hog"] == 3
    taken = {r.request_id: 0 for r in hog}
    for _ in range(30):
        batch = run_batch(s)
        rows = rows_per_client(batch)
        assert all(rows[c] == 1 for c in reqs)  # every other client decodes every iteration
        assert rows["hog"] == (1 if share_rows else 3)
        for r in batch:
            if r.client == "hog":
                taken[r.request_id] += 1
    if share_rows:
        assert sorted(taken.values()) == [10, 10, 10]
        assert lead() <= 32 + 3 * OUTPUT_WEIGHT
    else:
        assert set(taken.values()) == {30} and lead() > 32 + 60 * OUTPUT_WEIGHT


def row_cost(req) -> float:
    """What a decode row at req's next position costs (computed here, not by the scheduler)."""
    return OUTPUT_WEIGHT * (1 + req.num_cached / DECODE_CONTEXT_COST_TOKENS)


def test_decode_rows_even_out_to_the_least_decode_cost_any_client_has_ready():
    """Clients ahead take decode rows worth what the least of the others takes: clients with 5, 3
    and 2 streams end up taking about 2 rows each per iteration (within one row's cost over a
    window), and none of the 2-stream client's."""
    s, reqs = decoding_clients({"a": 5, "b": 3, "c": 2})
    for _ in range(60):
        run_batch(s)
    costs = {c: 0.0 for c in reqs}
    rows = {c: 0 for c in reqs}
    for _ in range(30):
        batch = s.schedule()
        for r in batch:
            costs[r.client] += row_cost(r)
            rows[r.client] += 1
        run_batch(s, batch)
    assert rows["c"] == 60  # never held: it is the least
    widest = max(row_cost(r) for mine in reqs.values() for r in mine)
    assert abs(costs["a"] - costs["c"]) <= widest and abs(costs["b"] - costs["c"]) <= widest, costs
    done = {c: sorted(len(r.output_token_ids) for r in mine) for c, mine in reqs.items()}
    # Within a client the rows go round: its streams are never more than one token apart.
    assert all(counts[-1] - counts[0] <= 1 for counts in done.values()), done


@pytest.mark.parametrize("context", [600, 3000, 7000])
def test_a_stream_deep_in_a_long_context_takes_rows_worth_one_short_stream(context):
    """One client's single stream at a long context beside four short ones: once ahead, it runs a
    row only as often as its cost allows (every ~decode cost ratio iterations), so it slows each
    iteration by no more than one more short stream would, and it still runs."""
    s = sched(max_bs=16, n_slots=20000, budget=32)
    hog = mk(context, 2000, "hog")
    s.add(hog)
    while hog.prompt_remaining:
        run_batch(s)
    victims = [mk(1, 1000, f"v{i}") for i in range(4)]
    for v in victims:
        s.add(v)
    run_batch(s)
    for _ in range(200):  # until the hog is a budget ahead (its prompt counts) and settles
        run_batch(s)
    hog_costs, victim_costs = [], []
    for _ in range(300):
        batch = s.schedule()
        assert all(v in batch for v in victims)  # the short streams decode every iteration
        hog_costs += [row_cost(r) for r in batch if r is hog]
        victim_costs += [row_cost(r) for r in batch if r is victims[0]]
        run_batch(s, batch)
    assert abs(sum(hog_costs) - sum(victim_costs)) <= max(hog_costs), (sum(hog_costs), sum(victim_costs))
    # Rows: as many as one short stream's cost buys at the hog's cost, between the extremes.
    assert 300 * min(victim_costs) / max(hog_costs) - 1 <= len(hog_costs) <= 300 * max(victim_costs) / min(hog_costs) + 1


def test_a_client_between_requests_or_prefilling_counts_one_row_and_one_alone_takes_every_row():
    s, reqs = decoding_clients({"hog": 4, "v": 1})
    s.shares.counters["hog"] += 1000  # far ahead of the other client
    (victim,) = reqs["v"]
    batch = s.schedule()
    advance(batch)
    victim.mark_finished("length")  # its stream ends: it may send the next request at once
    s.complete(batch)
    assert rows_per_client(run_batch(s)) == {"hog": 1}
    s.add(mk(200, 5, "v"))
    assert rows_per_client(run_batch(s)) == {"hog": 1, "v": 1}  # admitted, its first chunk
    assert rows_per_client(run_batch(s)) == {"hog": 1, "v": 1}  # a chunk takes part as one row
    for r in list(s.pool):  # the other client leaves (an abort: no grace beyond the last one)
        if r.client == "v":
            r.mark_finished("abort"), s.remove(r)
    rows = [rows_per_client(run_batch(s))["hog"] for _ in range(20)]
    assert rows[0] == 1 and rows[-1] == 4  # alone once the grace of its last finished stream ends


def test_decode_row_sharing_is_a_cpu_default_of_fair_admission():
    fair = EngineConfig(admission="fair")
    assert fair.share_decode_rows is None
    assert fair.scheduling_for("cpu").share_decode_rows is True
    assert fair.scheduling_for("cuda").share_decode_rows is False
    assert EngineConfig(admission="fair", device="cpu").resolve().share_decode_rows is True
    assert EngineConfig().scheduling_for("cpu").share_decode_rows is False  # fcfs takes every row
    assert EngineConfig(admission="fair", share_decode_rows=False).scheduling_for("cpu").share_decode_rows is False
    assert EngineConfig(admission="fair", share_decode_rows=True).scheduling_for("cuda").share_decode_rows is True
    with pytest.raises(ValueError, match="share_decode_rows=True needs admission='fair'"):
        EngineConfig(share_decode_rows=True)
    with pytest.raises(ValueError, match=r"share_decode_rows must be True, False or None \(per device\), got 'yes'"):
        EngineConfig(admission="fair", share_decode_rows="yes")
    with pytest.raises(ValueError, match=r"share_decode_rows=None must be resolved first"):
        make_scheduler(EngineConfig(admission="fair", max_num_batched_tokens=64), 100)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for flags, value in (([], None), (["--share-decode-rows"], True), (["--no-share-decode-rows"], False)):
        assert EngineConfig.from_args(parser.parse_args(["--admission", "fair"] + flags)).share_decode_rows is value
