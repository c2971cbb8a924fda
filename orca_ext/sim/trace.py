"""Traces for the simulator: (arrival time, prompt length, output length) per request.

A trace is a list of `TraceRequest`, in arrival order. It comes from a JSONL file (one object per
line: {"arrival": s, "prompt_len": n, "output_len": n}) or from `synthetic()`, a seeded
generator of gamma-distributed gaps (shape 1: Poisson) and uniform lengths, the workload of
bench/plot_latency_throughput.py and of the Orca paper. Every number read from a file is checked,
with its line in the message.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, Union

import numpy as np

MAX_TRACE_REQUESTS = 1_000_000
MAX_TOKENS_PER_REQUEST = 1 << 20
# The simulator holds a waiting request's prompt as a list of ids (the engine's Request), so the
# prompt tokens of a whole trace are bounded: 2^26 of them is at most ~0.5 GiB of list slots.
MAX_TRACE_PROMPT_TOKENS = 1 << 26


@dataclass(frozen=True)
class TraceRequest:
    arrival: float      # seconds from the start of the trace
    prompt_len: int     # tokens
    output_len: int     # tokens generated (EOS ignored)


def synthetic(n: int, rate: float, prompt_len: Sequence[int], output_len: Sequence[int], seed: int = 0,
              burstiness: float = 1.0) -> list[TraceRequest]:
    """n requests at `rate` per second (inf: all at t=0), gaps Gamma(burstiness, 1/(rate*burstiness)),
    lengths uniform on the inclusive ranges; the same seed gives the same trace."""
    if not 0 < n <= MAX_TRACE_REQUESTS:
        raise ValueError(f"n must be in [1, {MAX_TRACE_REQUESTS}], got {n!r}")
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate!r}, {burstiness!r}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi <= MAX_TOKENS_PER_REQUEST:
            raise ValueError(f"{name} range must satisfy 1 <= lo <= hi <= {MAX_TOKENS_PER_REQUEST}, got {lo!r}, {hi!r}")
    if n * prompt_len[1] > MAX_TRACE_PROMPT_TOKENS:
        raise ValueError(f"n x the longest prompt ({n} x {prompt_len[1]}) is above {MAX_TRACE_PROMPT_TOKENS} tokens")
    rng = np.random.default_rng(seed)
    if math.isinf(rate):
        arrivals = np.zeros(n)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    prompts = rng.integers(prompt_len[0], prompt_len[1], endpoint=True, size=n)
    outputs = rng.integers(output_len[0], output_len[1], endpoint=True, size=n)
    return [TraceRequest(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]


def load_jsonl(path: Union[str, Path]) -> list[TraceRequest]:
    """A trace from a JSONL file, sorted by arrival; a malformed line raises ValueError naming it."""
    trace = []
    prompt_tokens = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(trace) >= MAX_TRACE_REQUESTS:
                raise ValueError(f"{path}: more than {MAX_TRACE_REQUESTS} requests")
            try:
                trace.append(_checked(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            prompt_tokens += trace[-1].prompt_len
            if prompt_tokens > MAX_TRACE_PROMPT_TOKENS:
                raise ValueError(f"{path}:{lineno}: the trace's prompts pass {MAX_TRACE_PROMPT_TOKENS} tokens")
    if not trace:
        raise ValueError(f"{path}: no requests")
    return sorted(trace, key=lambda r: r.arrival)


def _checked(obj) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"expected an object, got {type(obj).__name__}")
    arrival = obj["arrival"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival < math.inf:
        raise ValueError(f"arrival must be a finite number of seconds >= 0, got {arrival!r}")
    lengths = []
    for key in ("prompt_len", "output_len"):
        v = obj[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_TOKENS_PER_REQUEST:
            raise ValueError(f"{key} must be an integer in [1, {MAX_TOKENS_PER_REQUEST}], got {v!r}")
        lengths.append(v)
    return TraceRequest(float(arrival), *lengths)


def save_jsonl(trace: Iterable[TraceRequest], path: Union[str, Path]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(json.dumps({"arrival": r.arrival, "prompt_len": r.prompt_len, "output_len": r.output_len}) + "\n")
