"""Open connections per client, so that one client cannot take every connection the server has.

Three rules decide whether a new connection is served (the key is clients.py's peer key):
- the server holds fewer than --max-connections open connections, else 503;
- its client holds fewer than --max-connections-per-client, else 429 (a trusted proxy, which
  carries many clients, is exempt);
- room for new clients: once three quarters of --max-connections are open, a client that
  already holds at least its fair share (the open connections divided by the clients holding
  them) is refused (503), so the last quarter goes to clients holding fewer.

A refused connection is not counted: it is answered at its first request with the error and
Connection: close, or closed if that request does not arrive within a second.

Pacing unproven connections: a connection is on probation from its opening until a successful
response of it starts (below 400, after its whole request arrived; transport.py tells). Each client may have
--max-connections-per-client connections on probation at once; past that, its new connections are
read at --unproven-connection-rate per second (held unread, which costs the server nothing, until
their turn). A connection that proves itself gives its place back. So a client whose connections
are all refused, idle or answered before their body was read (a connection-churn flood) costs
the server that many exchanges a second, however many connections it cycles through, while any
client whose requests succeed (a pool of keep-alive connections, or a new connection per
request) is never paced. Trusted proxies are exempt.
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .buckets import ClientBuckets
from .settings import DEFAULT_UNPROVEN_CONNECTION_RATE

MAX_PACED_CLIENTS = 10_000  # clients with connections on probation remembered (oldest forgotten: lenient)


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str
    message: str


class ConnectionLimiter:
    def __init__(self, max_connections: int, max_per_client: int,
                 unproven_rate: float = DEFAULT_UNPROVEN_CONNECTION_RATE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_connections < 1 or max_per_client < 1:
            raise ValueError(f"connection limits must be >= 1 (got {max_connections}, {max_per_client})")
        if not unproven_rate > 0:
            raise ValueError(f"unproven_rate must be > 0 connections per second (got {unproven_rate})")
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.crowded_at = max(1, (3 * max_connections) // 4)
        self.total = 0
        self._open: collections.Counter[str] = collections.Counter()
        # per client: places for connections on probation, refilled at unproven_rate
        self._probation = ClientBuckets(unproven_rate, max_per_client, MAX_PACED_CLIENTS, clock)

    def open(self, key: str, trusted: bool = False) -> Optional[Refusal]:
        """Count a new connection of client `key` (`trusted`: a trusted proxy), or say why it is
        refused (then it is not counted)."""
        held = self._open.get(key, 0)
        if self.total >= self.max_connections:
            return Refusal(503, "server_busy", f"Server busy: {self.total} connections open (limit "
                                               f"--max-connections {self.max_connections}); retry later")
        if not trusted and held >= self.max_per_client:
            return Refusal(429, "too_many_connections",
                           f"Too many connections from this client: {held} open (limit "
                           f"--max-connections-per-client {self.max_per_client}); reuse or close them")
        if not trusted and held and self.total >= self.crowded_at and held * len(self._open) >= self.total:
            return Refusal(503, "server_busy", f"Server nearly full ({self.total} of {self.max_connections} "
                                               f"connections) and this client holds {held}, at least its "
                                               "share; retry later")
        self._open[key] = held + 1
        self.total += 1
        return None

    def pace(self, key: str, trusted: bool = False) -> float:
        """A counted connection of `key` starts its probation: the seconds to hold it unread
        first (0 while the client has a place free). The places a client can owe are bounded by
        the connections it may hold, so the wait is at most max_per_client / unproven_rate."""
        if trusted:
            return 0.0
        wait = self._probation.reserve(key, 1.0, math.inf)
        assert wait is not None  # an unbounded wait is never refused
        return wait

    def proven(self, key: str) -> None:
        """A connection of `key` (paced by `pace`) carried a successful response: its place on
        probation comes back."""
        self._probation.give_back(key, 1.0)

    def close(self, key: str) -> None:
        """A counted connection of `key` closed."""
        left = self._open[key] - 1
        if left > 0:
            self._open[key] = left
        else:
            self._open.pop(key, None)
        self.total -= 1

    def held(self, key: str) -> int:
        return self._open.get(key, 0)
