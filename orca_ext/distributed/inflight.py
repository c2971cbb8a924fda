"""The batches posted to the workers and not yet answered, oldest first.

Answers come back in the order the batches were posted (every worker handles its messages in
order, and one worker samples them all), so the oldest entry is the one the next answer is for.
Once the group has failed, or the executor was shut down, the queue is closed: every entry fails
with the reason, and so does every batch posted after it.
"""
from __future__ import annotations

import collections
import threading
from typing import Optional

from ..executor import BatchFuture


class InFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: collections.deque = collections.deque()   # (batch index, BatchFuture)
        self._closed: Optional[str] = None

    def add(self, index: int, future: BatchFuture) -> Optional[str]:
        """Queue a batch about to be posted; returns the reason instead when the queue is closed."""
        with self._lock:
            if self._closed is not None:
                return self._closed
            self._entries.append((index, future))
            return None

    def pop_oldest(self) -> tuple[Optional[int], Optional[BatchFuture]]:
        """The entry the next answer is for, or (None, None) when there is none."""
        with self._lock:
            return self._entries.popleft() if self._entries else (None, None)

    def put_back(self, index: int, future: BatchFuture) -> None:
        """Return an entry taken by pop_oldest (its answer did not match: it fails with the rest)."""
        with self._lock:
            self._entries.appendleft((index, future))

    def close(self, reason: str) -> list[BatchFuture]:
        """Close the queue; returns the futures still waiting (the caller fails them)."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            futures = [f for _, f in self._entries]
            self._entries.clear()
        return futures
