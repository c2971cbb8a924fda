"""The uvicorn side of `serve`: connection timeouts and limits, and a shutdown that drains.

Limits (all options of `serve`; defaults in settings.py):
- --header-timeout (10 s): a connection must deliver a complete request line and headers this
  long after it opens (or after its previous response): slow-header clients cannot hold
  connections open forever.
- request line + headers over 16 KiB get 400 and the connection is closed, however they arrive:
  the first read that takes a head past the limit without its end is refused there, and no byte
  past the limit is ever parsed (h11's own limits and a check on the parsed request back this up).
- malformed or oversize heads are charged to their client's rejection budget (rejections.py), as
  the app's rejections are; while the client is in debt, such a head is not answered 400 but held
  for the budget's delay, then answered with a fixed 429 and closed. Refusals are logged as a
  warning at most once per LOG_EVERY seconds of each kind, with a count (log_every.py), the rest
  at DEBUG. uvicorn's access log (a line per request) is off unless --access-log.
- --keep-alive-timeout (5 s): an idle keep-alive connection is closed after this.
- a response sent before its request's body was read (an error, or a route that reads no body)
  ends the connection: the server half-closes it at once and discards what the client still
  sends for at most LINGER_SECONDS or LINGER_BYTES, then closes it. A response that says
  `Connection: close` (the 413 of an oversize body, a 408, the budget's 429) closes it at once
  instead, leaving the rest unread: a client still writing then sees a reset, and must read while
  it writes to see the answer. A declared body can never keep a connection open past its response.
- --body-timeout (30 s, enforced by the service): the whole body must arrive within this.
- --max-connections (2048) and --max-connections-per-client (256): connections.py; a refused
  connection gets the error (a fixed answer written here, not by the app) as soon as it sends
  anything, then the lingering close above; one that sends nothing is closed after REFUSED_WAIT
  seconds.
- --unproven-connection-rate (16 per second): a client's connections are on probation until one
  of their responses succeeds (connections.py); past --max-connections-per-client of them, its new
  connections are held unread until their turn (reading paused; the header timeout starts when
  reading does). On uvloop, which reads once after connection_made whatever it paused, that
  first read is kept unparsed until the turn.
- the event loop (--event-loop): uvloop when installed, else asyncio's; both are tested.

Shutdown (SIGINT/SIGTERM): `DrainingServer` runs the app's `drain()` first (stop admitting, a
bounded grace period for running requests, then end the rest in-band), then uvicorn's own
shutdown, and exits without re-raising the signal: no KeyboardInterrupt traceback.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import signal
import threading
from http import HTTPStatus
from typing import Any, Awaitable, Callable, Generator, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .clients import ClientKeys
from .connections import ConnectionLimiter, Refusal
from .errors import APIError
from .log_every import LogEvery
from .rejections import IN_DEBT_MESSAGE, RejectionBudget
from .settings import (DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
                       DEFAULT_MAX_CONNECTIONS_PER_CLIENT, DEFAULT_UNPROVEN_CONNECTION_RATE, MAX_HEADER_BYTES)

logger = logging.getLogger(__name__)

LINGER_SECONDS = 2.0        # after an early response: how long the rest of a body is discarded
LINGER_BYTES = 1 << 20      # ... and how much of it, before the connection is closed
REFUSED_WAIT = 1.0          # a refused connection's time to send the request its error answers

# The end of a request head as h11 finds it: an empty line, CRLF or bare LF.
HEAD_END = re.compile(b"\n\r?\n")
UVICORN_MALFORMED_WARNING = "Invalid HTTP request received."  # uvicorn's, once per malformed request


PLAIN_TEXT = b"text/plain; charset=utf-8"


def _closing_answer(status: int, body: bytes, *headers: bytes, content_type: bytes = PLAIN_TEXT) -> bytes:
    """A whole HTTP/1.1 response that ends its connection, written as is by the transport."""
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode() + b"content-type: " + content_type
            + b"\r\nconnection: close\r\n" + b"".join(h + b"\r\n" for h in headers)
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


OVERSIZE_HEAD_ANSWER = _closing_answer(400, f"Request line and headers over {MAX_HEADER_BYTES} bytes".encode())


@functools.lru_cache(maxsize=16)
def in_debt_answer(retry_after: int) -> bytes:
    """The 429 for a bad request from a client in debt, by its Retry-After seconds."""
    return _closing_answer(429, IN_DEBT_MESSAGE.encode(), b"retry-after: " + str(retry_after).encode())


def request_head_bytes(event: h11.Request) -> int:
    """The size of a parsed request line and its headers, as sent (CRLFs, ': ' separators)."""
    size = len(event.method) + len(event.target) + len(b"  HTTP/1.1\r\n\r\n")
    for name, value in event.headers:
        size += len(name) + len(value) + 4
    return size


class BoundedHeadConnection(h11.Connection):
    """h11 bounds a request head that arrives in pieces (max_incomplete_event_size) but parses
    one that arrives whole in one read, whatever its size; this bounds that one too. It also
    calls `on_success` when a response starts that shows the connection carried a successful
    request: a status below 400, sent after the whole request arrived (a stream counts as it
    starts, so a client that cancels it is not held against)."""

    def __init__(self, our_role: Any, max_incomplete_event_size: int,
                 on_success: Callable[[], None] = lambda: None) -> None:
        super().__init__(our_role, max_incomplete_event_size=max_incomplete_event_size)
        self.on_success = on_success

    def send(self, event: Any) -> Any:
        if (isinstance(event, h11.Response) and event.status_code < 400
                and self.their_state in (h11.DONE, h11.MUST_CLOSE)):
            self.on_success()
        return super().send(event)

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request) and request_head_bytes(event) > MAX_HEADER_BYTES:
            raise h11.RemoteProtocolError(f"request line and headers over {MAX_HEADER_BYTES} bytes",
                                          error_status_hint=431)
        return event


class _DropUvicornMalformedWarning(logging.Filter):
    """uvicorn warns once per malformed request and names no client; the protocol below logs
    those refusals itself, with the client, at most once per LOG_EVERY seconds (log_every.py)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != UVICORN_MALFORMED_WARNING


