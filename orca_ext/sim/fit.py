"""Fitting a Hardware's rates to measured iterations by least squares.

The forward time of an iteration (IterationRecord: launch to complete) is linear in the rates'
inverses when compute and memory do not overlap (a CPU whose cores do both, `overlap=False`):

    t = overhead_s + per_row_s * rows + gemm_flops / flops_per_s
        + attention_flops / attention_flops_per_s + bytes / bytes_per_s

and the driver's time between an iteration's return and the next launch is host_s +
host_per_row_s * rows. Both are fitted by non-negative least squares on the times themselves (a
coefficient of zero means that term is not seen in the data: its rate is infinite). Absolute, not
relative, errors and no outlier rejection: with an intercept the residuals then sum to about
zero, so the fitted model reproduces the run's total time, which is what throughput and latency
add up; a loaded machine's stalls are part of that time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .cost import Hardware, ModelShape
from .work import Work


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, exactly, by trying every set of free columns (few columns)."""
    a = np.asarray(a, float)
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a_s = a / scale
    best, best_res = np.zeros(a.shape[1]), float(np.sum(b ** 2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a_s[:, cols], b, rcond=None)
            if np.all(x >= 0):
                res = float(np.sum((a_s[:, cols] @ x - b) ** 2))
                if res < best_res:
                    best_res, best = res, np.zeros(a.shape[1])
                    best[list(cols)] = x
    return best / scale


def forward_features(shape: ModelShape, works: Sequence[Work]) -> np.ndarray:
    return np.array([[1.0, w.rows, shape.gemm_flops(w), shape.attention_flops(w), shape.memory_bytes(w)]
                     for w in works])


def _inv(c: float) -> float:
    return 1.0 / c if c > 0 else float("inf")


@dataclass(frozen=True)
class Calibration:
    """Measured iterations of one single-process run: their Work, forward times and host gaps."""

    works: list[Work]
    forward_s: list[float]
    host_rows: list[int]       # rows of the iteration before each gap
    host_s: list[float]        # gap from its return to the next launch


def calibration_from_records(records, prompt_lens: Mapping[str, int]) -> Calibration:
    """From Server.iterations() of a run where the engine was never idle (all requests queued at
    the start) and `prompt_lens` (request id -> prompt tokens)."""
    cached: dict = {}
    works, forward, host_rows, host = [], [], [], []
    records = sorted(records, key=lambda r: r.index)
    for rec in records:
        rows = []
        for rid, n in zip(rec.request_ids, rec.chunk_sizes):
            start = cached.get(rid, 0)
            cached[rid] = start + n
            rows.append((n, start, start + n >= prompt_lens[rid]))
        works.append(Work.of(rows))
        forward.append(rec.complete_time - rec.launch_time)
    for prev, rec, w in zip(records, records[1:], works):
        host_rows.append(w.rows)
        host.append(rec.launch_time - prev.complete_time)
    return Calibration(works, forward, host_rows, host)


def fit_hardware(shape: ModelShape, cal: Calibration, name: str, source: str, device_type: str = "cpu",
                 **fixed) -> Hardware:
    """A Hardware (overlap=False) whose rates best explain `cal`; `fixed` sets other fields (links)."""
    f = nnls(forward_features(shape, cal.works), np.asarray(cal.forward_s))
    h = nnls(np.array([[1.0, r] for r in cal.host_rows]), np.asarray(cal.host_s))
    return Hardware(name=name, source=source, flops_per_s=_inv(f[2]), bytes_per_s=_inv(f[4]),
                    attention_flops_per_s=_inv(f[3]), overhead_s=float(f[0]), per_row_s=float(f[1]),
                    host_s=float(h[0]), host_per_row_s=float(h[1]), overlap=False, device_type=device_type,
                    **fixed)
