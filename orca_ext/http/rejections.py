"""A per-client budget for rejected requests, so that a stream of bad requests from one address
cannot eat the CPU that generation needs.

Rejecting a request is cheap per byte but not free: a 1 MB body that fails validation still has
to be received and parsed (about 2-3 ms of the event loop's time, holding the GIL the engine
thread also needs). Sent back to back, such requests take a quarter of a core. So each client
address has a token bucket of "rejected bytes": every request answered 4xx (other than 429)
costs its body size, at least MIN_CHARGE bytes. While an address is in debt, its requests are
answered 429 without reading their bodies, only after a delay (the time the debt takes to pay
off, at most MAX_DELAY seconds), and with Connection: close. A client that retries at once is
slowed to the budget's pace; a well-behaved client never notices it.

Clients are told apart by their IP address (behind a proxy, all clients share one).
"""
from __future__ import annotations

import collections
import time
from typing import Callable

RATE_BYTES = 1 << 20          # rejected bytes per second an address may send, sustained
BURST_BYTES = 8 << 20         # ... and at once
MIN_CHARGE = 16 << 10         # a rejected request costs at least this (bounds floods of tiny ones)
MAX_DELAY = 5.0               # the longest a refused request is held before its 429
MAX_CLIENTS = 10_000          # addresses remembered (least recently seen are forgotten first)


class RejectionBudget:
    def __init__(self, rate: float = RATE_BYTES, burst: float = BURST_BYTES, min_charge: int = MIN_CHARGE,
                 max_delay: float = MAX_DELAY, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.min_charge = min_charge
        self.max_delay = max_delay
        self.max_clients = max_clients
        self._clock = clock
        # address -> (bytes left, time of that reading); only addresses that were charged
        self._left: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def _balance(self, addr: str) -> float:
        left, when = self._left.get(addr, (self.burst, 0.0))
        now = self._clock()
        left = min(self.burst, left + (now - when) * self.rate)
        if left >= self.burst:
            self._left.pop(addr, None)  # back to full: nothing to remember
        else:
            self._left[addr] = (left, now)
            self._left.move_to_end(addr)
        return left

    def delay(self, addr: str) -> float:
        """0 when `addr` may send a request; otherwise the seconds to hold its 429 (the time its
        debt takes to pay off, at most max_delay)."""
        left = self._balance(addr)
        return 0.0 if left >= 0 else min(self.max_delay, -left / self.rate)

    def charge(self, addr: str, nbytes: int) -> None:
        """A request of `nbytes` from `addr` was rejected."""
        left = self._balance(addr) - max(nbytes, self.min_charge)
        self._left[addr] = (left, self._clock())
        self._left.move_to_end(addr)
        while len(self._left) > self.max_clients:
            self._left.popitem(last=False)
