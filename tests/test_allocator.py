"""SlabAllocator (C++) against SlabAllocatorReference, a slot-by-slot model of the same best-fit policy,
including compact()."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_ext.reference import SlabAllocatorReference

_C = pytest.importorskip("orca_ext._C")


def check_same(real, model: SlabAllocatorReference) -> None:
    runs = model.free_runs()
    assert real.n_used == sum(model.used)
    assert real.n_free == len(model.used) - sum(model.used)
    assert real.largest_free == max((length for _, length in runs), default=0)
    assert real.n_free_runs == len(runs)  # freed neighbours are coalesced


def run_steps(n_slots: int, steps: list[tuple[bool, int]], compact_every: int = 0) -> None:
    real, model = _C.SlabAllocator(n_slots), SlabAllocatorReference(n_slots)
    for i, (is_alloc, value) in enumerate(steps):
        if compact_every and i % compact_every == compact_every - 1:
            moves = real.compact()
            assert moves == model.compact()
            check_compacted(model, moves)
        elif is_alloc or not model.slabs:
            n = value % n_slots + 1
            assert real.allocate(n) == model.allocate(n)
        else:
            start = sorted(model.slabs)[value % len(model.slabs)]
            real.free(start)
            model.free(start)
        check_same(real, model)
    for start in list(model.slabs):
        real.free(start)
    assert real.n_used == 0 and real.largest_free == n_slots and real.n_free_runs == 1


def check_compacted(model: SlabAllocatorReference, moves: list[tuple[int, int, int]]) -> None:
    """After compact(): the slabs are packed from slot 0 in their old order, the free slots form
    one run, and the moves go downward in address order with their slabs' lengths."""
    starts = sorted(model.slabs)
    assert starts == [sum(model.slabs[s] for s in starts[:i]) for i in range(len(starts))]
    assert model.n_free_runs == (1 if model.n_free else 0)
    assert all(new < old and model.slabs[new] == n for old, new, n in moves)
    assert [old for old, _, _ in moves] == sorted(old for old, _, _ in moves)


@settings(max_examples=60, deadline=None)
@given(n_slots=st.integers(1, 200), steps=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), max_size=120),
       compact_every=st.sampled_from([0, 3, 7, 20]))
def test_matches_model_hypothesis(n_slots, steps, compact_every):
    run_steps(n_slots, steps, compact_every)


@pytest.mark.parametrize("seed", range(3))
def test_matches_model_thousands_of_steps(seed):
    rng = random.Random(seed)
    n_slots = rng.randint(300, 1000)
    steps = [(rng.random() < 0.55, rng.randint(0, n_slots // 6)) for _ in range(3000)]
    run_steps(n_slots, steps, compact_every=[0, 50, 301][seed])


def test_contract_errors_and_edges():
    a = _C.SlabAllocator(10)
    assert a.n_slots == 10 and a.largest_free == 10
    with pytest.raises(ValueError, match="n must be >= 1"):
        a.allocate(0)
    assert a.allocate(11) == -1  # too big is "no run", not an error
    s = a.allocate(10)
    assert s == 0 and a.n_free == 0 and a.allocate(1) == -1
    with pytest.raises(ValueError, match="no allocated slab starts at slot 3"):
        a.free(3)
    a.free(0)
    with pytest.raises(ValueError, match="no allocated slab starts at slot 0"):
        a.free(0)  # double free
    with pytest.raises(ValueError, match="n_slots must be >= 1"):
        _C.SlabAllocator(0)


def test_best_fit_keeps_large_runs():
    a = _C.SlabAllocator(100)
    x, y, z = a.allocate(10), a.allocate(5), a.allocate(60)
    a.free(x)  # holes: [0,10) and [75,100)
    assert a.allocate(8) == 0  # the 10-slot hole fits best, the 25-slot run stays whole
    assert a.largest_free == 25
    del y, z


def test_compact_returns_the_moves_and_frees_one_run():
    a = _C.SlabAllocator(100)
    x, y, z = a.allocate(10), a.allocate(20), a.allocate(30)  # best fit: 0, 10, 30
    a.free(x)
    assert a.compact() == [(10, 0, 20), (30, 20, 30)]
    assert a.largest_free == 50 and a.n_free_runs == 1 and a.allocate(50) == 50
    assert a.compact() == []  # already packed
    a.free(0)
    a.free(20)
    with pytest.raises(ValueError, match="no allocated slab starts at slot 30"):
        a.free(30)  # the slab moved: its old start is gone
    del y, z
