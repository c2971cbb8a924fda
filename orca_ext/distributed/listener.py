"""The driver's listeners: one thread per worker receives what that worker sends up, and one
thread waits on the processes this driver started.

A listener blocks on a receive from its own worker only, so it learns at once when the worker's
connection closes (gloo fails a pending receive when the peer goes away). Results (a
driver_sampling.WorkerResult) and logits resolve the oldest in-flight batch; statistics go to
the StatsBoard; an error report, a lost connection or a process exit is handed to `on_failure`.
"""
from __future__ import annotations

import multiprocessing.connection
import threading
from typing import Callable, Sequence

import torch

from ..sampling import SampleResult
from .channel import ControlChannel
from .driver_sampling import WorkerResult
from .failures import Failure
from .inflight import InFlight
from .messages import HEADER_LEN, KIND_BYE, KIND_ERROR, KIND_LOGITS, KIND_RESULT, KIND_STATS, WorkerTimes, \
    unpack_row_errors
from .stats import StatsBoard
from .worker_info import WorkerInfo


class Listeners:
    def __init__(self, channel: ControlChannel, workers: Sequence[WorkerInfo], inflight: InFlight,
                 stats: StatsBoard, on_failure: Callable[[Failure], None], stopping: Callable[[], bool]):
        self.channel = channel
        self.workers = workers
        self.inflight = inflight
        self.stats = stats
        self.on_failure = on_failure
        self.stopping = stopping
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for w in self.workers:
            t = threading.Thread(target=self._listen, args=(w,), name=f"orca-listen-{w.rank}", daemon=True)
            t.start()
            self.threads.append(t)
        if any(w.process is not None for w in self.workers):
            threading.Thread(target=self._watch_processes, name="orca-watch-workers", daemon=True).start()

    def join(self, timeout_of: Callable[[], float]) -> None:
        """Wait for every listener to end (each gets `timeout_of()` seconds)."""
        for t in self.threads:
            t.join(timeout_of())

    def _listen(self, w: WorkerInfo) -> None:
        hdr = torch.empty(HEADER_LEN, dtype=torch.int64)
        recv = self.channel.recv
        try:
            while True:
                recv(w.rank, hdr)
                kind = int(hdr[0])
                if kind == KIND_RESULT:
                    index, b, n_err, r, v = (int(x) for x in hdr[1:6])
                    tokens = recv(w.rank, torch.empty(b, dtype=torch.int64)).tolist()
                    data = recv(w.rank, torch.empty(n_err, dtype=torch.uint8)) if n_err else None
                    logits = recv(w.rank, torch.empty(r, v, dtype=torch.float32)) if r else torch.empty(0, v)
                    result = SampleResult([t if t >= 0 else None for t in tokens], unpack_row_errors(data, tokens))
                    self._answer(w, index, WorkerResult(result, logits))
                elif kind == KIND_LOGITS:
                    index, b, v = int(hdr[1]), int(hdr[2]), int(hdr[3])
                    self._answer(w, index, recv(w.rank, torch.empty(b, v, dtype=torch.float32)))
                elif kind == KIND_STATS:
                    values = recv(w.rank, torch.empty(int(hdr[1]), dtype=torch.float64))
                    self.stats.put(w.rank, WorkerTimes.from_tensor(values))
                elif kind == KIND_ERROR:
                    text = bytes(recv(w.rank, torch.empty(int(hdr[2]), dtype=torch.uint8)).tolist())
                    self.on_failure(Failure(w.rank, "raised", text.decode("utf-8", "replace"),
                                            bool(hdr[3]), int(hdr[1])))
                    return  # the worker exits after reporting
                elif kind == KIND_BYE:
                    return
                else:
                    raise RuntimeError(f"unknown message kind {kind} from {w.name()}")
        except Exception as exc:
            if not self.stopping():
                self.on_failure(Failure(w.rank, "lost", str(exc).split("\n")[0]))

    def _answer(self, w: WorkerInfo, index: int, result) -> None:
        expected, future = self.inflight.pop_oldest()
        if expected != index:  # cannot happen while every worker follows messages.py
            if future is not None:
                self.inflight.put_back(expected, future)  # failed with the others
            self.on_failure(Failure(w.rank, "raised", f"returned iteration {index} but {expected} was "
                                                      f"expected (control-plane protocol error)", False, index))
            return
        future.resolve(result)

    def _watch_processes(self) -> None:
        alive = {w.process.sentinel: w for w in self.workers if w.process is not None}
        while alive and not self.stopping():
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=1.0):
                w = alive.pop(sentinel)
                if not self.stopping():
                    self.on_failure(Failure(w.rank, "lost", "the process exited"))
