"""Algorithm 1 (docs/DESIGN.md section 3) rule by rule, its token budget (chunked prefill) and slab
compaction, the static baseline, and a random property test.

The scheduler is driven directly with real Request objects and no model: `run_batch` plays the
engine (advances each request by one iteration, finishes those that reached max_tokens) and then
calls complete().
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_ext.request import Request, RequestState
from orca_ext.sampling import SamplingParams
from orca_ext.reference import SlabAllocatorReference
from orca_ext.config import EngineConfig
from orca_ext.scheduler import OrcaScheduler, StaticScheduler, make_scheduler
from scheduler_driver import advance, random_operations

try:
    from orca_ext import _C
    ALLOCATORS = [SlabAllocatorReference, _C.SlabAllocator]
except ImportError:  # pragma: no cover - without a build only the reference is tested
    ALLOCATORS = [SlabAllocatorReference]

_ids = iter(range(10**9))


def mk(prompt_len: int, max_tokens: int, name: str | None = None) -> Request:
    name = name or f"r{next(_ids)}"
    return Request(name, [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


def sched(policy="orca", max_bs=8, n_slots=1000, n_workers=1, alloc=SlabAllocatorReference, budget=None):
    config = EngineConfig(scheduler=policy, max_batch_size=max_bs, max_num_batched_tokens=budget)
    return make_scheduler(config, n_slots, n_workers, alloc(n_slots))


class FakeKV:
    """A KV pool that remembers which request wrote each slot, so a test can see that slab
    compaction carried every request's cached rows along with its slab."""

    def __init__(self, n_slots: int):
        self.owner = [None] * n_slots
        self.moves: list[list[tuple[str, int, int]]] = []

    def write(self, batch: list[Request]) -> None:
        for r in batch:
            new_ids, start = r.next_inputs()
            for p in range(start, start + len(new_ids)):
                self.owner[r.slab_start + p] = r.request_id

    def move(self, moves) -> None:  # the scheduler's slab_mover; moves are applied in order
        self.moves.append([(r.request_id, old, new) for r, old, new in moves])
        for r, old, new in moves:
            self.owner[new:new + r.num_cached] = self.owner[old:old + r.num_cached]

    def check(self, reqs: list[Request]) -> None:
        for r in reqs:
            if r.slab_start >= 0:
                cached = self.owner[r.slab_start:r.slab_start + r.num_cached]
                assert cached == [r.request_id] * r.num_cached, f"{r.request_id} lost its KV rows"


def run_batch(s, batch=None, kv: FakeKV | None = None) -> list[Request]:
    batch = s.schedule() if batch is None else batch
    if kv is not None:
        kv.write(batch)
    advance(batch)
    s.complete(batch)
    return batch


def names(batch) -> list[str]:
    return [r.request_id for r in batch]


@pytest.mark.parametrize("alloc", ALLOCATORS)
def test_fcfs_big_head_blocks_smaller_requests_behind_it(alloc):
    s = sched(n_slots=100, alloc=alloc)
    a, b, c = mk(50, 10, "a"), mk(40, 10, "b"), mk(5, 5, "c")  # reservations 60, 50, 10
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule()
    # b does not fit next to a (60 + 50 > 100); c would fit but must not skip ahead of b.
    assert names(batch) == ["a"]
    assert b.state is RequestState.INITIATION and c.state is RequestState.INITIATION
    assert b.slab_start == -1 and c.slab_start == -1
    assert s.n_rsrv == 60
    run_batch(s, batch)
    for _ in range(9):  # a runs to completion alone, c stays blocked the whole time
        assert names(run_batch(s)) == ["a"]
    assert a.state is RequestState.RELEASED and s.n_rsrv == 0
    batch = s.schedule()  # the iteration right after a left: b and c join together
    assert names(batch) == ["b", "c"]
    assert s.n_rsrv == 60


