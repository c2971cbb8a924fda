"""Chunked prefill under a token budget, end to end through the engine.

The engine is driven directly (scheduler + Engine + model, no server thread) so every run is
deterministic. The fake model reads each request's whole context back from its slab, so its
outputs only match `fake_reference` if every chunk went to the right positions and slots; the
tiny random transformers models show that chunked outputs equal unchunked ones token for token.
"""
from __future__ import annotations

import random
from typing import Optional

import pytest
import torch

from fake_model import FakeModel, fake_reference
from orca_ext.config import EngineConfig
from orca_ext.engine import Engine
from orca_ext.executor import LocalExecutor
from orca_ext.models import load_model
from orca_ext.request import Request, RequestState
from orca_ext.sampling import SamplingParams
from orca_ext.scheduler import make_scheduler


def make_engine(model, *, budget, max_bs=4, n_slots=2000, prefill_only=None):
    config = EngineConfig(max_batch_size=max_bs, max_num_batched_tokens=budget, prefill_only_tokens=prefill_only)
    return Engine(LocalExecutor(model), make_scheduler(config, n_slots), record_iterations=True)


def run(engine, jobs, *, late_every: int = 2) -> list[Request]:
    """jobs: [(prompt, SamplingParams)]. The first half arrive at once, the rest one every
    `late_every` steps, so later prompts are chunked around running decodes."""
    reqs = [Request(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(jobs)]
    early, late = reqs[:len(reqs) // 2 or 1], reqs[len(reqs) // 2 or 1:]
    for r in early:
        engine.add_request(r)
    steps = 0
    while engine.has_work() or late:
        if late and steps % late_every == 0:
            engine.add_request(late.pop(0))
        engine.step()
        steps += 1
    return reqs


def check_records(engine, budget: int, prefill_only: Optional[int] = None) -> None:
    """Iterations with decodes keep to `budget`, those without to `prefill_only` (when given, some
    iteration took more than `budget`), and some prompt was cut into chunks."""
    for rec in engine.records:
        limit = budget if rec.num_decode_tokens or prefill_only is None else prefill_only
        assert sum(rec.chunk_sizes) <= limit, rec
        assert len(rec.chunk_sizes) == len(rec.request_ids)
        assert rec.num_prefill_tokens + rec.num_decode_tokens == sum(rec.chunk_sizes)
    assert any(0 < c < budget and c > 1 for rec in engine.records for c in rec.chunk_sizes)
    if prefill_only is not None:
        assert any(rec.num_prefill_tokens > budget for rec in engine.records)


@pytest.mark.parametrize("budget", [4, 7, 16])
def test_chunks_reach_the_right_slots_with_the_fake_model(budget):
    rng = random.Random(budget)
    jobs = [([rng.randrange(101) for _ in range(rng.randint(1, 40))], rng.randint(1, 9)) for _ in range(9)]
    engine = make_engine(FakeModel(), budget=budget, n_slots=400)
    reqs = run(engine, [(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in jobs])
    for (prompt, n), r in zip(jobs, reqs):
        assert r.output_token_ids == fake_reference(prompt, n), r.request_id
    check_records(engine, budget)
    # A chunk never reaches the model as more than the budget, and never past its prompt.
    for batch in engine.executor.model.batches:
        assert sum(q_len for _, _, q_len, _ in batch) <= budget
    assert engine.scheduler.allocator.n_used == 0 and not engine.scheduler.pool


@pytest.mark.parametrize("family,budget,prefill_only", [("llama", 5, None), ("qwen3", 23, None), ("llama", 5, 37)])
def test_chunked_outputs_equal_unchunked_token_for_token(tiny_model_dir, family, budget, prefill_only):
    model = load_model(tiny_model_dir(family), device="cpu", dtype=torch.float32)
    rng = random.Random(len(family))
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(1, 70))] for _ in range(7)]
    params = [SamplingParams(max_tokens=rng.randint(2, 10), ignore_eos=True) for _ in prompts]
    # Two sampled requests with their own seeds: a prompt chunk must not draw from a generator.
    params[1] = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=8, temperature=1.3, top_k=20, seed=12, ignore_eos=True)
    jobs = list(zip(prompts, params))
    whole = run(make_engine(model, budget=None), jobs)
    engine = make_engine(model, budget=budget, prefill_only=prefill_only)
    chunked = run(engine, jobs)
    for w, c in zip(whole, chunked):
        assert c.output_token_ids == w.output_token_ids, (family, budget, c.request_id)
    check_records(engine, budget, prefill_only)


def second_joins_after_one_step(engine, first: Request, second: Request, n_rows: int) -> list[tuple]:
    """`first` runs one iteration alone, then `second` joins and both run to the end; the first
    n_rows iterations as (request ids, chunk sizes)."""
    engine.add_request(first)
    engine.step()
    engine.add_request(second)
    while engine.has_work():
        engine.step()
    return [(rec.request_ids, rec.chunk_sizes) for rec in engine.records[:n_rows]]


