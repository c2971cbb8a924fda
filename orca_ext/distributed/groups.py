"""Process groups and the communication helpers shared by the driver and the workers.

Two kinds of groups, both on one torch.distributed store (a TCPStore the driver hosts, or the
one torchrun's agent hosts):
  - the control group: gloo, the driver (rank 0) and every worker (rank w + 1), built as a
    standalone ProcessGroupGloo so the driver process never touches torch.distributed's global
    default group (a user may run several servers, or their own torch.distributed job);
  - the data groups, workers only: the default group of each worker process (gloo on CPU, NCCL
    on CUDA) for stage-to-stage activations, and one subgroup per pipeline stage for its
    tensor-parallel collectives.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import socket
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from .messages import WorkerTimes

log = logging.getLogger(__name__)

NAMESPACE = "orca_ext/"
# Workers wait for the next iteration on the control group for as long as the server idles.
IDLE_TIMEOUT = datetime.timedelta(days=3650)


def loopback_interface() -> Optional[str]:
    """Name of the loopback network interface (Linux: 'lo'), for GLOO_SOCKET_IFNAME."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def control_group(store, rank: int, size: int, loopback: bool) -> dist.ProcessGroupGloo:
    """The driver + workers gloo group. `loopback` binds it to 127.0.0.1 (a one-node launch);
    otherwise gloo picks the interface ($GLOO_SOCKET_IFNAME, else the host name's address)."""
    prefixed = dist.PrefixStore(NAMESPACE + "ctl/", store)
    if loopback:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = IDLE_TIMEOUT
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(prefixed, rank, size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, size, IDLE_TIMEOUT)


def store_client(store, timeout_s: float) -> dist.TCPStore:
    """A new client of the TCPStore that `store` hosts or is a client of. One client serves one
    call at a time: a thread blocked in a long wait on it (a process group's constructor waiting
    for its peers' addresses) would hold up every other thread's call, so each thread that must
    not wait behind another gets a client of its own."""
    return dist.TCPStore(store.host, store.port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def is_communication_error(exc: BaseException) -> bool:
    """True for errors that mean "a peer went away", as opposed to a failure of this worker."""
    if isinstance(exc, getattr(dist, "DistError", ())) and not isinstance(exc, getattr(dist, "DistStoreError", ())):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                   "NCCL error", "Timed out waiting"))


class SendQueue:
    """Keeps asynchronous sends (and their tensors) alive until they complete.

    A gloo send only completes once the receiver has posted its recv, and gloo reports
    completion only through wait(), so a background thread waits for them in order; the sender
    itself never blocks on a busy receiver. NCCL work is polled with is_completed() instead
    (its wait() would only make the calling thread's stream wait).
    """

    def __init__(self, name: str, threaded: bool = True):
        self._threaded = threaded
        self._pending: list = []
        self._queue: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        if threaded:
            self._thread = threading.Thread(target=self._drain, name=name, daemon=True)
            self._thread.start()

    def put(self, work, tensor: torch.Tensor) -> None:
        if self._threaded:
            self._queue.put((work, tensor))
        else:
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
            self._pending.append((work, tensor))

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                item[0].wait()
            except Exception as exc:  # the receiver is gone; whoever listens to it reports that
                log.debug("a send did not complete: %s", exc)

    def close(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the pending sends; True when all completed."""
        if self._threaded:
            self._queue.put(None)
            self._thread.join(timeout)
            return not self._thread.is_alive()
        deadline = time.monotonic() + timeout
        while any(not w.is_completed() for w, _ in self._pending) and time.monotonic() < deadline:
            time.sleep(0.01)
        return all(w.is_completed() for w, _ in self._pending)


class StageClock:
    """Adds the time spent in each part of a worker's loop to a WorkerTimes. On CUDA, kernels
    are asynchronous, so with `sync` each measured span ends with a device synchronize (only
    for profiling: it costs overlap)."""

    def __init__(self, device: torch.device, sync: bool):
        self.times = WorkerTimes()
        self.started = time.perf_counter()
        self._sync = sync and device.type == "cuda"
        self._device = device
        self._comm = 0.0  # collective time inside the current compute span

    def reset(self) -> None:
        self.times = WorkerTimes()
        self.started = time.perf_counter()

    def snapshot(self) -> WorkerTimes:
        self.times.wall = time.perf_counter() - self.started
        return self.times

    @contextlib.contextmanager
    def measure(self, field: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize(self._device)
            dt = time.perf_counter() - t0
            setattr(self.times, field, getattr(self.times, field) + dt)
            if field in ("all_reduce", "gather"):
                self._comm += dt

    @contextlib.contextmanager
    def compute(self):
        """A span of computation whose collectives are measured separately (and subtracted)."""
        self._comm = 0.0
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize(self._device)
            self.times.compute += time.perf_counter() - t0 - self._comm
            self._comm = 0.0


class TensorParallelComm:
    """The collectives of one pipeline stage's tensor-parallel group, as CausalLM calls them."""

    def __init__(self, group, ranks: list[int], tp_rank: int, vocab_size: int, vocab_padded: int,
                 clock: StageClock):
        self.group = group
        self.ranks = ranks            # data-group ranks of this stage's tensor ranks, in order
        self.size = len(ranks)
        self.rank = tp_rank           # this worker's tensor rank (rank 0 adds the residual, gathers)
        self.vocab_size = vocab_size
        self.vocab_padded = vocab_padded
        self.clock = clock

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the row-parallel partial products [T, H] over the group (in place)."""
        with self.clock.measure("all_reduce"):
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """[B, V/tp] float32 vocabulary slices -> [B, V] on tensor rank 0, None on the others.
        Slices are padded to one width with -inf (a padded column never wins an argmax and has
        zero probability) and the padding is cut off after the gather."""
        with self.clock.measure("gather"):
            pad = self.vocab_padded - logits.shape[1]
            if pad:
                logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
            logits = logits.contiguous()
            parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(logits, parts, dst=self.ranks[0], group=self.group)
            if parts is None:
                return None
            return torch.cat(parts, dim=1)[:, :self.vocab_size]