def test_max_batch_size_caps_each_iteration_and_keeps_arrival_order():
    s = sched(max_bs=3)
    reqs = [mk(4, 1 + i, f"q{i}") for i in range(5)]  # q0 finishes first (max_tokens 1)
    for r in reqs:
        s.add(r)
    assert names(run_batch(s)) == ["q0", "q1", "q2"]
    # q0 left after its first token; q3 takes its place, q4 still waits for a free seat.
    batch = run_batch(s)
    assert names(batch) == ["q1", "q2", "q3"]
    assert reqs[4].state is RequestState.INITIATION
    assert names(run_batch(s)) == ["q2", "q3", "q4"]  # q1 (max_tokens 2) left


@pytest.mark.parametrize("alloc", ALLOCATORS)
def test_reservation_is_prompt_plus_max_tokens_and_fills_n_slots_exactly(alloc):
    s = sched(n_slots=64, alloc=alloc)
    a, b, c = mk(10, 22, "a"), mk(20, 12, "b"), mk(1, 1, "c")  # 32 + 32 = 64, then 2 more
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule()
    assert names(batch) == ["a", "b"]
    assert s.n_rsrv == 64 == s.allocator.n_used
    assert {a.slab_start, b.slab_start} == {0, 32}
    assert c.state is RequestState.INITIATION


@pytest.mark.parametrize("alloc", ALLOCATORS)
def test_blocked_when_no_contiguous_slab_even_if_total_fits(alloc):
    s = sched(n_slots=100, alloc=alloc)
    a, b, c = mk(20, 10, "a"), mk(30, 10, "b"), mk(20, 10, "c")  # 30 + 40 + 30
    for r in (a, b, c):
        s.add(r)
    s.schedule()
    a.mark_finished("abort"), c.mark_finished("abort")
    s.complete([a, b, c])  # a and c leave: 60 slots free, but in two runs of 30
    assert s.n_rsrv == 40 and s.allocator.largest_free == 30
    d, e = mk(40, 10, "d"), mk(5, 5, "e")  # d needs 50: 40 + 50 <= 100 but no run of 50
    s.add(d), s.add(e)
    assert names(s.schedule()) == ["b"]
    assert d.state is RequestState.INITIATION and e.state is RequestState.INITIATION


def test_finished_request_leaves_immediately_and_waiting_one_joins_next_iteration():
    s = sched(n_slots=40)
    a, b = mk(10, 3, "a"), mk(10, 20, "b")  # 13 + 30 = 43 > 40
    s.add(a), s.add(b)
    history = [names(run_batch(s)) for _ in range(4)]
    # a's 3 iterations, then b at the very next one (no waiting for a batch boundary).
    assert history == [["a"], ["a"], ["a"], ["b"]]
    assert b.num_cached == 10  # b ran its prefill in that iteration


def test_request_added_mid_flight_joins_next_iteration_mixed_with_decodes():
    s = sched()
    a, b = mk(7, 10, "a"), mk(5, 10, "b")
    s.add(a), s.add(b)
    batch = s.schedule()
    c = mk(9, 10, "c")
    s.add(c)  # arrives while the first iteration is running
    assert c not in batch
    run_batch(s, batch)
    batch = s.schedule()
    assert names(batch) == ["a", "b", "c"]
    inputs = [r.next_inputs() for r in batch]
    # a, b decode one token over their cached prompts; c runs its whole prompt from position 0.
    assert inputs == [([0], 7), ([0], 5), ([1] * 9, 0)]


def test_n_workers_keeps_running_requests_out_of_later_selections():
    s = sched(max_bs=2, n_workers=2)
    reqs = [mk(3, 5, f"w{i}") for i in range(5)]
    for r in reqs:
        s.add(r)
    b1 = s.schedule()
    b2 = s.schedule()
    assert names(b1) == ["w0", "w1"] and names(b2) == ["w2", "w3"]
    assert all(r.state is RequestState.RUNNING for r in b1 + b2)
    assert s.n_scheduled == 2
    assert s.schedule() == []  # n_scheduled == n_workers: wait for one batch to return
    run_batch(s, b1)
    assert s.n_scheduled == 1
    b3 = s.schedule()
    # b2's requests are still RUNNING, so b1's (now INCREMENT) and the next waiting one are picked.
    assert names(b3) == ["w0", "w1"]
    run_batch(s, b2)
    assert names(s.schedule()) == ["w2", "w3"]


