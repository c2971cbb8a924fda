"""A pipeline's stage model fitted to the workers' own timings (orca_ext/sim/stages.py): a known
per-stage cost split is recovered from a synthetic worker trace whose spans follow the workers'
rules (a stage's span opens when the driver's message arrives and the stage is free; a later stage
waits for the activations), and a known hand-off latency from a run's throughput and latency."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from orca_ext.config import EngineConfig
from orca_ext.request import IterationRecord
from orca_ext.sim.cost import Hardware, ModelShape, Roofline
from orca_ext.sim.loop import simulate
from orca_ext.sim.stages import fit_handoff, fit_stages, stage_times
from orca_ext.sim.trace import TraceRequest
from orca_ext.sim.work import Work

SHAPE = ModelShape("t", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, vocab=49152,
                   param_bytes=4, weight_bytes_per_param=0.73)
HW = Hardware("cpu", "test", flops_per_s=5e10, bytes_per_s=7e9, attention_flops_per_s=5e10, overhead_s=5e-4,
              per_row_s=1.5e-3, overlap=True, device_type="cpu")
SCALES = (0.93, 0.71)        # the stages' true lines on the single-process model: scale, offset
OFFSETS = (-1.5e-3, 0.8e-3)
DOWN, WAIT, UP = 4e-4, 1.1e-3, 6e-4   # driver -> stages, stage 0 -> stage 1 activations, last stage -> driver


def pipeline_run(seed: int, n: int = 300):
    """IterationRecords, prompt lengths and per-stage spans of n batches of 1-16 rows (decodes
    and prompt chunks), most alone in the pipeline and some launched while another is in flight."""
    rng = np.random.default_rng(seed)
    truth = Roofline(SHAPE, HW, pp=2, stage_scale=SCALES, stage_offset_s=OFFSETS)
    records, prompt_lens, spans = [], {}, ({}, {})
    free, t, done = [0.0, 0.0], 0.0, 0.0
    for i in range(n):
        sizes = [1] * int(rng.integers(1, 17))
        if rng.random() < 0.3:
            sizes[0] = int(rng.integers(8, 129))
        ids = tuple(f"b{i}r{k}" for k in range(len(sizes)))
        prompt_lens.update(zip(ids, sizes))
        w = truth_work(sizes)
        noise = 1 + 0.01 * rng.standard_normal(2)
        # After the last batch returned and a pause, or while it is still in flight.
        t = done + rng.uniform(1e-3, 5e-2) if rng.random() < 0.7 else t + 1e-4
        s0 = max(t + DOWN, free[0])
        e0 = s0 + truth.stage_time(w, 0) * noise[0]
        s1 = max(t + DOWN, free[1])
        e1 = max(s1, e0 + WAIT) + truth.stage_time(w, 1) * noise[1]
        free, done = [e0, e1], e1 + UP
        spans[0][i], spans[1][i] = (s0, e0), (s1, e1)
        records.append(IterationRecord(i, ids, sum(sizes), 0, 0, launch_time=t, complete_time=e1 + UP,
                                       chunk_sizes=tuple(sizes)))
    return records, prompt_lens, spans


def truth_work(sizes):
    return Work.of([(n, 0, True) for n in sizes])


def test_stage_times_reads_each_stage_from_when_the_one_before_finished():
    records, prompt_lens, spans = pipeline_run(seed=1, n=20)
    times = stage_times(records, prompt_lens, spans)
    assert len(times.works) == 20
    for k, rec in enumerate(records):
        (s0, e0), (s1, e1) = spans[0][rec.index], spans[1][rec.index]
        assert times.stage_s[k, 0] == pytest.approx(e0 - s0)
        assert times.stage_s[k, 1] == pytest.approx(e1 - max(s1, e0))
    # A batch the workers did not log on every stage is left out.
    del spans[1][records[3].index]
    assert len(stage_times(records, prompt_lens, spans).works) == 19


def test_a_known_per_stage_cost_split_is_recovered_from_a_worker_trace():
    records, prompt_lens, spans = pipeline_run(seed=3)
    single = Roofline(SHAPE, HW, pp=2)
    fit = fit_stages(stage_times(records, prompt_lens, spans), single)
    assert fit.batches == 300
    assert fit.scales == pytest.approx(SCALES, rel=0.02)
    assert fit.offsets_s[0] == pytest.approx(OFFSETS[0], abs=3e-4)
    # The last stage's span holds the activations' wait where it was idle (most batches here).
    assert OFFSETS[1] < fit.offsets_s[1] < OFFSETS[1] + WAIT + 3e-4
    # A batch of 1 to 16 rows, out of sample: each stage within 3% of its truth.
    fitted = Roofline(SHAPE, HW, pp=2, stage_scale=fit.scales, stage_offset_s=fit.offsets_s)
    truth = Roofline(SHAPE, HW, pp=2, stage_scale=SCALES, stage_offset_s=OFFSETS)
    for sizes in ([1], [1] * 16, [100, 1, 1]):
        w = truth_work(sizes)
        assert fitted.stage_time(w, 0) == pytest.approx(truth.stage_time(w, 0), rel=0.03)
        assert fitted.stage_time(w, 1) == pytest.approx(truth.stage_time(w, 1) + WAIT, rel=0.05)


def test_the_hand_off_latency_is_recovered_from_a_runs_throughput_and_latency():
    rng = np.random.default_rng(4)
    trace = sorted((TraceRequest(float(t), int(p), int(o)) for t, p, o in
                    zip(rng.uniform(0, 3, 24), rng.integers(8, 129, 24), rng.integers(4, 65, 24))),
                   key=lambda r: r.arrival)
    config = EngineConfig(max_batch_size=8, pipeline_parallel_size=2)
    cost = Roofline(SHAPE, HW, pp=2, stage_scale=SCALES, stage_offset_s=OFFSETS)
    truth = dataclasses.replace(cost, hw=dataclasses.replace(HW, link_latency_s=7e-3))
    measured = simulate(trace, config, truth, 5000, device_type="cpu")
    groups = (range(12), range(12, 24))
    assert fit_handoff(trace, config, cost, 5000, measured, groups) == pytest.approx(7e-3, rel=0.05)


def test_a_stage_line_scales_and_offsets_each_stage_and_must_match_the_stage_count():
    w = truth_work([1, 1, 64])
    plain = Roofline(SHAPE, HW, pp=2)
    lined = Roofline(SHAPE, HW, pp=2, stage_scale=(0.5, 2.0), stage_offset_s=(1e-3, -1e-3))
    assert lined.stage_time(w, 0) == pytest.approx(0.5 * plain.stage_time(w, 0) + 1e-3)
    assert lined.stage_time(w, 1) == pytest.approx(2.0 * plain.stage_time(w, 1) - 1e-3)
    with pytest.raises(ValueError, match="2 stages"):
        Roofline(SHAPE, HW, pp=2, stage_scale=(1.0,))
    with pytest.raises(ValueError, match="2 stages"):
        Roofline(SHAPE, HW, pp=2, stage_offset_s=(0.0, 0.0, 0.0))
