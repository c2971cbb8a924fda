"""Heartbeats: how the driver learns within seconds that a worker stopped answering.

A worker that is stopped (SIGSTOP), or whose host froze, neither raises nor closes its
connections, so nothing else reveals it until a batch's result is overdue (`worker_timeout`,
minutes), and not at all while the server idles. So every worker counts up its key `beat/<w>`
on the group's store every `interval` seconds, from a thread of its own; the driver reads the
counters every `interval` seconds and names a worker whose counter has not moved for `timeout`
seconds of the driver's own time.

Both ends use a store client of their own (groups.store_client): a client serves one call at a
time, and no other thread's call may hold a beat up.

The counter is read against the driver's clock, not compared with the worker's: a driver that
stalls itself sees the counters moved when it looks again, and never blames a worker for it.
A worker's beat needs its Python interpreter lock: a single kernel call that holds it for longer
than `timeout` (a very long prefill on a CPU) would look like a hang, hence a timeout well above
the interval.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from ..config import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S
from .groups import NAMESPACE
from .worker_info import WorkerInfo

log = logging.getLogger(__name__)


def beat_key(rank: int) -> str:
    return NAMESPACE + f"beat/{rank}"


def check_heartbeat_options(interval: float, timeout: float) -> tuple[float, float]:
    """(interval, timeout) as floats; ValueError naming the option unless 0 < interval < timeout."""
    interval, timeout = float(interval), float(timeout)
    if not interval > 0:
        raise ValueError(f"heartbeat_interval must be > 0 seconds, got {interval!r}")
    if not timeout > interval:
        raise ValueError(f"heartbeat_timeout must be greater than heartbeat_interval={interval:g} s, "
                         f"got {timeout!r}")
    return interval, timeout


class HeartbeatSender:
    """A worker's side: counts up `beat/<rank>` every `interval` seconds until the process ends."""

    def __init__(self, store, rank: int, interval: float):
        self._store = store
        self._key = beat_key(rank)
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name=f"orca-heartbeat-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._store.add(self._key, 1)
            except Exception as exc:  # the store is gone with the driver: the worker exits anyway
                log.debug("heartbeat stopped: %s", exc)
                return
            time.sleep(self._interval)


class HeartbeatMonitor:
    """The driver's side: `on_silent(worker, seconds)` once for the first worker whose counter has
    not moved for `timeout` seconds; then the monitor ends (the group fails as a whole)."""

    def __init__(self, store, workers: Sequence[WorkerInfo], interval: float, timeout: float,
                 on_silent: Callable[[WorkerInfo, float], None], stopped: Callable[[], bool]):
        self._store = store
        self._workers = list(workers)
        self._interval = interval
        self._timeout = timeout
        self._on_silent = on_silent
        self._stopped = stopped
        self._thread = threading.Thread(target=self._run, name="orca-heartbeats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        now = time.monotonic()
        seen = {w.rank: (-1, now) for w in self._workers}  # rank -> (counter, when it last moved)
        while not self._stopped():
            for w in self._workers:
                try:
                    count = int(self._store.add(beat_key(w.rank), 0))
                except Exception as exc:  # the store's host is gone: the listeners report the loss
                    log.debug("heartbeat monitor stopped: %s", exc)
                    return
                now = time.monotonic()
                last, since = seen[w.rank]
                if count != last:
                    seen[w.rank] = (count, now)
                elif now - since >= self._timeout and not self._stopped():
                    self._on_silent(w, now - since)
                    return
            time.sleep(self._interval)