def test_abort_frees_slab_now_unless_its_batch_is_running():
    s = sched(n_slots=100)
    a, b, c = mk(10, 10, "a"), mk(10, 10, "b"), mk(10, 10, "c")
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule()  # a, b, c running
    assert s.n_rsrv == 60
    b.mark_finished("abort")
    s.remove(b)  # its batch is executing: the model may still write b's slab
    assert s.n_rsrv == 60 and b.slab_start >= 0
    s.complete(batch)  # batch returned: b is released before the next selection
    assert s.n_rsrv == 40 and b.state is RequestState.RELEASED and b.slab_start == -1
    a.mark_finished("abort")
    s.remove(a)  # INCREMENT: freed at once
    assert s.n_rsrv == 20 and a.state is RequestState.RELEASED
    d = mk(5, 5, "d")
    s.add(d)
    d.mark_finished("abort")
    s.remove(d)  # still waiting: just leaves the pool
    assert d.state is RequestState.RELEASED and names(s.schedule()) == ["c"]


def chunks(batch) -> list[tuple[str, int]]:
    return [(r.request_id, r.num_scheduled) for r in batch]


def test_token_budget_takes_decodes_first_then_prompt_chunks_in_arrival_order():
    s = sched(max_bs=4, budget=10)
    a, b, c = mk(3, 6, "a"), mk(25, 6, "b"), mk(4, 6, "c")
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule()
    # a's whole prompt, then as much of b's as the budget leaves; c is not even admitted.
    assert chunks(batch) == [("a", 3), ("b", 7)]
    assert b.next_inputs() == ([1] * 7, 0) and not b.emits_token and a.emits_token
    assert c.state is RequestState.INITIATION and c.slab_start == -1
    run_batch(s, batch)
    assert (b.num_cached, b.output_token_ids) == (7, [])  # a chunk that is not the last: no token
    batch = s.schedule()
    assert chunks(batch) == [("a", 1), ("b", 9)]  # the decode first, then b's next chunk
    assert b.next_inputs() == ([1] * 9, 7)
    run_batch(s, batch)
    assert chunks(run_batch(s)) == [("a", 1), ("b", 9)]  # b's last chunk: it emits its first token
    assert b.num_cached == 25 and len(b.output_token_ids) == 1
    assert chunks(run_batch(s)) == [("a", 1), ("b", 1), ("c", 4)]


def test_token_budget_cuts_only_the_last_prompt_and_never_skips_ahead():
    s = sched(max_bs=8, n_slots=100, budget=16)
    a, b, c = mk(10, 30, "a"), mk(40, 40, "b"), mk(2, 2, "c")  # 40 + 80 > 100: b waits for a
    for r in (a, b, c):
        s.add(r)
    assert chunks(run_batch(s)) == [("a", 10)]  # b does not fit; c must not skip ahead of it
    assert b.slab_start == -1 and c.slab_start == -1


def test_budget_below_max_batch_size_and_budget_with_static_are_rejected():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(3\) must be >= max_batch_size \(4\)"):
        sched(max_bs=4, budget=3)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
        sched(budget=0)
    # The static baseline runs whole prompts: a budget belongs to iteration-level scheduling.
    assert sched("static", budget=64).max_num_batched_tokens is None
    with pytest.raises(ValueError, match="resolve"):
        make_scheduler(EngineConfig(), 100)  # 'auto' is per device


def test_abort_during_a_half_done_prefill_frees_its_slab():
    s = sched(n_slots=100, budget=8)
    a = mk(30, 5, "a")
    s.add(a)
    run_batch(s)
    assert a.state is RequestState.INCREMENT and a.num_cached == 8 and s.n_rsrv == 35
    a.mark_finished("abort")
    s.remove(a)  # between two chunks: freed at once
    assert s.n_rsrv == 0 and s.allocator.n_used == 0 and a.slab_start == -1
    b = mk(30, 5, "b")
    s.add(b)
    batch = s.schedule()  # b's first chunk is executing when it is aborted
    b.mark_finished("abort")
    s.remove(b)
    assert s.n_rsrv == 35
    s.complete(batch)
    assert s.n_rsrv == 0 and s.allocator.n_used == 0 and not s.pool


