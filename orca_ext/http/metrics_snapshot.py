"""/metrics from a snapshot: scrapes cannot take the engine lock faster than once per interval.

Rendering the metrics reads `server.stats()`, which takes the engine's lock, and walks every
histogram while holding the GIL. A client scraping in a loop would do that back to back. So the
rendered text is kept for `interval` seconds: a scrape within that time gets the kept text, and
concurrent scrapes after it share one refresh (run in a worker thread, off the event loop). The
engine statistics and the counters in a scrape are thus at most `interval` seconds old.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional


class MetricsSnapshot:
    def __init__(self, render: Callable[[], bytes], interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval >= 0:
            raise ValueError(f"metrics_interval must be >= 0 seconds (got {interval})")
        self._render = render
        self.interval = interval
        self._clock = clock
        self._body: Optional[bytes] = None
        self._taken_at = 0.0
        self._refresh: Optional[asyncio.Future] = None
        self.renders = 0  # how many times the metrics were rendered

    async def get(self) -> bytes:
        if self._body is not None and self._clock() - self._taken_at < self.interval:
            return self._body
        if self._refresh is None:
            self._refresh = asyncio.ensure_future(self._take())
        # shield: a scraper that hangs up does not cancel the refresh the others wait for.
        return await asyncio.shield(self._refresh)

    async def _take(self) -> bytes:
        try:
            taken_at = self._clock()
            body = await asyncio.to_thread(self._render)
            self.renders += 1
            self._body, self._taken_at = body, taken_at
            return body
        finally:
            self._refresh = None