def test_a_prompt_longer_than_the_budget_runs_over_several_iterations_beside_decodes():
    engine = make_engine(FakeModel(), budget=8, max_bs=4, n_slots=200)
    a = Request("a", list(range(3)), SamplingParams(max_tokens=12, ignore_eos=True))
    b = Request("b", list(range(30)), SamplingParams(max_tokens=2, ignore_eos=True))
    rows = second_joins_after_one_step(engine, a, b, 6)
    # a decodes every iteration while b's 30-token prompt goes in chunks of 7 (budget 8 - 1).
    assert rows == [(("a",), (3,)), (("a", "b"), (1, 7)), (("a", "b"), (1, 7)), (("a", "b"), (1, 7)),
                    (("a", "b"), (1, 7)), (("a", "b"), (1, 2))]
    assert b.output_token_ids == fake_reference(list(range(30)), 2)
    assert a.output_token_ids == fake_reference(list(range(3)), 12)


def test_prompts_take_the_prefill_only_budget_until_a_request_generates():
    engine = make_engine(FakeModel(), budget=8, max_bs=4, n_slots=300, prefill_only=20)
    a = Request("a", list(range(50)), SamplingParams(max_tokens=3, ignore_eos=True))
    b = Request("b", list(range(7, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
    rows = second_joins_after_one_step(engine, a, b, 5)
    # Alone, and then with b waiting, a's prompt runs 20 tokens at a time; b takes the rest of the
    # 20 in a's last chunk; once a generates, b's prompt goes beside a's decodes 7 tokens at a time.
    assert rows == [(("a",), (20,)), (("a",), (20,)), (("a", "b"), (10, 10)), (("a", "b"), (1, 7)),
                    (("a", "b"), (1, 7))]
    assert a.output_token_ids == fake_reference(list(range(50)), 3)
    assert b.output_token_ids == fake_reference(list(range(7, 40)), 2)


def test_a_last_prompt_chunk_in_flight_counts_as_generating():
    """With two batches in flight, a request whose prompt's last chunk is in the other batch
    decodes next: the batch selected meanwhile keeps to the chunk budget."""
    config = EngineConfig(max_batch_size=4, max_num_batched_tokens=8, prefill_only_tokens=32)
    sched = make_scheduler(config, 300, n_workers=2)
    a = Request("a", list(range(30)), SamplingParams(max_tokens=4))
    b = Request("b", list(range(60)), SamplingParams(max_tokens=4))
    sched.add(a)
    assert sched.schedule() == [a] and a.num_scheduled == 30  # alone: the whole prompt in one chunk
    sched.add(b)
    assert sched.schedule() == [b] and b.num_scheduled == 8   # a generates once its batch is back


def test_abort_during_a_half_done_prefill_frees_the_slab():
    engine = make_engine(FakeModel(), budget=8, n_slots=100)
    a = Request("a", list(range(40)), SamplingParams(max_tokens=5))
    engine.add_request(a)
    engine.step()
    assert a.state is RequestState.INCREMENT and a.num_cached == 8 and not a.output_token_ids
    assert engine.scheduler.allocator.n_used == 45
    assert engine.abort_request(a)
    assert engine.scheduler.allocator.n_used == 0 and engine.scheduler.n_rsrv == 0 and a.slab_start == -1
    # The freed slots serve the next request, which must not see a's rows.
    b = Request("b", list(range(5, 60)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request(b)
    while engine.has_work():
        engine.step()
    assert b.output_token_ids == fake_reference(list(range(5, 60)), 4)
    assert a.finish_reason == "abort" and engine.scheduler.allocator.n_used == 0


def test_server_defaults_pick_the_budget_and_invariance_per_device(tiny_model_dir):
    """The defaults resolve per device: on CPU the CPU chunk budget (never below max_batch_size,
    since every running request decodes each iteration) and batch-invariant kernels, which the
    Server sets as the process's kernel mode."""
    from orca_ext import modes
    from orca_ext.config import CHUNK_BUDGET_BY_DEVICE, PREFILL_ONLY_BUDGET_BY_DEVICE
    from orca_ext.options import _budget
    from orca_ext.server import Server

    path = str(tiny_model_dir("llama"))
    with Server(path, device="cpu", n_slots=512, max_batch_size=4) as server:
        assert server.max_num_batched_tokens == CHUNK_BUDGET_BY_DEVICE["cpu"] > 4
        assert server.prefill_only_tokens == PREFILL_ONLY_BUDGET_BY_DEVICE["cpu"] > CHUNK_BUDGET_BY_DEVICE["cpu"]
        assert server.stats()["prefill_only_tokens"] == server.prefill_only_tokens
        assert server.batch_invariant is True and modes.current().batch_invariant is True
    big = CHUNK_BUDGET_BY_DEVICE["cpu"] + 72
    with Server(path, device="cpu", n_slots=512, max_batch_size=big, batch_invariant=False) as server:
        assert server.max_num_batched_tokens == big
        assert server.batch_invariant is False and modes.current().batch_invariant is False
    with Server(path, device="cpu", n_slots=512, max_num_batched_tokens=None) as server:
        assert server.max_num_batched_tokens is None
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_batch_size \(32\)"):
        Server(path, device="cpu", n_slots=512, max_num_batched_tokens=16)
    assert [_budget(v) for v in ("auto", "AUTO", "none", "64")] == ["auto", "auto", None, 64]