_DROP_UVICORN_MALFORMED_WARNING = _DropUvicornMalformedWarning()


def refusal_answer(refusal: Refusal) -> bytes:
    """The whole response to a refused connection, in the API's error shape, built without the
    app: a refusal costs the server one small write, whatever a client cycling connections asks."""
    body = json.dumps(APIError(refusal.status, refusal.message, code=refusal.code).body(),
                      separators=(",", ":")).encode()
    return _closing_answer(refusal.status, body, b"retry-after: 1", content_type=b"application/json")


def serving_protocol(timeout: float, limiter: ConnectionLimiter, keys: ClientKeys,
                     rejections: Optional[RejectionBudget] = None) -> type:
    """The h11 protocol class of one server: header timeout, bounded heads, connections closed
    after early responses, and the per-client connection limits of `limiter`. `rejections`, the
    app's rejection budget, hears of every connection that closes (as "host:port", the app's
    name for a connection) and is charged for every request the transport refuses as malformed
    (an oversize head included), as the app charges the requests it rejects; while the client is
    in debt, such a request is refused cheaply (see `_refuse_in_debt`)."""
    refused_connections = LogEvery(logger, logging.WARNING)
    refused_heads = LogEvery(logger, logging.WARNING)

    class ServingH11Protocol(H11Protocol):
        header_timeout = timeout
        connection_limiter = limiter  # shared by every connection of this server
        _header_timer: Optional[asyncio.TimerHandle] = None
        _linger_timer: Optional[asyncio.TimerHandle] = None
        _held_timer: Optional[asyncio.TimerHandle] = None  # a refusal held for the client's debt
        _lingered: Optional[int] = None     # bytes discarded after an answer or refusal; None: none
        _head_bytes = 0                     # bytes received of a request head not yet complete
        _client_key = ""
        _connection = ""                    # "host:port", the rejection budget's name for it
        _trusted = False
        _counted = False
        _proven = False                     # a response of this connection succeeded (connections.py)
        _paced_timer: Optional[asyncio.TimerHandle] = None  # held unread until the client's turn
        _read_early = b""                   # what a held connection sent before its turn (see data_received)
        _refusal: Optional[bytes] = None    # a refused connection's answer (connections.py)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = BoundedHeadConnection(h11.SERVER, MAX_HEADER_BYTES, self._succeeded)

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = self.client[0] if self.client else ""
            self._client_key = keys.peer_key(peer)
            self._trusted = keys.is_trusted(peer)
            self._connection = f"{self.client[0]}:{self.client[1]}" if self.client else ""
            refusal = limiter.open(self._client_key, trusted=self._trusted)
            if refusal is None:
                self._counted = True
                wait = limiter.pace(self._client_key, trusted=self._trusted)
                if wait > 0:  # too many unproven connections: read this one in its turn
                    transport.pause_reading()
                    self._paced_timer = self.loop.call_later(wait, self._start_reading)
                    return
                self._arm_header_timer(self.header_timeout)
                return
            refused_connections.log("refused a connection from %r: %s", self._client_key, refusal.message)
            self.connections.discard(self)  # not counted against uvicorn's limit either
            self._refusal = refusal_answer(refusal)
            self._arm_header_timer(min(REFUSED_WAIT, self.header_timeout))

        def _succeeded(self) -> None:
            """A response of this connection succeeded: its place on probation comes back, once."""
            if self._counted and not self._proven:
                self._proven = True
                limiter.proven(self._client_key)

        def _start_reading(self) -> None:
            self._paced_timer = None
            if not self.transport.is_closing():
                self.transport.resume_reading()
                self._arm_header_timer(self.header_timeout)
                early, self._read_early = self._read_early, b""
                if early:
                    self.data_received(early)

        def data_received(self, data: bytes) -> None:
            if self._paced_timer is not None:
                # Held unread, yet read: uvloop starts reading after connection_made, whatever it
                # paused. Keep this one read (bounded by the loop's read size) for the connection's
                # turn, and pause now, which every loop honours from here on.
                self.transport.pause_reading()
                self._read_early += data
                return
            if self._lingered is not None:  # the rest of an answered request's body: discarded
                self._lingered += len(data)
                if self._lingered > LINGER_BYTES:
                    self.transport.close()
                return
            if self._refusal is not None:  # a refused connection: its answer, as soon as it sends
                self.transport.write(self._refusal)
                self._linger()
                return
            if self.conn.their_state is h11.IDLE:  # a request head is arriving
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEADER_BYTES and self._head_too_long(data):
                    self._refuse_oversize_head()
                    return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._head_bytes = 0
                self._cancel_header_timer()

        def _head_too_long(self, data: bytes) -> bool:
            """Whether the head that `data` continues has no end within MAX_HEADER_BYTES. The
            bytes before `data` hold no end (h11 would have parsed the head), so only `data` is
            searched, and only as far as the limit: no byte past it is ever parsed."""
            before = self._head_bytes - len(data)
            if before and data[:1] in (b"\n", b"\r"):
                return False  # an end may straddle the two reads: h11 decides (and bounds it too)
            return HEAD_END.search(data, 0, max(0, MAX_HEADER_BYTES - before)) is None

        def _refuse_oversize_head(self) -> None:
            """Refuse a request whose head passed MAX_HEADER_BYTES, unparsed: a fixed 400 and a
            lingering close, or while its client is in debt a held 429."""
            self._cancel_header_timer()
            refused_heads.log("refused a request head from %r: over %d bytes", self._client_key, MAX_HEADER_BYTES)
            wait = self._charge()
            if wait > 0:
                self._refuse_in_debt(wait)
                return
            self.transport.write(OVERSIZE_HEAD_ANSWER)
            self._linger()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a malformed request (one h11 refuses), ended by a lingering
            close: closing at once, with the rest of the request unread, would reset the
            connection and could destroy the answer before the client reads it. While the client
            is in debt, a held 429 instead."""
            refused_heads.log("refused a request head from %r: malformed request line or headers", self._client_key)
            wait = self._charge()
            try:
                output = self.conn.send(h11.Response(status_code=400, reason=b"Bad Request", headers=[
                    (b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]))
                output += self.conn.send(h11.Data(data=msg.encode("ascii")))
                output += self.conn.send(h11.EndOfMessage())
            except h11.LocalProtocolError:  # a response is already under way: no room for this one
                self.transport.close()
                return
            if wait > 0:
                self._refuse_in_debt(wait)
                return
            self.transport.write(output)
            self._linger()

        def _charge(self) -> float:
            """Charge a request the transport refused to its client, at the budget's minimum (no
            head is parsed past MAX_HEADER_BYTES, so every refused head costs about the same): 0,
            or the delay its answer must wait when the client was in debt already (as the app
            does for the requests it rejects). A trusted proxy's connections carry many clients:
            they are exempt, as from the connection limits (the app charges the client
            X-Forwarded-For names instead)."""
            if rejections is None or not self._connection or self._trusted:
                return 0.0
            wait = rejections.delay(self._client_key)
            rejections.charge(self._client_key, 0, self._connection)
            return wait

        def _refuse_in_debt(self, wait: float) -> None:
            """A bad request from a client in debt: parse nothing more, and after `wait` seconds
            (the time its debt takes to pay off, at most the budget's max_delay) write a fixed
            429 and close. Holding costs a timer, and a client that opens a connection per bad
            request is paced by its connection cap over the delay; its well-formed requests on
            other connections are served meanwhile."""
            self._cancel_header_timer()
            self._unset_keepalive_if_required()
            self._lingered = 0  # what else arrives is discarded (bounded), and a close is noticed
            self._held_timer = self.loop.call_later(wait, self._answer_in_debt, max(1, round(wait)))

        def _answer_in_debt(self, retry_after: int) -> None:
            self._held_timer = None
            if not self.transport.is_closing():
                self.transport.write(in_debt_answer(retry_after))
                self.transport.close()

        def on_response_complete(self) -> None:
            unread_body = self.conn.their_state is h11.SEND_BODY
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if unread_body:
                self._linger()
            else:  # keep-alive: the next request has its own deadline
                self._arm_header_timer(self.header_timeout)

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._cancel_header_timer()
            for timer in (self._linger_timer, self._held_timer, self._paced_timer):
                if timer is not None:
                    timer.cancel()
            self._linger_timer = self._held_timer = self._paced_timer = None
            if self._counted:
                self._counted = False
                limiter.close(self._client_key)
            if rejections is not None and self._connection:
                rejections.connection_closed(self._connection)
            super().connection_lost(exc)

        def _linger(self) -> None:
            """The response is out but the request's body is still arriving: no further request
            can follow on this connection. Half-close it (the client reads the response, then
            EOF) and discard the body for a bounded time and size, so that closing does not reset
            a client still writing its body before it has read the response."""
            self._unset_keepalive_if_required()
            self._cancel_header_timer()
            self._lingered = 0
            logger.debug("closing a connection from %r: its response went out before its body was read",
                         self._client_key)
            try:
                self.transport.write_eof()
            except (OSError, RuntimeError, NotImplementedError):
                self.transport.close()
                return
            self._linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)

        def _arm_header_timer(self, seconds: float) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(seconds, self._header_timeout_expired)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout_expired(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.debug("closing a connection from %r: no complete request headers within the timeout",
                             self._client_key)
                self.transport.close()

    return ServingH11Protocol


def make_config(app: Any, *, host: str, port: int, log_level: str,
                header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
                max_connections: int = DEFAULT_MAX_CONNECTIONS,
                max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                unproven_connection_rate: float = DEFAULT_UNPROVEN_CONNECTION_RATE,
                client_keys: Optional[ClientKeys] = None,
                rejections: Optional[RejectionBudget] = None,
                access_log: bool = False, event_loop: str = "auto") -> uvicorn.Config:
    """The uvicorn config of one server. client_keys: who is a client (its trusted proxies);
    pass the app's (`app.state.client_keys`) so that both layers agree. rejections: pass the
    app's rejection budget (`app.state.service.rejections`): a new connection reusing a closed
    one's port then starts with a clean record, and a malformed request the transport refuses
    costs its client as a rejected one does. access_log: uvicorn's line per request (off: a
    client would set the number of lines, each costing about what its request does). event_loop:
    "uvloop", "asyncio", or "auto" (uvloop when it is installed)."""
    limiter = ConnectionLimiter(max_connections, max_connections_per_client, unproven_connection_rate)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=access_log, loop=event_loop,
        # Clients are keyed by clients.py alone (X-Forwarded-For only from --trusted-proxies);
        # uvicorn's own proxy headers would let any peer on 127.0.0.1 name itself.
        proxy_headers=False,
        http=serving_protocol(header_timeout, limiter, client_keys or ClientKeys(), rejections),
        timeout_keep_alive=int(max(1, keep_alive_timeout)),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        # Connections are limited by `limiter`. Running requests are bounded by the connections
        # (one at a time each) and, for completions, by --max-queue.
        limit_concurrency=None,
        # After drain() every stream has ended; this only bounds connections that still linger.
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    # After uvicorn.Config, which configures uvicorn's loggers (a filter already there stays once).
    logging.getLogger("uvicorn.error").addFilter(_DROP_UVICORN_MALFORMED_WARNING)
    return config


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
