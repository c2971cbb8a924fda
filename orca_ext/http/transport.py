"""The uvicorn side of `serve`: connection timeouts and limits, and a shutdown that drains.

Limits (all options of `serve`):
- --header-timeout (10 s): a connection must deliver a complete request line and headers this
  long after it opens (or after its previous response): slow-header clients cannot hold
  connections open forever. Headers over 16 KiB are refused by h11 (400).
- --keep-alive-timeout (5 s): an idle keep-alive connection is closed after this.
- --body-timeout (30 s, enforced by the service): the whole body must arrive within this.
- --max-connections (2048): beyond this many open connections (or running requests), new
  requests get 503 at once instead of queueing in the kernel.

Shutdown (SIGINT/SIGTERM): `DrainingServer` runs the app's `drain()` first (stop admitting, a
bounded grace period for running requests, then end the rest in-band), then uvicorn's own
shutdown, and exits without re-raising the signal: no KeyboardInterrupt traceback.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import Any, Awaitable, Callable, Generator, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import (DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
                       MAX_HEADER_BYTES)

logger = logging.getLogger(__name__)



def header_timeout_protocol(timeout: float) -> type:
    """An h11 protocol class that closes a connection whose request headers are not complete
    `timeout` seconds after it opened or after its previous response."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        header_timeout = timeout
        _header_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # keep-alive: the next request has its own deadline
                self._arm_header_timer()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout_expired(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.debug("closing a connection from %r: no complete request headers within %g s",
                             self.client, self.header_timeout)
                self.transport.close()

    return HeaderTimeoutH11Protocol


def make_config(app: Any, *, host: str, port: int, log_level: str,
                header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
                max_connections: int = DEFAULT_MAX_CONNECTIONS) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=header_timeout_protocol(header_timeout),
        timeout_keep_alive=int(max(1, keep_alive_timeout)),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        limit_concurrency=max_connections,
        # After drain() every stream has ended; this only bounds connections that still linger.
        timeout_graceful_shutdown=5,
        lifespan="off",
    )


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown first awaits `drain(hurry)`; `hurry()` turns True on a
    second Ctrl-C, which cuts the grace period short."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[Callable[[], bool]], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:  # stop accepting connections before anything else
            server.close()
        try:
            await self._drain(lambda: self.force_exit)
        except Exception:  # the drain is best effort: uvicorn's shutdown must still run
            logger.exception("draining the requests failed")
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the captured signal after shutdown (KeyboardInterrupt for SIGINT);
        # after a drain the process has nothing left to interrupt, so it exits normally instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