def fragment(s, kv: FakeKV | None = None, launch_first: bool = False) -> tuple[Request, Request]:
    """Leave 60 of 100 slots free in two runs of 30 around a live 40-slot slab; returns the live
    request and a waiting head that needs 50 slots (added after the live one's next batch was
    launched when `launch_first`)."""
    a, b, c = mk(20, 10, "a"), mk(30, 10, "b"), mk(20, 10, "c")  # slabs [0,30) [30,70) [70,100)
    for r in (a, b, c):
        s.add(r)
    run_batch(s, kv=kv)
    a.mark_finished("abort"), c.mark_finished("abort")
    s.remove(a), s.remove(c)
    assert s.allocator.n_free == 60 and s.allocator.largest_free == 30
    if launch_first:
        assert names(s.schedule()) == ["b"]
    d = mk(40, 10, "d")
    s.add(d)
    return b, d


@pytest.mark.parametrize("alloc", ALLOCATORS)
def test_compaction_admits_the_head_in_the_same_iteration(alloc):
    s, kv = sched(n_slots=100, alloc=alloc), FakeKV(100)
    s.slab_mover = kv.move
    b, d = fragment(s, kv)
    batch = s.schedule()
    assert names(batch) == ["b", "d"]  # without compaction d waits (see the test above)
    assert kv.moves == [[("b", 30, 0)]] and b.slab_start == 0 and d.slab_start == 40
    assert s.num_compactions == 1 and s.allocator.largest_free == 10
    kv.check([b])
    run_batch(s, batch, kv)
    kv.check([b, d])


def test_without_a_slab_mover_the_head_waits_for_a_contiguous_run():
    s = sched(n_slots=100)
    b, d = fragment(s)
    assert names(s.schedule()) == ["b"] and d.slab_start == -1
    assert s.num_compactions == 0 and s.num_fragmentation_stalls == 1


def test_compaction_waits_until_no_batch_in_flight_uses_the_slabs():
    s, kv = sched(n_slots=100, n_workers=2), FakeKV(100)
    s.slab_mover = kv.move
    b, d = fragment(s, kv, launch_first=True)
    b1 = [b]  # executing: d could only be admitted by moving b's slab, so it waits for b1
    e = mk(3, 3, "e")
    s.add(e)
    assert s.schedule() == [] and s.compaction_pending and d.slab_start == -1
    assert s.schedule() == [] and kv.moves == []  # nothing new launches while b1 is in flight
    run_batch(s, b1, kv)
    batch = s.schedule()
    assert names(batch) == ["b", "d", "e"] and kv.moves == [[("b", 30, 0)]]
    kv.check([b])


def test_static_policy_admits_only_when_the_whole_batch_has_finished():
    s = sched("static", max_bs=2, n_slots=1000)
    a, b, c = mk(4, 2, "a"), mk(4, 5, "b"), mk(4, 3, "c")
    for r in (a, b, c):
        s.add(r)
    assert names(run_batch(s)) == ["a", "b"]
    assert names(run_batch(s)) == ["a", "b"]
    # a finished and gave back its slab, but c must wait until b finishes too.
    assert a.state is RequestState.RELEASED and s.n_rsrv == 9
    for _ in range(3):
        assert names(run_batch(s)) == ["b"]
        assert c.state is RequestState.INITIATION
    assert b.state is RequestState.RELEASED
    assert names(run_batch(s)) == ["c"]


def test_static_policy_respects_reservations_when_forming_a_batch():
    s = sched("static", max_bs=4, n_slots=30)
    a, b, c = mk(10, 5, "a"), mk(10, 5, "b"), mk(1, 1, "c")
    for r in (a, b, c):
        s.add(r)
    assert names(s.schedule()) == ["a", "b"]  # 15 + 15 = 30; c cannot be added
    assert c.state is RequestState.INITIATION


def test_orca_policy_fills_freed_seats_where_static_does_not():
    def iterations(policy):
        s = sched(policy, max_bs=2)
        for i, n in enumerate([1, 8, 1, 8]):
            s.add(mk(2, n, f"{policy}{i}"))
        count = 0
        while s.has_unfinished():
            run_batch(s)
            count += 1
        return count

    # orca: each short request's seat is refilled at once, so the two long ones overlap.
    assert iterations("orca") == 10
    assert iterations("static") == 16


