"""The serving simulator (orca_ext/sim/): exact schedules under a constant cost, the roofline's
arithmetic, least-squares recovery of known rates, determinism, traces and the CLI."""
from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest

from orca_ext.config import EngineConfig
from orca_ext.request import IterationRecord
from orca_ext.sim.cli import main as simulate_main
from orca_ext.sim.cost import ConstantCost, Hardware, ModelShape, Roofline, kv_slots
from orca_ext.sim.fit import Calibration, calibration_from_records, fit_hardware, fit_max_form, fit_trace, nnls
from orca_ext.sim.loop import simulate
from orca_ext.sim.plan import SLO, plan
from orca_ext.sim.presets import MODELS, load_hardware, save_hardware
from orca_ext.sim.trace import TraceRequest, load_jsonl, prompt_tokens, save_jsonl, synthetic
from orca_ext.sim.work import Work

WHOLE = dict(max_num_batched_tokens=None)
SEED_EXAMPLE = [TraceRequest(0.0, 1, n) for n in (100, 500, 50, 300)]


def idle_slots(result, batch_size):
    return sum(batch_size - it.rows for it in result.iterations)


def test_orca_and_static_on_the_seed_example_match_the_hand_schedule():
    # Two slots. Static: {100, 500} runs 500 iterations, then {50, 300} 300 more; a finished
    # member's slot stays empty until its whole batch ends (400 + 250 idle slot-iterations).
    # Orca: the 50 joins at iteration 101 and the 300 at 151; only 451..500 have an empty slot.
    static = simulate(SEED_EXAMPLE, EngineConfig(scheduler="static", max_batch_size=2), ConstantCost(), 10_000)
    orca = simulate(SEED_EXAMPLE, EngineConfig(max_batch_size=2, **WHOLE), ConstantCost(), 10_000)
    assert len(static.iterations) == 800 and idle_slots(static, 2) == 650
    assert len(orca.iterations) == 500 and idle_slots(orca, 2) == 50
    assert [(r.first_token, r.finish) for r in static.requests] == [(1, 100), (1, 500), (501, 550), (501, 800)]
    assert [(r.first_token, r.finish) for r in orca.requests] == [(1, 100), (1, 500), (101, 150), (151, 450)]


def test_host_time_is_serial_with_the_forward():
    trace = [TraceRequest(0.0, 1, 10)]
    r = simulate(trace, EngineConfig(max_batch_size=1, **WHOLE), ConstantCost(iteration=2.0, host=0.5), 100)
    assert r.requests[0].finish == pytest.approx(10 * 2.0 + 9 * 0.5)


def test_chunked_prefill_splits_a_prompt_under_the_budget():
    # A 300-token prompt under a 128-token budget: chunks 128, 128, 44; the token comes with the last.
    trace = [TraceRequest(0.0, 300, 3)]
    r = simulate(trace, EngineConfig(max_batch_size=8, max_num_batched_tokens=128, prefill_only_tokens=None),
                 ConstantCost(), 1000)
    assert [it.prefill_tokens for it in r.iterations] == [128, 128, 44, 0, 0]
    assert r.requests[0].first_token == 3 and r.requests[0].finish == 5


def test_iterations_without_decodes_take_the_prefill_only_budget():
    # Two prompts (700 and 500 tokens) run in chunks of 200 while neither generates (the second
    # starts in the first's last chunk); once the first generates, the second continues beside its
    # decodes under the 64-token budget (63 prompt tokens and one decode).
    trace = [TraceRequest(0.0, 700, 20), TraceRequest(0.5, 500, 2)]
    config = EngineConfig(max_batch_size=8, max_num_batched_tokens=64, prefill_only_tokens=200)
    r = simulate(trace, config, ConstantCost(), 2000)
    assert [it.prefill_tokens for it in r.iterations[:7]] == [200, 200, 200, 200, 63, 63, 63]
    assert [it.decode_tokens for it in r.iterations[:7]] == [0, 0, 0, 0, 1, 1, 1]


