"""A test hook: when each worker ran each batch, to check pipeline overlap from the workers' side.

Off unless the environment variable ORCA_EXT_WORKER_TRACE names a folder when the workers start;
then worker w appends one line "index start end" per forward to <folder>/worker<w>.trace, in
time.monotonic() seconds (one clock for every process on a host). Nothing of it travels in the
control-plane messages.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

TRACE_ENV = "ORCA_EXT_WORKER_TRACE"


class BatchTrace:
    def __init__(self, path: Path):
        self._file = open(path, "a", buffering=1)  # line-buffered: readable while the worker runs

    @classmethod
    def from_env(cls, rank: int) -> Optional["BatchTrace"]:
        folder = os.environ.get(TRACE_ENV)
        return cls(Path(folder) / f"worker{rank}.trace") if folder else None

    def record(self, index: int, start: float, end: float) -> None:
        self._file.write(f"{index} {start:.6f} {end:.6f}\n")


def read_traces(folder) -> dict[int, list[tuple[int, float, float]]]:
    """worker rank -> [(batch index, start, end)] in the order the worker ran them."""
    out = {}
    for path in sorted(Path(folder).glob("worker*.trace")):
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
        out[int(path.stem[len("worker"):])] = [(int(i), float(a), float(b)) for i, a, b in rows]
    return out


def now() -> float:
    return time.monotonic()
