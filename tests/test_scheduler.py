"""Algorithm 1 (docs/DESIGN.md section 3) rule by rule, the static baseline, and a random property test.

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
from orca_ext.scheduler import OrcaScheduler, StaticScheduler, make_scheduler

try:
    from orca_ext import _C
    ALLOCATORS = [SlabAllocatorReference, _C.SlabAllocator]
except ImportError:  # pragma: no cover - without a build only the reference is tested
    ALLOCATORS = [SlabAllocatorReference]

_ids = iter(range(10**9))


def mk(prompt_len: int, max_tokens: int, name: str | None = None) -> Request:
    name = name or f"r{next(_ids)}"
    return Request(name, [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


def sched(policy="orca", max_bs=8, n_slots=1000, n_workers=1, alloc=SlabAllocatorReference):
    return make_scheduler(policy, max_bs, n_slots, n_workers, alloc(n_slots))


def advance(batch: list[Request]) -> None:
    """What the engine does to a returned batch: one more token each, finish at max_tokens."""
    for r in batch:
        if r.finished:
            continue
        r.num_cached += len(r.next_inputs()[0])
        r.output_token_ids.append(0)
        if len(r.output_token_ids) >= r.params.max_tokens:
            r.mark_finished("length")


def run_batch(s, batch=None) -> list[Request]:
    batch = s.schedule() if batch is None else batch
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
        make_scheduler("fifo", 4, 100)
    with pytest.raises(ValueError, match="max_batch_size"):
        OrcaScheduler(0, 100)
    with pytest.raises(ValueError, match="n_workers"):
        StaticScheduler(4, 100, 0)
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


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["orca", "static"]),
       n_workers=st.integers(1, 3), max_bs=st.integers(1, 6), n_slots=st.integers(8, 120),
       alloc=st.sampled_from(ALLOCATORS))
def test_random_workloads_never_overcommit_or_overlap(seed, policy, n_workers, max_bs, n_slots, alloc):
    rng = random.Random(seed)
    s = sched(policy, max_bs, n_slots, n_workers, alloc)
    all_reqs: list[Request] = []
    inflight: list[list[Request]] = []
    for _ in range(150):
        op = rng.random()
        if op < 0.3:
            p = rng.randint(1, max(1, n_slots // 2))
            r = mk(p, rng.randint(1, n_slots - p + 1) if n_slots - p >= 1 else 1)
            if r.reservation <= n_slots:
                s.add(r)
                all_reqs.append(r)
        elif op < 0.65:
            batch = s.schedule()
            assert len(batch) <= max_bs
            if batch:
                inflight.append(batch)
        elif op < 0.9 and inflight:
            run_batch(s, inflight.pop(rng.randrange(len(inflight))))
        elif all_reqs:
            victim = rng.choice(all_reqs)
            if not victim.finished:
                victim.mark_finished("abort")
                s.remove(victim)
        check_invariants(s, inflight, all_reqs)
    while inflight:  # drain: everything ends, nothing stays reserved
        run_batch(s, inflight.pop())
    for r in all_reqs:
        if not r.finished:
            r.mark_finished("abort")
            s.remove(r)
    check_invariants(s, inflight, all_reqs)
    assert s.n_rsrv == 0 and s.allocator.n_used == 0 and not s.pool