def test_arrivals_wait_for_the_clock():
    trace = [TraceRequest(0.0, 1, 2), TraceRequest(10.5, 1, 2)]
    r = simulate(trace, EngineConfig(max_batch_size=4, **WHOLE), ConstantCost(), 100)
    assert [(q.first_token, q.finish) for q in r.requests] == [(1, 2), (11.5, 12.5)]


def test_two_pipeline_stages_keep_two_batches_in_flight():
    # 4 requests of 10 tokens, 2 stages of 1 s. The prompt batch returns at t=2; then the decodes
    # split into two batches of 2 (the even share of n_workers = 2), and one batch returns per
    # second from t=4: 18 decode batches, the last at t=21.
    trace = [TraceRequest(0.0, 1, 10) for _ in range(4)]
    r = simulate(trace, EngineConfig(max_batch_size=4, **WHOLE), ConstantCost(n_stages=2), 100)
    assert len(r.iterations) == 19
    assert [it.rows for it in r.iterations] == [4] + [2] * 18
    assert [it.complete for it in r.iterations] == [2.0] + [float(t) for t in range(4, 22)]
    assert sorted(q.finish for q in r.requests) == [20.0, 20.0, 21.0, 21.0]


def test_a_full_cache_makes_requests_wait_for_slots():
    # 20 slots hold one request of 1 + 10 at a time: the second starts when the first leaves.
    trace = [TraceRequest(0.0, 1, 10), TraceRequest(0.0, 1, 10)]
    r = simulate(trace, EngineConfig(max_batch_size=4, **WHOLE), ConstantCost(), 20)
    assert [q.finish for q in r.requests] == [10, 20]


def test_work_counts_attention_context():
    w = Work.of([(3, 5, True), (1, 10, True), (4, 0, False)])
    assert (w.rows, w.emitting, w.new_tokens) == (3, 2, 8)
    assert w.attended == (6 + 7 + 8) + 11 + (1 + 2 + 3 + 4)
    assert w.context == 8 + 11 + 4


SHAPE = ModelShape("t", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=100,
                   param_bytes=4)
HW = Hardware("h", "test", flops_per_s=1e9, bytes_per_s=1e8, attention_flops_per_s=2e8, overhead_s=1e-3,
              per_row_s=1e-4, link_bytes_per_s=1e9, link_latency_s=1e-5, overlap=False, device_type="cpu")


def test_roofline_terms_by_hand():
    w = Work.of([(10, 0, True), (1, 20, True)])
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    flops = 2 * (4 * layer * 11 + 64 * 100 * 2)
    attn = 4 * 4 * 4 * 16 * (55 + 21)
    nbytes = (4 * layer + 64 * 100) * 4 + (2 * 4 * 2 * 16 * 4) * (31 + 11)
    assert SHAPE.gemm_flops(w) == flops and SHAPE.attention_flops(w) == attn and SHAPE.memory_bytes(w) == nbytes
    one = Roofline(SHAPE, HW)
    assert one.stage_time(w) == pytest.approx(1e-3 + 2e-4 + flops / 1e9 + attn / 2e8 + nbytes / 1e8)
    assert Roofline(SHAPE, dataclasses.replace(HW, overlap=True)).stage_time(w) == pytest.approx(
        1e-3 + 2e-4 + max(flops / 1e9 + attn / 2e8, nbytes / 1e8))
    tp = Roofline(SHAPE, HW, tp=2)
    ring = 2 * 4 * (2 * 1 / 2 * 11 * 64 * 4 / 1e9 + 1e-5)  # 2 all-reduces per layer, 4 layers
    assert tp.stage_time(w) == pytest.approx(1e-3 + (2e-4 + flops / 1e9 + attn / 2e8 + nbytes / 1e8) / 2 + ring)
    # A stage of two: half the layers' work and the whole fixed cost; the last one also runs the
    # output projection (2 emitting rows) and reads its weights.
    pp = Roofline(SHAPE, HW, pp=2)
    kv = (2 * 4 * 2 * 16 * 4) * (31 + 11)
    first = 2 * 2 * layer * 11 / 1e9 + attn / 2 / 2e8 + (2 * layer * 4 + kv / 2) / 1e8
    head = 2 * 64 * 100 * 2 / 1e9 + 64 * 100 * 4 / 1e8
    assert pp.stage_time(w, 0) == pytest.approx(1e-3 + 1e-4 + first)
    assert pp.stage_time(w, 1) == pytest.approx(1e-3 + 1e-4 + first + head)
    assert pp.stage_time(w, 0) + pp.stage_time(w, 1) == pytest.approx(2e-3 + one.stage_time(w) - 1e-3)
    assert pp.handoff_time(w) == pytest.approx(11 * 64 * 4 / 1e9 + 1e-5)


