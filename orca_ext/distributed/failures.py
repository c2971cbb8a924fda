"""Worker failures: their record, and naming the root cause.

Any failure is fatal for the whole group (its peers' collectives could never complete), and one
worker's death makes the others fail too (their connections close). So the first failure opens a
grace period in which the secondary ones arrive, and the message names the most telling one: an
exception that is not a communication error, else a worker that died, else a worker that stopped
sending heartbeats, else a communication error, else a timeout; the earliest of that kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .worker_info import WorkerInfo

FAILURE_GRACE_S = 0.5      # collect the other workers' errors before naming the root cause


class WorkerFailedError(RuntimeError):
    """A worker process died or raised; the message names it."""


@dataclass
class Failure:
    worker: Optional[int]  # worker rank; None when the driver noticed it (a send, a timeout)
    kind: str              # "raised" | "lost" | "hung" (no heartbeat) | "timeout"
    detail: str
    communication: bool = False
    batch: int = -1


class FailureLog:
    """Failures in the order they were noticed, one account per worker (its error report, then
    its exit, is one failure). Not thread-safe: the caller holds its lock."""

    def __init__(self) -> None:
        self._failures: list[Failure] = []
        self._finalizing = False

    def add(self, failure: Failure) -> bool:
        """Record `failure`; True for the first one, whose caller names the root cause after
        FAILURE_GRACE_S."""
        if failure.worker is not None and any(f.worker == failure.worker for f in self._failures):
            return False
        self._failures.append(failure)
        if self._finalizing:
            return False
        self._finalizing = True
        return True

    def snapshot(self) -> list[Failure]:
        return list(self._failures)


def root_cause(failures: Sequence[Failure], workers: Sequence[WorkerInfo]) -> str:
    """One message for the group's failure, naming the worker that caused it."""
    def rank(f: Failure) -> int:
        if f.kind == "raised" and not f.communication:
            return 0
        return {"lost": 1, "hung": 2, "raised": 3}.get(f.kind, 4)

    first = min(failures, key=rank)  # min is stable: the earliest of the most telling kind
    if first.kind == "timeout":
        text = first.detail
    else:
        w = workers[first.worker] if first.worker is not None else None
        name = w.name() if w is not None else "a worker"
        if first.kind == "hung":
            text = f"{name} {first.detail}"
        elif first.kind == "raised":
            where = f" in iteration {first.batch}" if first.batch >= 0 else ""
            text = f"{name} failed{where}: {first.detail}"
        else:
            status = w.exit_status() if w is not None else None
            text = f"{name} {status}" if status else f"{name} lost its connection ({first.detail})"
    others = len(failures) - 1
    if others:
        text += f" ({others} other worker(s) failed after it)"
    return text
