"""Bridge from the Server's request streams to asyncio, without blocking the event loop.

`snapshots(server, rid)` uses the Server's own asyncio stream (``stream_async``, woken by the
engine thread through ``call_soon_threadsafe``) when it has one. For a server with only the
contract's blocking ``stream(rid)``, `SnapshotStream` is the fallback: one daemon thread per
request drains ``server.stream(rid)``. Snapshots are cumulative (each RequestOutput carries all
tokens and text so far), so the thread only keeps the newest one and wakes the event loop; a
slow client therefore costs O(1) memory per request instead of a queue of ever longer
snapshots. A dedicated thread (not the default
executor, which has only a few workers on a small machine) keeps every stream moving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator

logger = logging.getLogger(__name__)


class SnapshotStream:
    """Async iterator over the RequestOutput snapshots of one submitted request.

    Consecutive snapshots may be coalesced (only the newest is delivered), the final one
    (``finished=True``) never is. Errors raised by ``server.stream`` are re-raised in the
    consumer.
    """

    def __init__(self, server: Any, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._rid = request_id
        self._loop = loop
        self._lock = threading.Lock()
        self._latest: Any = None
        self._error: BaseException | None = None
        self._done = False
        self._wakeup = asyncio.Event()
        self._thread = threading.Thread(target=self._pump, name=f"stream-{request_id}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for out in self._server.stream(self._rid):
                with self._lock:
                    self._latest = out
                self._notify()
        except BaseException as exc:  # handed to the consumer, which decides
            with self._lock:
                self._error = exc
        finally:
            with self._lock:
                self._done = True
            self._notify()

    def _notify(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._wakeup.set)
        except RuntimeError:
            # The event loop is closed: the HTTP server is gone, nobody is listening.
            pass

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            with self._lock:
                out, self._latest = self._latest, None
                error, done = self._error, self._done
            if out is not None:
                yield out
            if error is not None:
                raise error
            if done:
                return


def snapshots(server: Any, request_id: str) -> AsyncIterator[Any]:
    """Async iterator of the request's RequestOutput snapshots; call from the event loop."""
    stream_async = getattr(server, "stream_async", None)
    if stream_async is not None:
        return stream_async(request_id)
    return aiter(SnapshotStream(server, request_id, asyncio.get_running_loop()))