def test_bad_configuration_and_oversized_requests_are_rejected():
    with pytest.raises(ValueError, match="scheduler"):
        EngineConfig(scheduler="fifo")
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="n_slots"):
        OrcaScheduler(EngineConfig(max_num_batched_tokens=None), 0)
    with pytest.raises(ValueError, match="n_workers"):
        StaticScheduler(EngineConfig(scheduler="static"), 100, 0)
    s = sched(n_slots=10)
    with pytest.raises(ValueError, match="n_slots"):
        s.add(mk(8, 3))


# -- property test ------------------------------------------------------------------------------
def check_invariants(s, inflight: list[list[Request]], all_reqs: list[Request]) -> None:
    holders = [r for r in all_reqs if r.slab_start >= 0]
    assert s.n_rsrv <= s.n_slots
    assert s.n_rsrv == sum(r.reservation for r in holders) == s.allocator.n_used
    spans = sorted((r.slab_start, r.slab_start + r.reservation) for r in holders)
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1, "two slabs overlap"
    assert all(0 <= a and b <= s.n_slots for a, b in spans)
    running = [r for batch in inflight for r in batch]
    assert len(running) == len(set(map(id, running))), "a request is in two in-flight batches"
    # FCFS: admitted requests are a prefix of the pool.
    states = [r.state is RequestState.INITIATION for r in s.pool]
    assert states == sorted(states)
    for r in all_reqs:
        if r.state is RequestState.RELEASED:
            assert r.slab_start == -1 and r not in s.pool


def check_batch(s, batch: list[Request]) -> None:
    """Decodes first, then prompt tokens in arrival order within the budget: only the last
    prompt of a batch may be cut short."""
    assert len(batch) <= s.max_batch_size
    if s.max_num_batched_tokens is None:
        return
    assert sum(r.num_scheduled for r in batch) <= s.max_num_batched_tokens
    kinds = [r.prompt_remaining > 0 for r in batch]
    assert kinds == sorted(kinds), "a prompt chunk came before a decode"
    prompts = [r for r in batch if r.prompt_remaining]
    assert all(r.num_scheduled == r.prompt_remaining for r in prompts[:-1])
    assert [s.pool.index(r) for r in prompts] == sorted(s.pool.index(r) for r in prompts)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["orca", "static"]),
       n_workers=st.integers(1, 3), max_bs=st.integers(1, 6), n_slots=st.integers(8, 120),
       alloc=st.sampled_from(ALLOCATORS), budget=st.one_of(st.none(), st.integers(0, 40)),
       compaction=st.booleans())
def test_random_workloads_never_overcommit_or_overlap(seed, policy, n_workers, max_bs, n_slots, alloc,
                                                     budget, compaction):
    rng = random.Random(seed)
    budget = None if policy == "static" or budget is None else max_bs + budget
    s = sched(policy, max_bs, n_slots, n_workers, alloc, budget)
    kv = FakeKV(n_slots)
    if compaction:
        s.slab_mover = kv.move

    def new_request():
        p = rng.randint(1, max(1, n_slots // 2))
        r = mk(p, rng.randint(1, n_slots - p + 1) if n_slots - p >= 1 else 1)
        return r if r.reservation <= n_slots else None

    def on_batch(batch):
        check_batch(s, batch)
        if batch:
            kv.write(batch)

    def check(inflight, all_reqs):
        check_invariants(s, inflight, all_reqs)
        kv.check([r for r in all_reqs if r.state is not RequestState.RUNNING])

    all_reqs, inflight = random_operations(s, rng, 150, new_request, run_batch, on_batch, check)
    while inflight:  # drain: everything ends, nothing stays reserved
        run_batch(s, inflight.pop())
    for r in all_reqs:
        if not r.finished:
            r.mark_finished("abort")
            s.remove(r)
    check_invariants(s, inflight, all_reqs)
    assert s.n_rsrv == 0 and s.allocator.n_used == 0 and not s.pool
