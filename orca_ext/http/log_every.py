"""Log lines that a client cannot multiply.

A formatted and flushed log line costs the event loop about as much as answering a small
request, so a server that logs every refusal lets a client looping on bad requests double what
each one costs, and fill the disk besides. Every refusal, rejection or hang-up a client can
repeat at will is logged through a `LogEvery`: at most one line per `every` seconds for one
kind of event, at its level, carrying the count of the ones left out; the others go to DEBUG,
which costs nothing while DEBUG is off.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

LOG_EVERY = 10.0  # seconds between two lines about one kind of event at its own level


class LogEvery:
    """One kind of client-triggered event: `log(msg, *args)` writes at `level` when the last
    such line is at least `every` seconds old (with the count left out since), else at DEBUG."""

    def __init__(self, logger: logging.Logger, level: int, every: float = LOG_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.level = level
        self.every = every
        self.clock = clock
        self.next_at = -float("inf")
        self.left_out = 0

    def log(self, msg: str, *args: Any) -> None:
        now = self.clock()
        if now < self.next_at:
            self.left_out += 1
            self.logger.debug(msg, *args)
            return
        self.logger.log(self.level, msg + " (%d more like it since the last such line)", *args, self.left_out)
        self.next_at = now + self.every
        self.left_out = 0


class RequestLogs:
    """The per-request lines of the HTTP layer that a client can repeat at will, each kind on its
    own `LogEvery` (logger orca_ext.http.requests, INFO): requests rejected (4xx, 429 included),
    requests whose client hung up while sending the body, and requests aborted because their
    client went away."""

    def __init__(self, every: float = LOG_EVERY) -> None:
        log = logging.getLogger("orca_ext.http.requests")
        self.rejected = LogEvery(log, logging.INFO, every)
        self.hung_up = LogEvery(log, logging.INFO, every)
        self.aborted = LogEvery(log, logging.INFO, every)
