"""Token buckets keyed by client (clients.py's key), for the per-client limits of the HTTP layer.

A bucket holds at most `burst` and refills at `rate` per second. Only clients below a full bucket
are remembered (a full bucket is the same as none), at most `max_clients` of them: the least
recently charged are forgotten first, which can only make a limit more lenient, never block a
client that did nothing.
"""
from __future__ import annotations

import collections
import time
from typing import Callable


class ClientBuckets:
    def __init__(self, rate: float, burst: float, max_clients: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (rate > 0 and burst > 0 and max_clients >= 1):
            raise ValueError(f"ClientBuckets: rate and burst must be > 0 and max_clients >= 1 "
                             f"(got rate={rate}, burst={burst}, max_clients={max_clients})")
        self.rate = rate
        self.burst = burst
        self.max_clients = max_clients
        self._clock = clock
        # client -> (amount left, time of that reading); clients below a full bucket only
        self._left: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self.on_forget: Callable[[str], None] = lambda client: None  # hears of every client dropped

    def __len__(self) -> int:
        return len(self._left)

    def balance(self, client: str) -> float:
        """What `client` has left now (negative: in debt)."""
        left, when = self._left.get(client, (self.burst, 0.0))
        now = self._clock()
        left = min(self.burst, left + (now - when) * self.rate)
        if left >= self.burst:
            if self._left.pop(client, None) is not None:
                self.on_forget(client)  # back to full: nothing to remember
        else:
            self._left[client] = (left, now)
            self._left.move_to_end(client)
        return left

    def take(self, client: str, amount: float) -> float:
        """Charge `amount` to `client` (it may go into debt); returns what is left."""
        left = self.balance(client) - amount
        self._left[client] = (left, self._clock())
        self._left.move_to_end(client)
        while len(self._left) > self.max_clients:
            oldest, _ = self._left.popitem(last=False)
            self.on_forget(oldest)
        return left

    def reserve(self, client: str, amount: float, max_wait: float) -> float | None:
        """Charge `amount` now for use after the returned wait: the seconds until the bucket has
        refilled what the client is then in debt (0 when it held `amount`). None, and nothing
        charged, when that wait would exceed `max_wait`. Concurrent callers queue in the debt, so
        each waits its turn behind the ones before."""
        wait = max(0.0, amount - self.balance(client)) / self.rate
        if wait > max_wait:
            return None
        self.take(client, amount)
        return wait

    def give_back(self, client: str, amount: float) -> None:
        """Return `amount` to `client`'s bucket (never past a full one)."""
        left = self.balance(client) + amount
        if left >= self.burst:
            if self._left.pop(client, None) is not None:
                self.on_forget(client)
        else:
            self._left[client] = (left, self._clock())

    def take_if_available(self, client: str, amount: float = 1.0) -> bool:
        """Charge `amount` only when the bucket holds it; whether it did."""
        if self.balance(client) < amount:
            return False
        self.take(client, amount)
        return True
