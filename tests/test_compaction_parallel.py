"""Slab compaction with the KV pools in parallel workers (DistributedExecutor.move_slabs).

Executor level: rows prefilled through the workers, moved with move_slabs (one move overlapping
its own source), then decoded from their new slots give the logits of the single-process model
that ran the same move; bad moves are refused naming the row and the limit.
End to end: the fragmentation trace of tests/test_compaction.py (100 slots; a and c leave holes
around b; d needs 50 contiguous slots) forces a compaction while b is decoding, and a tensor-
and a pipeline-parallel Server give, request by request, the single-process Server's tokens.
A move that fails on a worker fails the group like any other failure (last: it breaks its group).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from orca_ext import ops
from orca_ext.models import ForwardBatch, load_model
from orca_ext.sampling import SamplingParams
from orca_ext.server import Server

A, B, C, D = list(range(3, 30)), list(range(40, 70)), list(range(5, 32)), list(range(60, 100))
TRACE = [("a", A, 3), ("b", B, 10), ("c", C, 3), ("d", D, 10)]  # reservations 30, 40, 30, 50
N_SLOTS = 100


def start(model_dir, tp: int, pp: int) -> Server:
    return Server(str(model_dir), device="cpu", dtype="float32", n_slots=N_SLOTS, max_batch_size=8,
                  tensor_parallel_size=tp, pipeline_parallel_size=pp, slab_compaction=True)


@pytest.fixture(scope="module")
def tp2(tiny_model_dir):
    with start(tiny_model_dir("llama"), 2, 1) as server:
        yield server


@pytest.fixture(scope="module")
def pp2(tiny_model_dir):
    with start(tiny_model_dir("llama"), 1, 2) as server:
        yield server


@pytest.fixture(scope="module")
def single_process_outputs(tiny_model_dir) -> list:
    """The trace's token ids from the single-process Server (the reference)."""
    with Server(str(tiny_model_dir("llama")), device="cpu", dtype="float32", n_slots=N_SLOTS,
                max_batch_size=8) as server:
        return [o.token_ids for o in run_trace(server)]


def run_trace(server: Server) -> list:
    """Submit the whole trace while the first launch is held, so a, b, c take [0,30), [30,70),
    [70,100) in that order whatever the timing, and d waits for a contiguous run of 50."""
    executor = server.executor
    launch = executor.execute
    release = threading.Event()

    def gated(batch, **kw):
        release.wait(60)
        return launch(batch, **kw)

    executor.execute = gated
    try:
        ids = [server.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True)) for _, prompt, n in TRACE]
        release.set()
        return [server.result(rid, timeout=120) for rid in ids]
    finally:
        release.set()
        executor.execute = launch


# -- executor level -----------------------------------------------------------------------------------
PREFILL = [([5, 9, 200, 31, 7, 1, 2, 3], 0, 40), ([44, 45, 46], 0, 70)]
MOVES = [(40, 35, 8), (70, 0, 3)]          # the first overlaps its own source
DECODE = [([11], 8, 35), ([12], 3, 0)]     # the same rows, read from where they moved
UNMOVED = [([11], 8, 40), ([12], 3, 70)]


@pytest.mark.parametrize("which", ["tp2", "pp2"])
def test_move_slabs_moves_the_rows_in_every_worker(which, request, tiny_model_dir):
    server = request.getfixturevalue(which)
    executor = server.executor
    executor.forward_logits(PREFILL).result(timeout=60)
    executor.move_slabs(MOVES)
    got = executor.forward_logits(DECODE).result(timeout=60)

    model = load_model(tiny_model_dir("llama"), "cpu", torch.float32)
    model.allocate_kv_cache(N_SLOTS)
    model.forward(ForwardBatch.build(PREFILL, "cpu"))
    unmoved = model.forward(ForwardBatch.build(UNMOVED, "cpu"))
    ops.slab_move(model.kv_pools, torch.tensor(MOVES, dtype=torch.int64))
    want = model.forward(ForwardBatch.build(DECODE, "cpu"))
    torch.testing.assert_close(want, unmoved, rtol=0, atol=1e-6)  # the move itself changes nothing
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bad_moves_are_refused_naming_the_row_and_the_limit(tp2):
    executor = tp2._engine.executor
    with pytest.raises(ValueError, match=r"moves\[1\] = \(src=90, dst=0, n=20\).*n_slots=100"):
        executor.move_slabs([(0, 10, 5), (90, 0, 20)])
    with pytest.raises(ValueError, match=r"moves\[0\] = \(src=3, dst=-1, n=2\)"):
        executor.move_slabs([(3, -1, 2)])
    with pytest.raises(ValueError, match=r"moves\[0\] must be \(src, dst, n\)"):
        executor.move_slabs([(3, 1)])
    assert executor.error is None


# -- end to end -------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tp2", "pp2"])
def test_compacting_server_matches_single_process(which, request, single_process_outputs):
    server = request.getfixturevalue(which)
    before = server.stats()["compactions"]
    outs = run_trace(server)
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert [o.token_ids for o in outs] == single_process_outputs
    st = server.stats()
    assert st["compactions"] > before, "the trace did not force a compaction"
    assert (st["slots_reserved"], st["slots_allocated"], st["healthy"]) == (0, 0, True)


# -- faults (last: breaks the pipeline group) -----------------------------------------------------------
def test_a_move_that_fails_on_the_workers_fails_the_group(pp2):
    executor = pp2._engine.executor
    executor._check_moves = lambda moves: [(0, N_SLOTS + 5, 10)]  # what the driver would refuse
    executor.move_slabs([(0, 0, 1)])
    deadline = time.monotonic() + 30
    while executor.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    error = executor.error
    assert error is not None and "(pipeline stage " in error
    assert "failed: RuntimeError: moving KV slabs [[0, 105, 10]] failed: ValueError" in error
    # Everything posted afterwards fails with that error at once.
    with pytest.raises(Exception, match="moving KV slabs"):
        executor.forward_logits(DECODE).result(timeout=10)
    while any(w["alive"] for w in executor.describe_workers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(w["alive"] for w in executor.describe_workers())  # the group was stopped
