"""Traces for the simulator: (arrival time, prompt length, output length) per request.

A trace is a list of `TraceRequest`, in arrival order. It comes from a JSONL file (one object per
line: {"arrival": s, "prompt_len": n, "output_len": n}, and optionally "prefix_id": k,
"prefix_len": n for requests that share their first n prompt tokens, such as a system prompt) or
from `synthetic()`, a seeded generator of gamma-distributed gaps (shape 1: Poisson) and uniform
lengths, the workload of bench/plot_latency_throughput.py and of the Orca paper. Every number
read from a file is checked, with its line in the message. `prompt_tokens` gives a request the
token ids the simulated prefix cache sees: the shared prefix's, then ids no other request has.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

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
    prefix_id: Optional[int] = None  # requests with the same id share their first prefix_len tokens
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"prefix_len must be in [0, prompt_len={self.prompt_len}], got {self.prefix_len!r}")
        if (self.prefix_id is None) != (self.prefix_len == 0):
            raise ValueError("prefix_id and prefix_len > 0 go together")


_ID_SPAN = 1 << 21  # > MAX_TOKENS_PER_REQUEST: each request's own ids and each prefix's lie in their own range


def prompt_tokens(index: int, r: TraceRequest) -> list[int]:
    """Token ids of request `index`'s prompt: the shared prefix's ids (positive, from prefix_id),
    then ids no other request of the trace has (negative, from index)."""
    shared = [] if r.prefix_id is None else [(r.prefix_id + 1) * _ID_SPAN + k for k in range(r.prefix_len)]
    own = [-((index + 1) * _ID_SPAN + k) for k in range(r.prompt_len - r.prefix_len)]
    return shared + own


def synthetic(n: int, rate: float, prompt_len: Sequence[int], output_len: Sequence[int], seed: int = 0,
              burstiness: float = 1.0, shared_prefix: int = 0) -> list[TraceRequest]:
    """n requests at `rate` per second (inf: all at t=0), gaps Gamma(burstiness, 1/(rate*burstiness)),
    lengths uniform on the inclusive ranges; the same seed gives the same trace. shared_prefix > 0:
    every prompt starts with the same shared_prefix tokens (one system prompt; prefix_id 0), on
    top of its drawn length."""
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
    if not isinstance(shared_prefix, int) or not 0 <= shared_prefix <= MAX_TOKENS_PER_REQUEST - prompt_len[1]:
        raise ValueError(f"shared_prefix must be in [0, {MAX_TOKENS_PER_REQUEST - prompt_len[1]}], got {shared_prefix!r}")
    prefix = dict(prefix_id=0, prefix_len=shared_prefix) if shared_prefix else {}
    return [TraceRequest(float(a), int(p) + shared_prefix, int(o), **prefix)
            for a, p, o in zip(arrivals, prompts, outputs)]


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
    prefix_id, prefix_len = obj.get("prefix_id"), obj.get("prefix_len", 0)
    if prefix_id is not None and (isinstance(prefix_id, bool) or not isinstance(prefix_id, int)
                                  or not 0 <= prefix_id < MAX_TRACE_REQUESTS):
        raise ValueError(f"prefix_id must be an integer in [0, {MAX_TRACE_REQUESTS}), got {prefix_id!r}")
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int):
        raise ValueError(f"prefix_len must be an integer, got {prefix_len!r}")
    return TraceRequest(float(arrival), *lengths, prefix_id=prefix_id, prefix_len=prefix_len)


def save_jsonl(trace: Iterable[TraceRequest], path: Union[str, Path]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            row = {"arrival": r.arrival, "prompt_len": r.prompt_len, "output_len": r.output_len}
            if r.prefix_id is not None:
                row.update(prefix_id=r.prefix_id, prefix_len=r.prefix_len)
            f.write(json.dumps(row) + "\n")
