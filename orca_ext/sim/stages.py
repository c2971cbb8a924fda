"""A pipeline's stage costs, fitted on the pipeline's own run.

A pipeline stage is first priced by the single-process fit (cost.Roofline: n_layers / pp layers,
the last stage also the output projection). The stages' own timings correct it: the workers log
each batch's start and end (ORCA_EXT_WORKER_TRACE, distributed/batch_trace.py), one span per
stage with tensor parallelism 1. A stage's span starts when the driver's message arrives, so stage
0's span is its forward, and a later stage's span, from the moment the stage before it finished,
is the hand-off (the activations' wait) plus its forward. Per batch i:

    stage 0:          e0_i - s0_i               = scale_0 * model_0(i)
    stage j > 0:      e_j,i - max(s_j,i, e_j-1,i) = wait_j + scale_j * model_j(i)

scale_0 keeps stage 0's summed time; (wait_j, scale_j) is a non-negative least-squares line, so
the hand-off's fixed wait does not leak into the stage's scale. The hand-off latency the loop
charges between stages is then everything a batch alone in the pipeline spends outside the
stages' scaled model times (the driver's messages down and up, the stages' waits), the median
over the batches of the run that ran alone: a light load feels it per iteration.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .cost import Roofline
from .fit import calibration_from_records, nnls
from .work import Work

Span = tuple[float, float]  # (start, end) of one batch on one stage, the driver's monotonic clock


@dataclass(frozen=True)
class StageFit:
    scales: tuple[float, ...]   # per stage: measured over the single-process model's stage time
    handoff_s: float            # latency between stages (all of a lone batch's time outside them)
    batches: int                # batches seen on every stage
    alone: int                  # of them, batches alone in the pipeline (the hand-off's sample)


@dataclass(frozen=True)
class StageTimes:
    """Per batch seen on every stage: its Work, the driver's launch and complete times, and each
    stage's time as the stage logged it (stage j > 0: from when stage j-1 finished)."""

    works: list[Work]
    launch: np.ndarray          # [B]
    complete: np.ndarray        # [B]
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
    return StageTimes([w for _, w in keep], np.array([r.launch_time for r, _ in keep]),
                      np.array([r.complete_time for r, _ in keep]), np.array(times).reshape(len(keep), len(spans)))


def fit_stages(times: StageTimes, cost: Roofline) -> StageFit:
    """Per-stage scales and the hand-off latency that make `cost` (a pipeline priced by the
    single-process fit; its own stage scales and link latency are ignored) explain `times`."""
    base = dataclasses.replace(cost, hw=dataclasses.replace(cost.hw, link_latency_s=0.0), stage_scale=())
    n = base.n_stages
    model = np.array([[base.stage_time(w, j) for j in range(n)] for w in times.works])  # [B, S]
    scales = [float(times.stage_s[:, 0].sum() / model[:, 0].sum())]
    for j in range(1, n):
        t = times.stage_s[:, j]
        wt = 1.0 / np.sqrt(np.maximum(t, 1e-6))  # as the single-process fit: no few long batches decide
        _, scale = nnls(np.column_stack([np.ones_like(t), model[:, j]]) * wt[:, None], t * wt)
        scales.append(float(scale))
    # Alone: the batch before it had returned when it launched (later ones cannot delay it).
    order = np.argsort(times.launch)
    launch, complete = times.launch[order], times.complete[order]
    alone = np.concatenate([[True], complete[:-1] <= launch[1:]])
    transfer = np.array([(n - 1) * base.handoff_time(times.works[i]) for i in order])
    outside = (complete - launch) - model[order] @ np.array(scales) - transfer
    handoff = float(np.median(outside[alone])) / (n - 1) if alone.any() and n > 1 else 0.0
    return StageFit(tuple(scales), max(handoff, 0.0), len(order), int(alone.sum()))
