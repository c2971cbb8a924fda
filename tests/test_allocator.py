"""SlabAllocator (C++) against SlabAllocatorReference, a slot-by-slot model of the same best-fit policy."""
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


def run_steps(n_slots: int, steps: list[tuple[bool, int]]) -> None:
    real, model = _C.SlabAllocator(n_slots), SlabAllocatorReference(n_slots)
    for is_alloc, value in steps:
        if is_alloc or not model.slabs:
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


@settings(max_examples=60, deadline=None)
@given(n_slots=st.integers(1, 200), steps=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), max_size=120))
def test_matches_model_hypothesis(n_slots, steps):
    run_steps(n_slots, steps)


@pytest.mark.parametrize("seed", range(3))
def test_matches_model_thousands_of_steps(seed):
    rng = random.Random(seed)
    n_slots = rng.randint(300, 1000)
    steps = [(rng.random() < 0.55, rng.randint(0, n_slots // 6)) for _ in range(3000)]
    run_steps(n_slots, steps)


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
