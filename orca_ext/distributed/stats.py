"""Collecting the workers' time splits (WorkerTimes) for benchmarks: the driver asks every worker
with OP_STATS, the listeners deliver the answers here, and the caller waits for all of them."""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

from .messages import WorkerTimes


class StatsBoard:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._times: dict[int, WorkerTimes] = {}

    def clear(self) -> None:
        with self._cond:
            self._times.clear()

    def put(self, rank: int, times: WorkerTimes) -> None:
        with self._cond:
            self._times[rank] = times
            self._cond.notify_all()

    def wake(self) -> None:
        """Make waiters look at `failed()` again (the group has just failed)."""
        with self._cond:
            self._cond.notify_all()

    def wait_all(self, ranks: Sequence[int], timeout: float, failed: Callable[[], Optional[Exception]]) -> list:
        """Every rank's WorkerTimes, in the order of `ranks`; raises failed()'s error if the group
        fails meanwhile, TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(r not in self._times for r in ranks):
                error = failed()
                if error is not None:
                    raise error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"worker statistics did not arrive within {timeout} s")
                self._cond.wait(left)
            return [self._times[r] for r in ranks]
