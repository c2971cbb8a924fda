"""Bringing the worker group up: the store, the worker processes, the control group, and the
handshake keys each worker sets on the store as it gets ready.

    config         the driver's JSON for every worker (worker.py reads it)
    ready/<w>      worker w loaded its shard: pid, host, device, KV bytes per slot, max slots
    n_slots        the driver's pool size, once the server has planned it
    allocated/<w>  worker w allocated its pools
    error/<w>      worker w failed to start (its exception)

On one node the driver hosts a TCPStore and spawns the workers (torch.multiprocessing); under
torchrun the workers are the launch's other ranks and the store is torchrun's. Every wait fails
fast, naming the worker, when a worker reports an error or its process dies, and gives up after
the start-up timeout.

The control group's constructor blocks until every worker has published its address on the
store; it runs in a helper thread on a store client of its own (groups.store_client), so that
the main thread's checks never wait behind it: a worker that died before publishing is named
within a fraction of a second. Giving up closes the store this driver hosts (StartupWatch.close),
which ends that constructor's wait too, so no thread is left blocked in it.
"""
from __future__ import annotations

import datetime
import json
import threading
import time
from typing import Callable, Optional, Sequence, TypeVar

import torch

from .groups import NAMESPACE, control_group, store_client
from .torchrun import TorchrunEnv, torchrun_store
from .worker_info import WorkerInfo

T = TypeVar("T")


def open_store(torchrun: Optional[TorchrunEnv], workers: Sequence[WorkerInfo], device_type: str,
               timeout_s: float):
    """The store the group meets on, after checking the launch can hold `workers`."""
    n = len(workers)
    tp, pp = workers[0].tp, workers[0].pp
    timeout = datetime.timedelta(seconds=timeout_s)
    if torchrun is not None:
        if torchrun.rank != 0:
            raise RuntimeError(f"the driver must be torchrun rank 0, this process is rank {torchrun.rank}")
        if torchrun.world_size != n + 1:
            raise ValueError(f"torchrun started {torchrun.world_size} processes, but tensor_parallel_size="
                             f"{tp} x pipeline_parallel_size={pp} needs {n + 1} "
                             f"({n} workers + this driver as rank 0)")
        return torchrun_store(timeout)
    if device_type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {n} GPUs (one per "
                         f"worker) but {torch.cuda.device_count()} are visible")
    return torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)


def spawn_workers(workers: Sequence[WorkerInfo], store_port: int) -> None:
    """Start one process per worker on this node (spawn start method); each watches a pipe whose
    write end only this driver holds, so it exits when the driver is gone."""
    import torch.multiprocessing as mp

    from .worker import WorkerLaunch, spawn_main

    ctx = mp.get_context("spawn")
    for w in workers:
        reader, writer = ctx.Pipe(duplex=False)
        launch = WorkerLaunch(w.rank, len(workers), w.rank, "127.0.0.1", store_port, reader)
        proc = ctx.Process(target=spawn_main, args=(launch,), name=f"orca-worker-{w.rank}", daemon=True)
        proc.start()
        reader.close()
        w.process, w.pipe, w.pid = proc, writer, proc.pid


class StartupWatch:
    """Waits on the workers' handshake keys, failing fast when one of them cannot get there."""

    def __init__(self, store, workers: Sequence[WorkerInfo], timeout_s: float):
        self.store = store
        self.workers = workers
        self.timeout_s = timeout_s
        self._helpers: list[threading.Thread] = []

    def close(self, join_s: float = 2.0) -> None:
        """Start-up failed: drop this driver's hold on the store (one it hosts closes, so a helper
        still waiting on it fails instead of waiting forever) and let the helpers end."""
        self.store = None
        deadline = time.monotonic() + join_s
        for thread in self._helpers:
            thread.join(max(0.0, deadline - time.monotonic()))

    def problem(self, what: str) -> Optional[str]:
        """Why some worker will never finish `what` (it reported an error, or its process ended).
        A reported error is the more telling (the process exits right after reporting it)."""
        for w in self.workers:
            key = NAMESPACE + f"error/{w.rank}"
            if self.store.check([key]):
                return f"{w.name()} failed while {what}: {self.store.get(key).decode(errors='replace')}"
        for w in self.workers:
            if w.process is not None and not w.process.is_alive():
                return f"{w.name()} {w.exit_status()} while {what}"
        return None

    def while_alive(self, what: str, fn: Callable[[], T]) -> T:
        """Run fn() (which blocks until every worker takes part) in a helper thread, failing fast
        if a worker dies or reports an error meanwhile."""
        box: dict = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"orca-{what}", daemon=True)
        self._helpers.append(thread)
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(0.05)
            problem = self.problem(what)
            if problem:
                raise RuntimeError(problem)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers were not all {what} within {self.timeout_s:.0f} s")
        if "error" in box:
            raise RuntimeError(f"{what} to the workers failed: {box['error']}") from box["error"]
        return box["value"]

    def await_keys(self, key: str, what: str) -> None:
        """Wait until every worker has set `key/<rank>` on the store."""
        keys = [NAMESPACE + f"{key}/{w.rank}" for w in self.workers]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            problem = self.problem(what)
            if problem:
                raise RuntimeError(problem)
            if time.monotonic() > deadline:
                missing = [w.rank for w, k in zip(self.workers, keys) if not self.store.check([k])]
                raise TimeoutError(f"workers {missing} did not finish {what} within {self.timeout_s:.0f} s")
            time.sleep(0.05)


def start_workers(cfg: dict, workers: Sequence[WorkerInfo], watch: StartupWatch, spawn: bool):
    """Publish the config, spawn the workers (when this driver starts them), join the control
    group with them and wait until each has loaded its shard; fills in each WorkerInfo from its
    ready key. Returns the control group."""
    watch.store.set(NAMESPACE + "config", json.dumps(cfg))
    if spawn:
        spawn_workers(workers, watch.store.port)
    own = store_client(watch.store, watch.timeout_s)
    ctl = watch.while_alive("connecting", lambda: control_group(own, 0, len(workers) + 1, loopback=spawn))
    watch.await_keys("ready", "loading the model")
    for w in workers:
        info = json.loads(watch.store.get(NAMESPACE + f"ready/{w.rank}"))
        w.pid, w.host, w.device = info["pid"], info["host"], info["device"]
        w.bytes_per_slot, w.max_slots = int(info["bytes_per_slot"]), int(info["max_slots"])
    return ctl


def allocate_pools(watch: StartupWatch, n_slots: int) -> None:
    """Tell every worker the pool size and wait until all have allocated their pools."""
    watch.store.set(NAMESPACE + "n_slots", str(n_slots))
    watch.await_keys("allocated", f"allocating {n_slots} KV slots")