def test_nnls_is_exact_and_non_negative():
    rng = np.random.default_rng(3)
    a = rng.random((50, 4))
    x = np.array([2.0, 0.0, 0.5, 3.0])
    assert np.allclose(nnls(a, a @ x), x, atol=1e-9)
    b = a @ np.array([1.0, -1.0, 0.0, 0.0])
    assert (nnls(a, b) >= 0).all()


def decode_and_chunk_works(rng, n):
    """What a fit run holds: decodes of 1..16 rows at varied contexts and prompt chunks of up to
    128 tokens beside decodes, so small decodes are memory-bound and the rest compute-bound."""
    works = []
    for _ in range(n):
        rows = [(1, int(rng.integers(1, 1500)), True) for _ in range(int(rng.integers(1, 17)))]
        if rng.random() < 0.3:
            rows[0] = (int(rng.integers(8, 129)), int(rng.integers(0, 400)), bool(rng.random() < 0.5))
        works.append(Work.of(rows))
    return works


def test_fit_recovers_known_rates_of_the_max_form_from_synthetic_iterations():
    # A CPU-like truth: a 1-row decode streams the weights (memory-bound), 16 rows or a chunk
    # are compute-bound; the fit sees both sides of the knee and must place it.
    shape = dataclasses.replace(SHAPE, n_layers=30, d_model=576, d_ff=1536, vocab=4096)
    truth = Hardware("h", "test", flops_per_s=4.7e10, bytes_per_s=3e10, attention_flops_per_s=4.7e10,
                     overhead_s=2e-3, per_row_s=3e-3, host_s=7e-4, host_per_row_s=2e-5, overlap=True)
    rng = np.random.default_rng(11)
    works = decode_and_chunk_works(rng, 300)
    model = Roofline(shape, truth)
    assert {model.memory_time(w) > model.compute_time(w) for w in works} == {True, False}
    noise = lambda n: 1 + 0.01 * rng.standard_normal(n)  # noqa: E731
    forward = [model.stage_time(w) for w in works] * noise(len(works))
    host = [model.host_time(w) for w in works] * noise(len(works))
    cal = Calibration(works, list(forward), [w.rows for w in works], list(host))
    fit = fit_hardware(shape, cal, "fit", "synthetic")
    assert fit.overlap
    for name in ("flops_per_s", "bytes_per_s", "attention_flops_per_s", "per_row_s", "host_s", "host_per_row_s"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert fit.overhead_s == pytest.approx(truth.overhead_s, abs=5e-4)
    fitted = Roofline(shape, fit)
    for rows in (1, 2, 16):  # out of sample: decodes of one context, 1..16 rows
        w = Work.of([(1, 700, True)] * rows)
        assert fitted.stage_time(w) == pytest.approx(model.stage_time(w), rel=0.03)


def test_fit_max_form_finds_the_knee_and_sees_no_bandwidth_where_there_is_none():
    rng = np.random.default_rng(5)
    tokens = rng.integers(1, 17, size=200).astype(float)
    fixed = np.ones((200, 1))
    compute = (tokens * 1e9)[:, None]
    memory = 5e8 * (1 + 0.1 * rng.random(200))
    t = 0.004 + np.maximum(compute[:, 0] / 5e10, memory / 2.5e10)   # the knee near 10 tokens
    coef, z, _ = fit_max_form(fixed, compute, memory, t)
    assert coef[0] == pytest.approx(0.004, rel=0.02)
    assert 1 / coef[1] == pytest.approx(5e10, rel=0.02) and 1 / z == pytest.approx(2.5e10, rel=0.02)
    coef, z, _ = fit_max_form(fixed, compute, memory, 0.004 + compute[:, 0] / 5e10)
    assert np.max(memory * z) < 1e-3 * np.min(compute[:, 0] * coef[1])  # compute alone explains it
    assert 1 / coef[1] == pytest.approx(5e10, rel=0.02)


def test_calibration_reconstructs_positions_from_records():
    recs = [IterationRecord(0, ("a", "b"), 7, 0, 0, launch_time=0.0, complete_time=1.0, chunk_sizes=(4, 3)),
            IterationRecord(1, ("a", "b"), 2, 1, 0, launch_time=1.5, complete_time=2.0, chunk_sizes=(2, 1)),
            IterationRecord(2, ("a",), 0, 1, 0, launch_time=2.25, complete_time=3.0, chunk_sizes=(1,))]
    cal = calibration_from_records(recs, {"a": 6, "b": 3})
    assert cal.works[0] == Work.of([(4, 0, False), (3, 0, True)])
    assert cal.works[1] == Work.of([(2, 4, True), (1, 3, True)])
    assert cal.works[2] == Work.of([(1, 6, True)])
    assert cal.forward_s == [1.0, 0.5, 0.75] and cal.host_s == [0.5, 0.25] and cal.host_rows == [2, 2]


def test_host_gaps_where_the_engine_waited_for_an_arrival_are_not_host_time():
    # "a" finishes at iteration 0; "b" arrives later: the engine idled, so that gap is dropped.
    recs = [IterationRecord(0, ("a",), 0, 1, 0, launch_time=0.0, complete_time=1.0, chunk_sizes=(1,)),
            IterationRecord(1, ("b",), 2, 0, 0, launch_time=9.0, complete_time=10.0, chunk_sizes=(2,)),
            IterationRecord(2, ("b",), 0, 1, 0, launch_time=10.5, complete_time=11.0, chunk_sizes=(1,))]
    cal = calibration_from_records(recs, {"a": 1, "b": 2})
    assert cal.host_s == [0.5] and cal.host_rows == [1]


def test_runs_are_deterministic_for_a_seed():
    cost = Roofline(MODELS["gpt3-13b"], load_hardware("a100-40gb"))
    config = EngineConfig(max_batch_size=16)
    a = simulate(synthetic(60, 5.0, (32, 512), (1, 128), seed=4), config, cost, 20_000)
    b = simulate(synthetic(60, 5.0, (32, 512), (1, 128), seed=4), config, cost, 20_000)
    c = simulate(synthetic(60, 5.0, (32, 512), (1, 128), seed=5), config, cost, 20_000)
    assert a.requests == b.requests and a.iterations == b.iterations
    assert a.requests != c.requests


def test_orca_beats_static_at_the_same_load():
    cost = Roofline(MODELS["gpt3-13b"], load_hardware("a100-40gb"))
    trace = synthetic(80, 4.0, (32, 512), (1, 256), seed=2)
    orca = simulate(trace, EngineConfig(max_batch_size=16), cost, 20_000).summary()
    static = simulate(trace, EngineConfig(scheduler="static", max_batch_size=16), cost, 20_000).summary()
    assert orca["median_normalized_latency_s"] < static["median_normalized_latency_s"]


def test_trace_jsonl_round_trip_and_errors(tmp_path):
    trace = synthetic(5, 2.0, (3, 9), (1, 4), seed=1)
    path = tmp_path / "t.jsonl"
    save_jsonl(trace, path)
    assert load_jsonl(path) == trace
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0, "prompt_len": 3, "output_len": 2}\n{"arrival": -1, "prompt_len": 3, "output_len": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: arrival"):
        load_jsonl(bad)
    bad.write_text('{"arrival": 0, "prompt_len": 1e9, "output_len": 2}\n')
    with pytest.raises(ValueError, match=r":1: prompt_len"):
        load_jsonl(bad)
    with pytest.raises(ValueError, match="rate"):
        synthetic(3, 0.0, (1, 2), (1, 2))
    with pytest.raises(ValueError, match="longest prompt"):
        synthetic(1000, 1.0, (1, 1 << 20), (1, 2))
    bad.write_text('{"arrival": 0, "prompt_len": 1048576, "output_len": 1}\n' * 65)
    with pytest.raises(ValueError, match=r":65: the trace's prompts pass"):
        load_jsonl(bad)
    shared = synthetic(4, 2.0, (3, 9), (1, 4), seed=1, shared_prefix=16)
    save_jsonl(shared, path)
    assert load_jsonl(path) == shared and all(r.prefix_len == 16 for r in shared)
    assert [prompt_tokens(i, r)[:16] for i, r in enumerate(shared)] == [prompt_tokens(0, shared[0])[:16]] * 4
    assert len({t for i, r in enumerate(shared) for t in prompt_tokens(i, r)[16:]}) == \
        sum(r.prompt_len - 16 for r in shared)  # nothing else is shared
    bad.write_text('{"arrival": 0, "prompt_len": 3, "output_len": 2, "prefix_id": 1, "prefix_len": 4}\n')
    with pytest.raises(ValueError, match=r":1: prefix_len must be in \[0, prompt_len=3\]"):
        load_jsonl(bad)
    bad.write_text('{"arrival": 0, "prompt_len": 3, "output_len": 2, "prefix_id": -1, "prefix_len": 2}\n')
    with pytest.raises(ValueError, match=r":1: prefix_id"):
        load_jsonl(bad)


def test_a_request_larger_than_the_cache_is_refused():
    with pytest.raises(ValueError, match="needs 30 KV slots"):
        simulate([TraceRequest(0.0, 10, 20)], EngineConfig(), ConstantCost(), 29)


def test_plan_finds_the_fewest_replicas_that_meet_the_slo():
    # Constant-rate hardware where one replica is overloaded: more replicas cut the latency.
    trace = synthetic(60, 40.0, (32, 256), (16, 64), seed=3)
    hw = load_hardware("a100-40gb")
    slo = SLO(median_normalized_latency_s=0.03)
    best, tried = plan(trace, MODELS["gpt3-13b"], hw, slo, tps=(1,), pps=(1,), batch_sizes=(8,), max_replicas=8)
    assert best is not None and best.meets_slo and best.summary["median_normalized_latency_s"] <= 0.03
    fewer = [c for c in tried if c.replicas < best.replicas]
    assert all(not c.meets_slo for c in fewer)


def test_cli_simulates_and_plans(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert simulate_main(["--requests", "30", "--rate", "3", "--output-len", "1", "64", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["requests"] == 30 and summary["output_tokens_per_s"] > 0
    hw = tmp_path / "hw.json"
    save_hardware(HW, hw)
    assert load_hardware(hw) == HW
    png = tmp_path / "plan.png"
    assert simulate_main(["--plan", "--slo-latency", "0.05", "--requests", "20", "--rate", "5", "--output-len", "1", "32",
                          "--plan-tp", "1", "2", "--plan-pp", "1", "--plan-batch", "8", "--max-replicas", "2",
                          "--png", str(png)]) == 0
    assert "cheapest:" in capsys.readouterr().out and png.stat().st_size > 0
    assert simulate_main(["--plan"]) == 2
    assert simulate_main(["--plan", "--slo-latency", "1", "--plan-tp", "0"]) == 2
    assert simulate_main(["--plan", "--slo-latency", "-1"]) == 2
    assert simulate_main(["--plan", "--slo-latency", "1", "--max-replicas", "100000"]) == 2
    assert simulate_main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert math.isfinite(summary["p99_ttft_s"])


@pytest.mark.parametrize("options, n_slots, shared_prefix", [
    (dict(max_batch_size=4, max_num_batched_tokens=16), 400, 0),           # chunked prefill
    (dict(max_batch_size=3, max_num_batched_tokens=None), 400, 0),         # whole prompts
    (dict(scheduler="static", max_batch_size=4), 400, 0),
    (dict(max_batch_size=6, max_num_batched_tokens=24), 70, 0),            # a full cache, one compaction
    (dict(max_batch_size=4, max_num_batched_tokens=16, prefix_caching=True,
          prefix_cache_block_size=4), 400, 21),                            # one system prompt, cached
])
def test_the_simulator_makes_the_engines_batches(options, n_slots, shared_prefix):
    # All requests queued at t=0 with one batch in flight: the engine's batches do not depend on
    # time, so the real Engine (fake model) and the simulator must select the same ones.
    from fake_model import FakeModel
    from orca_ext.engine import Engine
    from orca_ext.executor import LocalExecutor
    from orca_ext.request import Request
    from orca_ext.sampling_params import SamplingParams
    from orca_ext.scheduler import make_scheduler

    from orca_ext.prefix_cache import PrefixCache

    trace = synthetic(14, float("inf"), (1, 40), (1, 30), seed=8, shared_prefix=shared_prefix)
    config = EngineConfig(**{"prefix_caching": False, **options})
    sim = simulate(trace, config, ConstantCost(), n_slots, device_type="cpu")
    resolved = config.scheduling_for("cpu")  # the budgets the simulator priced
    cache = PrefixCache(n_slots, config.prefix_cache_block_size) if config.prefix_caching else None
    engine = Engine(LocalExecutor(FakeModel()), make_scheduler(resolved, n_slots), record_iterations=True,
                    prefix_cache=cache)
    # The fake model's vocabulary is small: the same simulated id becomes the same random id, so
    # the prompts share exactly what the simulated ones share (a chance match of a whole block of
    # random ids aside, which this seed does not have).
    rng, small = random.Random(0), {}
    for i, r in enumerate(trace):
        ids = [small.setdefault(t, rng.randrange(1, 100)) for t in prompt_tokens(i, r)]
        engine.add_request(Request(str(i), ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    assert [(tuple(map(int, rec.request_ids)), rec.chunk_sizes) for rec in engine.records] == \
        [(it.requests, it.chunk_sizes) for it in sim.iterations]
    assert sim.num_compactions == engine.num_compactions == (1 if n_slots == 70 else 0)
    if shared_prefix:  # later requests take the system prompt's rows from the cache, in both
        assert cache.stats.hit_tokens >= shared_prefix
        computed = sum(it.prefill_tokens for it in sim.iterations)
        assert computed == sum(r.prompt_len for r in trace) - cache.stats.hit_tokens


def test_the_fit_workload_spans_one_to_sixteen_rows():
    # At about this CPU's speed (a decode of a few rows ~25 ms, a 128-token chunk ~0.3 s) the
    # trickle half runs alone or in small batches and the burst fills all 16 rows, then drains.
    cost = ConstantCost(iteration=0.025)
    trace = fit_trace(32, seed=1)
    assert [r.arrival for r in trace[:16]] == pytest.approx([0.5 * i for i in range(16)])
    r = simulate(trace, EngineConfig(max_batch_size=16), cost, 20_000, device_type="cpu")
    rows = {it.rows for it in r.iterations if it.prefill_tokens == 0}
    assert {1, 2, 16} <= rows and len(rows) >= 12
    assert any(it.prefill_tokens >= 64 and it.decode_tokens > 0 for it in r.iterations)  # chunks beside decodes


def test_the_fit_keeps_the_total_time_of_a_run_with_stalls():
    # A loaded machine: a few iterations stall 3-10x. The weighted fit follows the bulk, and its
    # terms are then scaled so the model's summed time is the run's.
    shape = dataclasses.replace(SHAPE, n_layers=30, d_model=576, d_ff=1536, vocab=4096)
    truth = Hardware("h", "test", flops_per_s=4.7e10, bytes_per_s=3e10, attention_flops_per_s=4.7e10,
                     per_row_s=3e-3, overlap=True)
    rng = np.random.default_rng(2)
    works = decode_and_chunk_works(rng, 200)
    model = Roofline(shape, truth)
    stall = np.where(rng.random(len(works)) < 0.05, rng.uniform(3, 10, len(works)), 1.0)
    forward = np.array([model.stage_time(w) for w in works]) * stall
    fit = Roofline(shape, fit_hardware(shape, Calibration(works, list(forward), [], []), "fit", "synthetic"))
    assert sum(fit.stage_time(w) for w in works) == pytest.approx(forward.sum(), rel=1e-9)
    for rows in (1, 16):  # the bulk's shape survives: both sides of the knee scaled alike
        w = Work.of([(1, 500, True)] * rows)
        assert fit.stage_time(w) / model.stage_time(w) == pytest.approx(forward.sum() / sum(
            model.stage_time(v) for v in works), rel=0.1)


def test_a_pipeline_gives_each_stage_its_own_time():
    # The last stage holds the output projection: one batch takes stage 0 + hand-off + stage 1,
    # and back-to-back batches leave the pipeline at the slower (last) stage's pace.
    shape = dataclasses.replace(SHAPE, vocab=20_000)
    cost = Roofline(shape, dataclasses.replace(HW, overlap=True, link_latency_s=1e-3), pp=2)
    w = Work.of([(1, 0, True)])
    first, last = cost.stage_time(w, 0), cost.stage_time(w, 1)
    assert last > 2 * first
    one = simulate([TraceRequest(0.0, 1, 1)], EngineConfig(max_batch_size=4, **WHOLE), cost, 100)
    assert one.iterations[0].complete == pytest.approx(first + cost.handoff_time(w) + last)
    two = simulate([TraceRequest(0.0, 1, 1), TraceRequest(0.0, 1, 1)], EngineConfig(max_batch_size=1, **WHOLE),
                   cost, 100)
    done = [it.complete for it in two.iterations]
    assert done[1] - done[0] == pytest.approx(last)


def test_a_fitted_cpu_of_unbounded_memory_gets_the_slot_cap():
    assert kv_slots(SHAPE, HW, 1, 2, cap=1000) == 1000
    with pytest.raises(ValueError, match="unbounded memory"):
        kv_slots(SHAPE, HW, 1, 1)
    bounded = dataclasses.replace(HW, memory_bytes=1e6)
    assert kv_slots(SHAPE, bounded, 1, 1) == int((0.9e6 - SHAPE.weight_bytes) // SHAPE.kv_bytes_per_token)


def test_a_quantized_model_streams_its_stored_weights_and_keeps_float_kv():
    from types import SimpleNamespace
    spec = SimpleNamespace(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                           intermediate_size=128, vocab_size=100)
    dense = ModelShape.from_spec(spec, 4)
    n_params = dense.weight_bytes // 4
    q = ModelShape.from_spec(spec, 4, weight_bytes=0.625 * n_params)
    assert q.weight_bytes == pytest.approx(0.625 * n_params) and q.kv_bytes_per_token == dense.kv_bytes_per_token
    w = Work.of([(1, 50, True)])
    assert dense.memory_bytes(w) - q.memory_bytes(w) == pytest.approx((4 - 0.625) * n_params)
