"""Fitting a Hardware's rates to measured iterations.

The forward time of an iteration (IterationRecord: launch to complete) is fitted in the
roofline's own form (cost.py, overlap=True):

    t = overhead_s + per_row_s * rows + max((gemm_flops + attention_flops) / flops_per_s,
                                             bytes / bytes_per_s)

A small decode streams the weights and waits on memory; a full batch or a prompt chunk waits on
the arithmetic. `max` is not linear, so the fit searches the bandwidth on a grid: for each
bandwidth every iteration is memory- or compute-bound, and given that split the rest is a
non-negative least-squares problem, solved again until the split is stable (a few rounds).
The best bandwidth of the grid is refined on a finer grid around it. A coefficient of zero means
that term is not seen in the data (its rate is infinite).

Attention's FLOPs share the GEMM's rate (attention_flops_per_s = flops_per_s): on this CPU they
run at about the same rate (orca_ext/fairness.py's measured context slope), and a separate rate
is not identifiable from a run's contexts of a few hundred tokens (fits on half-samples put it
anywhere from 3 to 50 GFLOP/s). Errors are weighted by 1 / sqrt(t): absolute errors let the
few long prompt-chunk iterations decide the fit and misplace the many short decodes, relative
errors the reverse. A loaded machine's stalls skew the times upwards, so the weighted fit falls
short of the run's total time by a few percent; every time term is then scaled by one factor so
the model reproduces the total, which throughput and latency add up.

The driver's time between an iteration's return and the next launch (postprocess, detokenize,
schedule) is measured separately and fitted as host_s + host_per_row_s * rows, from the gaps
where the engine had work waiting (a request of the returned batch runs again in the next one),
not from gaps where it waited for an arrival.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from .cost import Hardware, ModelShape
from .trace import TraceRequest, synthetic
from .work import Work


def fit_trace(n: int, seed: int, gap_s: float = 0.5) -> list[TraceRequest]:
    """The fit workload. The first half arrives one request every `gap_s`, with short prompts
    U[4, 64] and outputs U[16, 64]: many decodes of 1 to a few rows, the memory-bound side. The
    second half arrives at once after them, prompts U[4, 256] and outputs U[8, 64]: prompt chunks
    beside decodes, 16 rows, then a drain from 16 rows to 1. Unlike the validation workloads,
    whose arrivals are Poisson or all at t=0."""
    half = n // 2
    trickle = synthetic(max(half, 1), float("inf"), (4, 64), (16, 64), seed=seed)[:half]
    burst = synthetic(n - half, float("inf"), (4, 256), (8, 64), seed=seed + 1)
    return ([TraceRequest(gap_s * i, r.prompt_len, r.output_len) for i, r in enumerate(trickle)]
            + [TraceRequest(gap_s * half, r.prompt_len, r.output_len) for r in burst])


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


def fit_max_form(fixed: np.ndarray, compute: np.ndarray, memory: np.ndarray, t: np.ndarray,
                 weights: Optional[np.ndarray] = None, grid: int = 48,
                 rounds: int = 12) -> tuple[np.ndarray, float, float]:
    """argmin over x, y, z >= 0 of sum (weights * (fixed @ x + max(compute @ y, memory * z) - t))^2,
    where fixed: [N, F] (intercept, rows), compute: [N, C] (FLOPs), memory: [N] (bytes),
    t: [N] seconds, weights: [N] (None: 1). Returns (x ++ y, z, weighted squared error); z is the
    inverse bandwidth, 0 when no bandwidth helps."""
    n_fixed = fixed.shape[1]
    wt = np.ones(len(t)) if weights is None else np.asarray(weights, float)

    def at(z: float) -> tuple[np.ndarray, float]:
        m = memory * z
        best = (np.zeros(n_fixed + compute.shape[1]), float("inf"))
        for bound in (np.zeros(len(t), bool), m >= np.median(m)):  # two starting splits
            for _ in range(rounds):
                coef = nnls(np.hstack([fixed, compute * ~bound[:, None]]) * wt[:, None], (t - m * bound) * wt)
                now = compute @ coef[n_fixed:] < m
                if (now == bound).all():
                    break
                bound = now
            pred = fixed @ coef[:n_fixed] + np.maximum(compute @ coef[n_fixed:], m)
            err = float(np.sum((wt * (pred - t)) ** 2))
            if err < best[1]:
                best = (coef, err)
        return best

    hi = float(np.max(t) / np.min(memory))          # the slowest iteration all weight streaming
    zs = [0.0, *np.geomspace(hi * 1e-3, hi, grid)]
    fits = [at(z) for z in zs]
    k = int(np.argmin([e for _, e in fits]))
    if k > 0:  # refine between the neighbours of the best grid point
        for z in np.geomspace(zs[max(k - 1, 1)], zs[min(k + 1, len(zs) - 1)], grid // 2):
            zs.append(float(z))
            fits.append(at(z))
        k = int(np.argmin([e for _, e in fits]))
    return fits[k][0], float(zs[k]), fits[k][1]


def _inv(c: float) -> float:
    return 1.0 / float(c) if c > 0 else float("inf")


@dataclass(frozen=True)
class Calibration:
    """Measured iterations of one single-process run: their Work, forward times and host gaps."""

    works: list[Work]
    forward_s: list[float]
    host_rows: list[int]       # rows of the iteration before each gap
    host_s: list[float]        # gap from its return to the next launch, where work was waiting


def calibration_from_records(records, prompt_lens: Mapping[str, int]) -> Calibration:
    """From Server.iterations() of a single-process run (one batch in flight) and `prompt_lens`
    (request id -> prompt tokens). A gap counts as host time only when a request of the returned
    batch is in the next one: the engine then had work and launched as soon as it could."""
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
        if set(prev.request_ids) & set(rec.request_ids):
            host_rows.append(w.rows)
            host.append(rec.launch_time - prev.complete_time)
    return Calibration(works, forward, host_rows, host)


def fit_hardware(shape: ModelShape, cal: Calibration, name: str, source: str, device_type: str = "cpu",
                 **fixed) -> Hardware:
    """A Hardware (overlap=True) whose rates best explain `cal`; `fixed` sets other fields (links)."""
    ws, t = cal.works, np.asarray(cal.forward_s, float)
    rows = np.array([[1.0, w.rows] for w in ws])
    flops = np.array([[shape.gemm_flops(w) + shape.attention_flops(w)] for w in ws])
    nbytes = np.array([shape.memory_bytes(w) for w in ws])
    coef, z, _ = fit_max_form(rows, flops, nbytes, t, weights=1.0 / np.sqrt(t))
    pred = rows @ coef[:2] + np.maximum(flops @ coef[2:], nbytes * z)
    scale = float(t.sum() / pred.sum())   # the run's total time, stalls included
    coef, z = coef * scale, z * scale
    h = nnls(np.array([[1.0, r] for r in cal.host_rows]), np.asarray(cal.host_s)) if cal.host_s else np.zeros(2)
    return Hardware(name=name, source=source, flops_per_s=_inv(coef[2]), bytes_per_s=_inv(z),
                    attention_flops_per_s=_inv(coef[2]), overhead_s=float(coef[0]), per_row_s=float(coef[1]),
                    host_s=float(h[0]), host_per_row_s=float(h[1]), overlap=True, device_type=device_type,
                    **fixed)
