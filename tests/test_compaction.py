"""Slab compaction end to end: a fragmentation trace where the queue head waits without compaction
and is admitted in the same iteration with it, outputs unchanged across the moves (the fake model
reads every context back from its slab; the tiny model is checked against transformers), no slot
leaks, and the counters in stats().

Trace (100 slots): a [0,30), b [30,70), c [70,100) fill the cache; a and c finish after 3 tokens
and leave two free runs of 30 around b; d needs 50 contiguous slots. Without compaction d waits
until b finishes; with it, b slides to slot 0 and d starts at once.
"""
from __future__ import annotations

import threading

import pytest
import torch

from fake_model import FakeModel, fake_reference
from orca_ext.config import EngineConfig
from orca_ext.engine import Engine
from orca_ext.executor import LocalExecutor
from orca_ext.request import Request
from orca_ext.sampling import SamplingParams
from orca_ext.scheduler import make_scheduler
from orca_ext.server import Server

A, B, C, D = list(range(3, 30)), list(range(40, 70)), list(range(5, 32)), list(range(60, 100))
TRACE = [("a", A, 3), ("b", B, 10), ("c", C, 3), ("d", D, 10)]  # reservations 30, 40, 30, 50


def run_trace(model, *, compaction: bool, n_workers: int = 1, budget=None):
    sched = make_scheduler(EngineConfig(max_batch_size=8, max_num_batched_tokens=budget), 100, n_workers)
    engine = Engine(LocalExecutor(model), sched, record_iterations=True, slab_compaction=compaction)
    reqs = {name: Request(name, prompt, SamplingParams(max_tokens=n, ignore_eos=True)) for name, prompt, n in TRACE}
    for name in "abc":
        engine.add_request(reqs[name])
    engine.step()
    engine.add_request(reqs["d"])  # arrives while the cache is full
    while engine.has_work():
        engine.step()
    first_d = next(rec.index for rec in engine.records if "d" in rec.request_ids)
    last_b = max(rec.index for rec in engine.records if "b" in rec.request_ids)
    assert sched.allocator.n_used == 0 and sched.n_rsrv == 0 and not sched.pool  # no slot leaks
    return reqs, engine, first_d, last_b


@pytest.mark.parametrize("n_workers", [1, 2])
def test_without_compaction_the_head_waits_with_it_it_is_admitted_at_once(n_workers):
    _, _, first_d, last_b = run_trace(FakeModel(), compaction=False, n_workers=n_workers)
    assert first_d > last_b  # d only fit once b had left
    reqs, engine, first_d, last_b = run_trace(FakeModel(), compaction=True, n_workers=n_workers)
    # a and c leave after the iteration of their 3rd token; d joins the very next iteration (with
    # two stages a and c run in different batches, and the slabs move once both have returned).
    last_ac = max(rec.index for rec in engine.records if {"a", "c"} & set(rec.request_ids))
    assert first_d <= last_ac + n_workers and first_d < last_b
    assert engine.num_compactions == 1
    # b's cached rows (its prompt and the tokens before the move) went along with its slab.
    for name, prompt, n in TRACE:
        assert reqs[name].output_token_ids == fake_reference(prompt, n), name
    assert engine.compaction_moved_bytes > 0 and engine.compaction_moved_bytes % engine.executor.kv_bytes_per_slot() == 0


def test_compaction_with_chunked_prefill():
    reqs, engine, first_d, last_b = run_trace(FakeModel(), compaction=True, budget=16)
    assert engine.num_compactions == 1 and first_d < last_b
    for name, prompt, n in TRACE:
        assert reqs[name].output_token_ids == fake_reference(prompt, n), name


def test_outputs_of_a_real_model_are_unchanged_across_a_compaction(tiny_model_dir):
    from tiny_models import reference_greedy

    model_dir = tiny_model_dir("llama")
    from orca_ext.models import load_model

    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    reqs, engine, first_d, last_b = run_trace(model, compaction=True)
    assert engine.num_compactions == 1 and first_d < last_b
    bytes_per_slot = model.kv_bytes_per_slot()
    # b had its 30 prompt tokens and 2 generated ones cached when it moved.
    assert engine.compaction_moved_bytes == (len(B) + 2) * bytes_per_slot
    for name, prompt, n in TRACE:
        assert reqs[name].output_token_ids == reference_greedy(model_dir, prompt, n), name


def test_server_counts_compactions_in_stats():
    gate = threading.Event()  # holds the first forward until all four requests are queued
    with Server(FakeModel(gate=gate), n_slots=100, max_batch_size=8) as server:
        ids = [server.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for _, p, n in TRACE]
        gate.set()
        outs = [server.result(rid) for rid in ids]
        assert [o.token_ids for o in outs] == [fake_reference(p, n) for _, p, n in TRACE]
        st = server.stats()
        assert st["compactions"] == 1 and st["slots_allocated"] == 0 and st["slots_reserved"] == 0
        assert st["compaction_moved_bytes"] > 0
    with Server(FakeModel(), n_slots=100, max_batch_size=8, slab_compaction=False) as server:
        outs = server.generate([p for _, p, _ in TRACE], [SamplingParams(max_tokens=n, ignore_eos=True)
                                                          for _, _, n in TRACE])
        assert [o.token_ids for o in outs] == [fake_reference(p, n) for _, p, n in TRACE]
        assert server.stats()["compactions"] == 0
