"""Output delivery: who waits for which request, and finished outputs nobody collected yet.

The broker owns the request ids in use. An id stays in use from submit until its final output
is handed to a caller (result(), or a stream reaching finished=True); then it can be reused.
A finished request that no caller is waiting on is kept as "undelivered", oldest first, and
beyond `max_undelivered` the oldest is dropped so abandoned ids cannot grow memory without bound.
Drops are logged rate-limited (DropReport): a client that never collects its outputs cannot
flood the log either.

Threads sleep on a per-request Condition over the server's lock; asyncio consumers register a
wake-up that the engine thread schedules with `loop.call_soon_threadsafe`. Nothing polls.

Locking: `add`, `find`, `unused_id`, `publish`, `n_undelivered`, `n_dropped` and
`report_drops` expect the caller to hold the server lock (they run inside submit/abort/the
engine step/shutdown); `result`, `stream`, `stream_async` and `discard` take it themselves.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from typing import AsyncIterator, Callable, Iterator, Optional

from .errors import InvalidRequestError
from .request import Request, RequestOutput

log = logging.getLogger(__name__)

DROP_REPORT_INTERVAL = 60.0  # seconds between two warnings about dropped undelivered outputs


class DropReport:
    """Warnings about dropped undelivered outputs: the first drop is reported at once, later
    ones as one summary per `interval` seconds (and at shutdown, by `flush`)."""

    def __init__(self, limit: int, interval: float = DROP_REPORT_INTERVAL) -> None:
        self.limit = limit
        self.interval = interval
        self.total = 0                       # drops since the server started
        self._pending = 0                    # drops not reported yet
        self._last: Optional[float] = None   # time.monotonic() of the last warning

    def dropped(self, request_id: str) -> None:
        self.total += 1
        self._pending += 1
        now = time.monotonic()
        if self._last is None:
            log.warning("dropping the undelivered output of request %r: more than %d finished outputs "
                        "are waiting to be collected (oldest first; further drops are summarised "
                        "every %g s)", request_id, self.limit, self.interval)
        elif now - self._last >= self.interval:
            log.warning("dropped %d more undelivered outputs in the last %.0f s (latest: request %r)",
                        self._pending, now - self._last, request_id)
        else:
            return
        self._pending, self._last = 0, now

    def flush(self) -> None:
        if self._pending:
            log.warning("dropped %d more undelivered outputs since the last report", self._pending)
            self._pending = 0


class _Waiters:
    """Waiter state of one request id."""

    __slots__ = ("req", "cond", "wakeups", "consumers")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.cond: Optional[threading.Condition] = None  # made on the first blocking wait
        self.wakeups: list[Callable[[], None]] = []     # asyncio consumers' wake-ups
        self.consumers = 0                               # active result()/stream() calls


class OutputBroker:
    def __init__(self, lock: threading.Lock, max_undelivered: int) -> None:
        self._lock = lock
        self._max_undelivered = max_undelivered
        self._live: dict[str, _Waiters] = {}  # every id in use
        self._undelivered: collections.OrderedDict[str, _Waiters] = collections.OrderedDict()
        self._drops = DropReport(max_undelivered)

    # -- called with the lock held --------------------------------------------------------------
    def unused_id(self) -> str:
        rid = uuid.uuid4().hex
        while rid in self._live:  # pragma: no cover - astronomically unlikely
            rid = uuid.uuid4().hex
        return rid

    def add(self, req: Request) -> None:
        if req.request_id in self._live:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in use", param="request_id")
        self._live[req.request_id] = _Waiters(req)

    def find(self, request_id: str) -> Optional[Request]:
        w = self._live.get(request_id)
        return None if w is None else w.req

    @property
    def n_undelivered(self) -> int:
        return len(self._undelivered)

    @property
    def n_dropped(self) -> int:
        return self._drops.total

    def report_drops(self) -> None:
        """Log the drops not reported yet (at shutdown)."""
        self._drops.flush()

    def publish(self, changed: list[Request]) -> None:
        """New snapshots of `changed` exist: wake their waiters; keep finished outputs that
        nobody is waiting for."""
        for req in changed:
            w = self._live.get(req.request_id)
            if w is None or w.req is not req:  # already delivered (or dropped)
                continue
            if w.cond is not None:
                w.cond.notify_all()
            for wake in w.wakeups:
                wake()
            if req.finished and w.consumers == 0:
                self._keep_undelivered(w)

    # -- consumers (they take the lock) ----------------------------------------------------------
    def result(self, request_id: str, timeout: Optional[float] = None) -> RequestOutput:
        with self._lock:
            w = self._enter(request_id)
            try:
                deadline = None if timeout is None else time.monotonic() + timeout
                while not w.req.finished:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"request {request_id!r} did not finish within {timeout} s")
                    self._cond(w).wait(remaining)
                out = w.req.snapshot()
                self._deliver(w)
                return out
            finally:
                self._exit(w)

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """Unknown ids raise KeyError here, not at the first iteration."""
        with self._lock:
            w = self._enter(request_id)
        return self._stream(w)

    def _stream(self, w: _Waiters) -> Iterator[RequestOutput]:
        seen = 0
        try:
            while True:
                with self._lock:
                    while w.req.version == seen:
                        self._cond(w).wait()
                    seen = w.req.version
                    out = w.req.snapshot()
                    if out.finished:
                        self._deliver(w)
                yield out
                if out.finished:
                    return
        finally:
            with self._lock:
                self._exit(w)

    def stream_async(self, request_id: str) -> AsyncIterator[RequestOutput]:
        with self._lock:
            w = self._enter(request_id)
        return self._stream_async(w)

    async def _stream_async(self, w: _Waiters) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify() -> None:  # runs on the engine thread
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the event loop is closed; nobody is listening any more
                pass

        seen = 0
        with self._lock:
            w.wakeups.append(notify)
        try:
            while True:
                out = None
                with self._lock:
                    if w.req.version != seen:
                        seen = w.req.version
                        out = w.req.snapshot()
                        if out.finished:
                            self._deliver(w)
                if out is None:
                    await wake.wait()
                    wake.clear()
                    continue
                yield out
                if out.finished:
                    return
        finally:
            with self._lock:
                w.wakeups.remove(notify)
                self._exit(w)

    def discard(self, request_id: str) -> None:
        """Release a finished request's id without handing its output to anyone."""
        with self._lock:
            w = self._live.get(request_id)
            if w is not None and w.req.finished:
                self._deliver(w)

    # -- bookkeeping (lock held) ------------------------------------------------------------------
    def _enter(self, request_id: str) -> _Waiters:
        w = self._live.get(request_id)
        if w is None:
            raise KeyError(f"unknown request id {request_id!r}")
        w.consumers += 1
        if self._undelivered.get(request_id) is w:
            del self._undelivered[request_id]
        return w

    def _exit(self, w: _Waiters) -> None:
        w.consumers -= 1
        if w.consumers == 0 and w.req.finished:
            self._keep_undelivered(w)

    def _cond(self, w: _Waiters) -> threading.Condition:
        if w.cond is None:
            w.cond = threading.Condition(self._lock)
        return w.cond

    def _keep_undelivered(self, w: _Waiters) -> None:
        rid = w.req.request_id
        if self._live.get(rid) is not w:  # delivered already
            return
        self._undelivered[rid] = w
        while len(self._undelivered) > self._max_undelivered:
            old, _ = self._undelivered.popitem(last=False)
            del self._live[old]
            self._drops.dropped(old)

    def _deliver(self, w: _Waiters) -> None:
        rid = w.req.request_id
        if self._live.get(rid) is w:
            del self._live[rid]
        if self._undelivered.get(rid) is w:
            del self._undelivered[rid]
