"""The discrete-event serving loop: the engine's own scheduler on a virtual clock.

The scheduler (`make_scheduler`: orca, static, fair; chunked prefill; slab compaction; the prefix
cache when `config.prefix_caching`, over the ids of trace.prompt_tokens) and the request state machine (`Request`, `RequestState`) are the engine's, unchanged. This loop stands
in for Engine.step_one / step_with_batch_queue, whose clock is the wall clock: it launches a batch
whenever fewer than n_workers are in flight and the scheduler selects one, otherwise it waits for
the oldest batch in flight or the next arrival, whichever comes first, and postprocesses batches
oldest first, exactly as the engine does. Only the forward pass is replaced: a batch's time comes
from a cost model (cost.py), and each emitting row gets one placeholder token.

Timing of a batch: it crosses the cost model's n_stages one after the other (stage_time of each,
handoff_time between two), a stage taking the next batch once it has passed the previous one on;
after its tokens return, the driver spends host_time on it before it selects again. A slab
compaction (the scheduler's slab_mover) and the prefix cache's row copies (its slab_copier)
delay the next launch by the time to copy the KV rows they move.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..config import EngineConfig
from ..prefix_cache import PrefixCache
from ..request import Request
from ..sampling_params import SamplingParams
from ..scheduler import make_scheduler
from .cost import CostModel
from .trace import TraceRequest, prompt_tokens
from .work import Work


@dataclass(frozen=True)
class SimIteration:
    launch: float
    complete: float
    rows: int
    prefill_tokens: int
    decode_tokens: int
    requests: tuple[int, ...] = ()      # trace indices, in batch order
    chunk_sizes: tuple[int, ...] = ()   # new tokens per request (IterationRecord.chunk_sizes)


@dataclass(frozen=True)
class SimRequest:
    arrival: float
    first_token: float
    finish: float
    prompt_len: int
    output_len: int


@dataclass
class SimResult:
    requests: list[SimRequest]
    iterations: list[SimIteration]
    num_compactions: int = 0

    @property
    def duration(self) -> float:
        """From the first arrival to the last finish."""
        return max(r.finish for r in self.requests) - min(r.arrival for r in self.requests)

    def summary(self) -> dict:
        """The serving benchmark's metrics (orca_ext/benchmarks/serving.py), in seconds and tokens/s."""
        out = sum(r.output_len for r in self.requests)
        norm = np.array([(r.finish - r.arrival) / r.output_len for r in self.requests])
        ttft = np.array([r.first_token - r.arrival for r in self.requests])
        return {"requests": len(self.requests), "iterations": len(self.iterations),
                "output_tokens_per_s": out / self.duration,
                "median_normalized_latency_s": float(np.median(norm)),
                "p99_ttft_s": float(np.percentile(ttft, 99)),
                "median_ttft_s": float(np.median(ttft))}


class _Pipeline:
    """When each stage is free; a batch passes them in order."""

    def __init__(self, n_stages: int) -> None:
        self.free = [0.0] * n_stages

    def run(self, t: float, stages: Sequence[float], handoff: float) -> float:
        for j in range(len(self.free)):
            t = max(t, self.free[j]) + stages[j]
            self.free[j] = t
            if j < len(self.free) - 1:
                t += handoff
        return t


