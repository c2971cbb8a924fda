"""A per-client budget for rejected requests, so that a stream of bad requests from one client
cannot eat the CPU that generation needs, while good requests from the same address (behind a
NAT or a proxy, or on localhost) keep being served.

Rejecting a request is cheap per byte but not free: a 1 MB body that fails validation still has
to be received and parsed (about 2-3 ms of the event loop's time, holding the GIL the engine
thread also needs). Sent back to back, such requests take a quarter of a core. So each client
(clients.py's key) has a token bucket of "rejected bytes": every request answered 4xx (other
than 429) costs the body bytes actually read, at least MIN_CHARGE bytes. A declared
Content-Length costs nothing by itself: a header-only request that declares a huge body and is
refused unread costs MIN_CHARGE.

While a client is in debt:
- a request on a connection that was itself rejected before is answered 429 without its body
  being read, only after a delay (the time the debt takes to pay off, at most MAX_DELAY seconds),
  and with Connection: close;
- a request on any other connection is read and checked as usual, so a well-formed request is
  never held back by another connection's rejections; if it is rejected too, its answer waits for
  the same delay and closes the connection. A client that sends each bad request on a new
  connection is thus paced by its connection limit (connections.py) over the delay.

The transport (transport.py) follows the same rules for the requests it refuses before the app
sees them (a malformed or oversize head, MIN_CHARGE each): while the client is in debt, such a
request is held for the delay, parsed no further, then answered with a fixed 429 and closed.
"""
from __future__ import annotations

import time
from typing import Callable

from .buckets import ClientBuckets

RATE_BYTES = 1 << 20          # rejected bytes per second a client may send, sustained
BURST_BYTES = 8 << 20         # ... and at once
MIN_CHARGE = 16 << 10         # a rejected request costs at least this (bounds floods of tiny ones)
MAX_DELAY = 5.0               # the longest a refused request is held before its 429
MAX_CLIENTS = 10_000          # clients remembered (least recently seen are forgotten first)
MAX_MARKED_CONNECTIONS = 1 << 16  # connections whose marks connection_closed can find (oldest dropped)
MAX_CONNECTIONS_REMEMBERED = 1024  # rejected connections remembered per client
# The held 429's text, from the app and from the transport alike.
IN_DEBT_MESSAGE = "Too many rejected requests from this client; fix the requests, then retry"


class RejectionBudget:
    def __init__(self, rate: float = RATE_BYTES, burst: float = BURST_BYTES, min_charge: int = MIN_CHARGE,
                 max_delay: float = MAX_DELAY, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_charge = min_charge
        self.max_delay = max_delay
        self._buckets = ClientBuckets(rate, burst, max_clients, clock)  # rejected bytes per client
        self._buckets.on_forget = self._forget
        # client -> its connections that had a request rejected (forgotten with the client)
        self._rejected_connections: dict[str, dict[str, None]] = {}
        # connection -> the clients that marked it, so that a closing connection touches only its
        # own marks; an entry goes when its connection closes (at most MAX_MARKED_CONNECTIONS,
        # for servers whose transport never reports closes)
        self._marked_by: dict[str, set[str]] = {}

    @property
    def rate(self) -> float:
        return self._buckets.rate

    @property
    def burst(self) -> float:
        return self._buckets.burst

    def _forget(self, client: str) -> None:
        self._rejected_connections.pop(client, None)

    def left(self, client: str) -> float:
        """The rejected bytes `client` may still send before it is in debt (negative: the debt)."""
        return self._buckets.balance(client)

    def delay(self, client: str) -> float:
        """0 when `client` is not in debt; otherwise the seconds the debt takes to pay off, at
        most max_delay."""
        left = self.left(client)
        return 0.0 if left >= 0 else min(self.max_delay, -left / self.rate)

    def hold_back(self, client: str, connection: str) -> float:
        """The delay before a 429 for a request on `connection` that is refused unread: > 0 only
        when `client` is in debt and this connection had a request rejected before."""
        wait = self.delay(client)
        return wait if wait > 0 and connection in self._rejected_connections.get(client, ()) else 0.0

    def connection_closed(self, connection: str) -> None:
        """`connection` ("host:port") is gone: a later connection from the same port is another
        connection, which no rejection of this one may hold back."""
        for client in self._marked_by.pop(connection, ()):
            self._rejected_connections.get(client, {}).pop(connection, None)

    def charge(self, client: str, nbytes: int, connection: str = "") -> None:
        """A request from `client` on `connection` was rejected after `nbytes` of its body were read."""
        self._buckets.take(client, max(nbytes, self.min_charge))
        if connection:
            seen = self._rejected_connections.setdefault(client, {})
            seen[connection] = None
            self._marked_by.setdefault(connection, set()).add(client)
            if len(self._marked_by) > MAX_MARKED_CONNECTIONS:
                del self._marked_by[next(iter(self._marked_by))]
            if len(seen) > MAX_CONNECTIONS_REMEMBERED:
                del seen[next(iter(seen))]
