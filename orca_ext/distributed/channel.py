"""The driver's end of the control group: posting a message to every worker, receiving from one.

Sends are asynchronous (a SendQueue keeps them and their tensors alive until the worker takes
them), so the driver never waits for a busy worker. A message's header and payload go out back
to back: `lock` (reentrant) serialises whole messages, and a caller that must keep some other
bookkeeping in step with the order of messages (InFlight) holds it across both.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from .groups import SendQueue
from .messages import TAG_DOWN, TAG_UP


class ControlChannel:
    def __init__(self, ctl, worker_ranks: Sequence[int]):
        self.ctl = ctl
        self.lock = threading.RLock()
        self._ranks = list(worker_ranks)
        self._sends = SendQueue("orca-driver-sends")

    def post_all(self, *tensors: torch.Tensor) -> None:
        """Send one message (header, payload...) to every worker (control rank = worker rank + 1)."""
        with self.lock:
            for w in self._ranks:
                for t in tensors:
                    self._sends.put(self.ctl.send([t], w + 1, TAG_DOWN), t)

    def recv(self, worker_rank: int, t: torch.Tensor) -> torch.Tensor:
        """Fill `t` with the next tensor worker `worker_rank` sends up (blocks)."""
        self.ctl.recv([t], worker_rank + 1, TAG_UP).wait()
        return t

    def close(self, timeout: float) -> None:
        self._sends.close(timeout)
