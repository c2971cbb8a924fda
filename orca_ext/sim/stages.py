"""A pipeline's stage costs, fitted on the pipeline's own run.

A pipeline stage is first priced by the single-process fit (cost.Roofline: n_layers / pp layers,
the last stage also the output projection). A single process cannot tell the output
projection's rate from the layers' (its FLOPs grow with the emitting rows as per_row_s does with
the rows), nor which of its fixed cost every stage pays again, and both decide the stages' split.
The stages' own timings correct it: the workers log each batch's start and end
(ORCA_EXT_WORKER_TRACE, distributed/batch_trace.py), one span per stage with tensor parallelism
1. A stage's span opens when the driver's message arrives, so stage 0's span is its forward, and
a later stage's, from the moment the stage before it finished, is the activations' wait plus its
forward. Per stage j, over the run's batches i:

    measured_j(i) = scale_j * model_j(i) + offset_j      (weighted least squares, as fit.py)

The hand-off latency is then fitted end to end (fit_handoff): the latency between stages that
makes the simulated fit run reproduce its measured throughput and the median normalised latency
of its trickle and of its burst. It
stands for what the stages' spans do not hold: the driver's messages down and up, and on a
machine whose cores the driver and the workers share, the wake-ups a hop waits for.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..config import EngineConfig
from .cost import Roofline
from .fit import calibration_from_records
from .loop import SimResult, simulate
from .trace import TraceRequest
from .work import Work

Span = tuple[float, float]  # (start, end) of one batch on one stage, time.monotonic() seconds


@dataclass(frozen=True)
class StageFit:
    scales: tuple[float, ...]     # per stage: measured time = scale * single-process model + offset
    offsets_s: tuple[float, ...]
    batches: int                  # batches seen on every stage


@dataclass(frozen=True)
class StageTimes:
    """Per batch seen on every stage: its Work and each stage's time as the stage logged it
    (stage j > 0: from when stage j-1 finished)."""

    works: list[Work]
    stage_s: np.ndarray         # [B, S]


def stage_times(records, prompt_lens: Mapping[str, int], spans: Sequence[Mapping[int, Span]]) -> StageTimes:
    """From Server.iterations() of a pipeline run, `prompt_lens` (request id -> prompt tokens)
    and per stage the worker's spans by batch index."""
    records = sorted(records, key=lambda r: r.index)
    works = calibration_from_records(records, prompt_lens).works
    keep = [(rec, w) for rec, w in zip(records, works) if all(rec.index in s for s in spans)]
    times = []
    for rec, _ in keep:
        row, prev_end = [], None
        for s in spans:
            start, end = s[rec.index]
            row.append(end - (start if prev_end is None else max(start, prev_end)))
            prev_end = end
        times.append(row)
    return StageTimes([w for _, w in keep], np.array(times).reshape(len(keep), len(spans)))


def fit_stages(times: StageTimes, cost: Roofline) -> StageFit:
    """Per-stage lines that make `cost` (a pipeline priced by the single-process fit; its own
    stage corrections are ignored) explain the stages' logged times."""
    base = dataclasses.replace(cost, stage_scale=(), stage_offset_s=())
    model = np.array([[base.stage_time(w, j) for j in range(base.n_stages)] for w in times.works])  # [B, S]
    scales, offsets = [], []
    for j in range(base.n_stages):
        t = times.stage_s[:, j]
        wt = 1.0 / np.sqrt(np.maximum(t, 1e-6))  # as the single-process fit: no few long batches decide
        (offset, scale), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(t), model[:, j]]) * wt[:, None],
                                              t * wt, rcond=None)
        scales.append(max(float(scale), 0.0))
        offsets.append(max(float(offset), -scales[-1] * float(model[:, j].min())))  # no stage below zero
    return StageFit(tuple(scales), tuple(offsets), len(times.works))


HANDOFF_GRID_S = (0.0, *np.geomspace(1e-4, 0.2, 34))


def fit_handoff(trace: Sequence[TraceRequest], config: EngineConfig, cost: Roofline, n_slots: int,
                measured: SimResult, groups: Sequence[Sequence[int]], kv_bytes_per_token: int = 0,
                device_type: str = "cpu") -> float:
    """The link latency (seconds, between two stages) with which `cost` serving `trace`
    reproduces the measured run: its output throughput and, per group of request indices, the
    median normalised latency (least squared log errors; a grid, then a finer one between the
    best point's neighbours). Groups, not the run's one median: in the fit workload (a trickle,
    then a burst) that median falls between the trickle's slowest request and the burst's
    fastest, and would fit the latency to those two."""
    def medians(result: SimResult) -> np.ndarray:
        norm = np.array([(r.finish - r.arrival) / r.output_len for r in result.requests])
        return np.array([np.median(norm[list(g)]) for g in groups])

    target_tps, target = measured.summary()["output_tokens_per_s"], medians(measured)

    def err(latency: float) -> float:
        c = dataclasses.replace(cost, hw=dataclasses.replace(cost.hw, link_latency_s=float(latency)))
        got = simulate(trace, config, c, n_slots, kv_bytes_per_token, device_type)
        return float(np.log(got.summary()["output_tokens_per_s"] / target_tps) ** 2
                     + np.sum(np.log(medians(got) / target) ** 2))

    grid = list(HANDOFF_GRID_S)
    k = int(np.argmin([err(x) for x in grid]))
    fine = np.linspace(grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)], 17)
    return float(fine[int(np.argmin([err(x) for x in fine]))])