def simulate(trace: Sequence[TraceRequest], config: EngineConfig, cost: CostModel, n_slots: int,
             kv_bytes_per_token: int = 0, device_type: str = "cuda",
             max_iterations: Optional[int] = None) -> SimResult:
    """Serve `trace` with `config`'s scheduler over `n_slots` KV slots; n_workers = cost.n_stages
    (the engine's pipeline depth). Deterministic: the same inputs give the same result."""
    config = config.scheduling_for(device_type)  # the chunk budget and row sharing of that device
    sched = make_scheduler(config, n_slots, cost.n_stages)
    moved = [0]  # KV bytes of the pending compaction and prefix cache copies

    def slab_mover(moves) -> None:
        moved[0] += sum(req.num_cached for req, _, _ in moves) * kv_bytes_per_token

    def slab_copier(rows) -> None:  # (src, dst, n) KV rows
        moved[0] += sum(n for _, _, n in rows) * kv_bytes_per_token

    if config.slab_compaction:
        sched.slab_mover = slab_mover
    if config.prefix_caching:
        sched.attach_prefix_cache(PrefixCache(n_slots, config.prefix_cache_block_size), slab_copier)
    arrivals = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
    for i in arrivals:
        if trace[i].prompt_len + trace[i].output_len > n_slots:
            raise ValueError(f"request {i} needs {trace[i].prompt_len + trace[i].output_len} KV slots; "
                             f"the cache has {n_slots}")
    first: dict = {}
    results: list = [None] * len(trace)
    iterations: list[SimIteration] = []
    pipeline = _Pipeline(cost.n_stages)
    inflight: deque = deque()  # (requests, [(n, start, emits)], complete time, Work), oldest first
    now, nxt = 0.0, 0
    while True:
        while nxt < len(arrivals) and trace[arrivals[nxt]].arrival <= now:
            i = arrivals[nxt]
            r = trace[i]
            req = Request(str(i), prompt_tokens(i, r), SamplingParams(max_tokens=r.output_len, ignore_eos=True))
            sched.add(req)
            nxt += 1
        if len(inflight) < cost.n_stages:
            batch = sched.schedule()
            if batch:
                if moved[0]:
                    now += cost.move_time(moved[0])
                    moved[0] = 0
                rows = [_row(req) for req in batch]
                work = Work.of(rows)
                done = pipeline.run(now, [cost.stage_time(work, j) for j in range(cost.n_stages)],
                                    cost.handoff_time(work))
                prefill = sum(n for (n, s, _), req in zip(rows, batch) if req.prompt_remaining)
                iterations.append(SimIteration(now, done, len(rows), prefill, work.new_tokens - prefill,
                                               tuple(int(r.request_id) for r in batch), tuple(n for n, _, _ in rows)))
                inflight.append((batch, rows, done, work))
                if max_iterations is not None and len(iterations) > max_iterations:
                    raise RuntimeError(f"more than {max_iterations} iterations")
                continue
        next_arrival = trace[arrivals[nxt]].arrival if nxt < len(arrivals) else math.inf
        if inflight and (len(inflight) >= cost.n_stages or inflight[0][2] <= next_arrival):
            batch, rows, done, work = inflight.popleft()
            now = max(now, done)
            _postprocess(batch, rows, now, first, results, trace)
            sched.complete(batch)
            now += cost.host_time(work)
        elif next_arrival < math.inf:
            now = max(now, next_arrival)
        elif sched.has_unfinished():
            raise RuntimeError("requests remain but none can be scheduled")  # cannot happen: see add()
        else:
            break
    return SimResult(results, iterations, sched.num_compactions)


def _row(req: Request) -> tuple[int, int, bool]:
    """(new tokens, start position, emits a token) of a scheduled request, as Request.next_inputs."""
    remaining = req.prompt_remaining
    if remaining:
        n = remaining if req.num_scheduled == 0 else min(remaining, req.num_scheduled)
        return n, req.num_cached, n == remaining
    return 1, req.num_cached, True


def _postprocess(batch, rows, now, first, results, trace) -> None:
    """The engine's _postprocess for a successful batch: cache the new tokens, append a token per
    emitting row, finish a request at its max_tokens."""
    for req, (n, _, emits) in zip(batch, rows):
        req.num_cached += n
        if not emits:
            continue
        i = int(req.request_id)
        first.setdefault(i, now)
        req.output_token_ids.append(0)
        if len(req.output_token_ids) >= req.params.max_tokens:
            req.mark_finished("length")
            r = trace[i]
            results[i] = SimRequest(r.arrival, first[i], now, r.prompt_len, r.output_len)
