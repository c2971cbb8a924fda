"""Replaying a trace on a real Server, timed: the measurements the simulator is validated against.

Requests are submitted at their trace arrival times (random token ids, EOS ignored, exactly
output_len tokens), and each request's submit, first-token and finish times are read from its
RequestOutput. The result is a SimResult, so measured and simulated runs share `summary()`, and
its requests carry the arrival times the engine actually saw (submission lags the trace a
little on a loaded machine), which is the trace to simulate.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from .loop import SimRequest, SimResult
from .trace import TraceRequest


def replay(server, trace: Sequence[TraceRequest], seed: int = 0, prefix: str = "sim-") -> SimResult:
    """Request i of the trace gets the id f'{prefix}{i}'."""
    from ..sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = server.vocab_size
    prompts = [rng.integers(min(1000, vocab // 2), vocab - 1, size=r.prompt_len).tolist() for r in trace]
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
    t0 = time.time()
    ids = {}
    for i in order:
        delay = t0 + trace[i].arrival - time.time()
        if delay > 0:
            time.sleep(delay)
        ids[i] = server.submit(prompts[i], SamplingParams(max_tokens=trace[i].output_len, ignore_eos=True),
                               request_id=f"{prefix}{i}")
    results = []
    for i in range(len(trace)):
        out = server.result(ids[i])
        if out.finish_reason != "length" or len(out.token_ids) != trace[i].output_len:
            raise RuntimeError(f"request {i} ended with {out.finish_reason!r} after {len(out.token_ids)} tokens")
        results.append(SimRequest(out.arrival_time - t0, out.first_token_time - t0, out.finish_time - t0,
                                  trace[i].prompt_len, trace[i].output_len))
    return SimResult(results, [])


def observed_trace(measured: SimResult) -> list[TraceRequest]:
    """The trace as the engine saw it: the measured arrival times."""
    return [TraceRequest(max(0.0, r.arrival), r.prompt_len, r.output_len) for r in measured.requests]
