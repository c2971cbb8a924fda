"""DistributedExecutor: the driver's side of tensor x pipeline parallel execution.

The driver process keeps the request pool, the scheduler, the slab allocator (so slot numbers
are the same in every worker's pools), tokenizer and detokenizer, Server and HTTP. The tp x pp
workers own the weights and KV pools (worker.py). Per iteration the driver sends the batch's
inputs to every worker on the control group and returns a future at once; the sampling worker
(last stage, tensor rank 0) sends the token ids back, and a listener thread resolves the future.
Up to n_workers = pp batches are in flight, one per stage.

Faults. One listener thread per worker blocks on a receive from that worker only, so it learns
at once when the worker's connection closes (gloo reports a closed peer to a pending receive);
a watcher thread also waits on the worker processes it started. A worker that raises reports
the exception and exits. Any failure is fatal for the whole group (its peers' collectives could
never complete): after a short grace period, in which the other workers' secondary errors
arrive, the root cause is chosen (an exception that is not a communication error, else a worker
that died, else a communication error), every in-flight future fails with an error naming that
worker, the remaining worker processes are terminated, and `error` stays set. A batch whose
result does not arrive within `worker_timeout` seconds fails the group too, so nothing waits
forever.
"""
from __future__ import annotations

import collections
import concurrent.futures
import datetime
import json
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..executor import BatchFuture
from ..models.sharding import check_shardable
from ..sampling import SampleResult
from .groups import NAMESPACE, SendQueue, TorchrunEnv, control_group, torchrun_store
from .messages import (HEADER_LEN, KIND_BYE, KIND_ERROR, KIND_RESULT, KIND_STATS, OP_STATS, OP_STOP,
                       TAG_DOWN, TAG_UP, SamplingRow, WorkerTimes, header, pack_forward, spec_to_dict,
                       unpack_row_errors)

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 0.5      # collect the other workers' errors before naming the root cause
STOP_TIMEOUT_S = 15.0      # how long shutdown() waits for workers to finish before killing them
DEFAULT_WORKER_TIMEOUT_S = 600.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0


class WorkerFailedError(RuntimeError):
    """A worker process died or raised; the message names it."""


@dataclass
class WorkerInfo:
    rank: int
    stage: int
    tp_rank: int
    tp: int
    pp: int
    process: object = None            # multiprocessing.Process when this driver started it
    pipe: object = None               # the driver's end of the worker's parent-watch pipe
    pid: Optional[int] = None
    host: Optional[str] = None
    device: Optional[str] = None
    bytes_per_slot: int = 0
    max_slots: int = 0

    def name(self) -> str:
        where = f", pid {self.pid}" if self.pid else ""
        if self.host and self.process is None:
            where += f" on {self.host}"
        return (f"worker {self.rank} (pipeline stage {self.stage} of {self.pp}, tensor rank {self.tp_rank} "
                f"of {self.tp}{where})")

    def exit_status(self) -> Optional[str]:
        p = self.process
        if p is None:
            return None
        p.join(2.0)
        code = p.exitcode
        if code is None:
            return None
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"


@dataclass
class _Failure:
    worker: Optional[int]
    kind: str            # "raised" | "lost" | "timeout"
    detail: str
    communication: bool = False
    batch: int = -1


def launched_by_torchrun() -> bool:
    """This process is a rank of a torchrun launch (so the workers are torchrun's other ranks)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and TorchrunEnv.present()


class DistributedExecutor:
    """tp x pp worker processes (torch.multiprocessing spawn on this node, or the ranks of a
    torchrun launch whose rank 0 is this process)."""

    def __init__(self, model_path: str, spec, *, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, device: str = "cpu", dtype: str = "float32",
                 kv_cache_memory: Optional[int] = None, threads_per_worker: Optional[int] = None,
                 worker_timeout: float = DEFAULT_WORKER_TIMEOUT_S,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S, sync_timing: bool = False,
                 batch_invariant: bool = False):
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        check_shardable(spec, tp, pp)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' for parallel workers (each worker uses "
                             f"its own GPU, cuda:local_rank), got {device!r}")
        self.spec = spec
        self.tp, self.pp = tp, pp
        self.num_workers = tp * pp
        self.n_workers = pp                      # batches in flight: one per pipeline stage
        self.device_type = device
        self.dtype = dtype
        self.worker_timeout = float(worker_timeout)
        self.startup_timeout = float(startup_timeout)
        self.workers = [WorkerInfo(w, w // tp, w % tp, tp, pp) for w in range(self.num_workers)]
        self.torchrun = launched_by_torchrun()
        self.n_slots = 0
        self._lock = threading.Lock()
        self._send_lock = threading.RLock()      # a header and its payload go out back to back
        self._pending: collections.deque = collections.deque()   # (batch index, BatchFuture)
        self._seq_ids: dict = {}                 # Request -> seq id (identity-hashed)
        self._next_seq = 0
        self._free: list[int] = []               # seq ids whose generators the sampler may drop
        self._failures: list[_Failure] = []
        self._finalizing = False
        self._error: Optional[str] = None
        self._stopping = False
        self._closed = False
        self._stats: dict[int, WorkerTimes] = {}
        self._stats_cond = threading.Condition(self._lock)
        self._listeners: list[threading.Thread] = []
        self._ctl = None
        self._sends: Optional[SendQueue] = None
        cfg = {
            "model_path": str(model_path), "spec": spec_to_dict(spec), "dtype": str(dtype).replace("torch.", ""),
            "device": device, "tp": tp, "pp": pp, "kv_cache_memory": kv_cache_memory,
            # torchrun sets OMP_NUM_THREADS for its ranks; spawned workers share this host's cores.
            "threads": threads_per_worker or (None if self.torchrun else self._default_threads()),
            "loopback": not self.torchrun,
            "workers_per_host": self.num_workers, "data_timeout_s": self.worker_timeout,
            "sync_timing": sync_timing, "batch_invariant": bool(batch_invariant),
            "log_level": logging.getLevelName(logging.getLogger("orca_ext").getEffectiveLevel()),
        }
        try:
            self._start(cfg)
        except BaseException:
            self._stopping = True
            self._terminate_processes()
            raise

    def _default_threads(self) -> int:
        # Workers on this host share its cores (the driver needs little CPU of its own).
        return max(1, (os.cpu_count() or 1) // self.num_workers)

    # -- start-up ----------------------------------------------------------------------------
    def _start(self, cfg: dict) -> None:
        timeout = datetime.timedelta(seconds=self.startup_timeout)
        if self.torchrun:
            env = TorchrunEnv()
            if env.rank != 0:
                raise RuntimeError(f"the driver must be torchrun rank 0, this process is rank {env.rank}")
            if env.world_size != self.num_workers + 1:
                raise ValueError(f"torchrun started {env.world_size} processes, but tensor_parallel_size="
                                 f"{self.tp} x pipeline_parallel_size={self.pp} needs {self.num_workers + 1} "
                                 f"({self.num_workers} workers + this driver as rank 0)")
            self._store = torchrun_store(timeout)
        else:
            if self.device_type == "cuda" and torch.cuda.device_count() < self.num_workers:
                raise ValueError(f"tensor_parallel_size={self.tp} x pipeline_parallel_size={self.pp} needs "
                                 f"{self.num_workers} GPUs (one per worker) but {torch.cuda.device_count()} "
                                 f"are visible")
            self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                                     timeout=timeout)
        self._store.set(NAMESPACE + "config", json.dumps(cfg))
        if not self.torchrun:
            self._spawn()
        t0 = time.perf_counter()
        self._ctl = self._while_alive("connecting", lambda: control_group(
            self._store, 0, self.num_workers + 1, loopback=not self.torchrun))
        self._await("ready", "loading the model")
        for w in self.workers:
            info = json.loads(self._store.get(NAMESPACE + f"ready/{w.rank}"))
            w.pid, w.host, w.device = info["pid"], info["host"], info["device"]
            w.bytes_per_slot, w.max_slots = int(info["bytes_per_slot"]), int(info["max_slots"])
        log.info("%d workers (tp=%d x pp=%d) ready in %.1fs", self.num_workers, self.tp, self.pp,
                 time.perf_counter() - t0)

    def _spawn(self) -> None:
        import torch.multiprocessing as mp

        from .worker import WorkerLaunch, spawn_main

        ctx = mp.get_context("spawn")
        for w in self.workers:
            reader, writer = ctx.Pipe(duplex=False)
            launch = WorkerLaunch(w.rank, self.num_workers, w.rank, "127.0.0.1", self._store.port, reader)
            proc = ctx.Process(target=spawn_main, args=(launch,), name=f"orca-worker-{w.rank}", daemon=True)
            proc.start()
            reader.close()
            w.process, w.pipe, w.pid = proc, writer, proc.pid

    def _startup_problem(self, what: str) -> Optional[str]:
        for w in self.workers:
            key = NAMESPACE + f"error/{w.rank}"
            if self._store.check([key]):
                return f"{w.name()} failed while {what}: {self._store.get(key).decode(errors='replace')}"
            if w.process is not None and not w.process.is_alive():
                return f"{w.name()} {w.exit_status()} while {what}"
        return None

    def _while_alive(self, what: str, fn):
        """Run fn() (which blocks until every worker takes part) in a helper thread, failing fast
        if a worker dies or reports an error meanwhile."""
        box: dict = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"orca-{what}", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while thread.is_alive():
            thread.join(0.05)
            problem = self._startup_problem(what)
            if problem:
                raise RuntimeError(problem)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers were not all {what} within {self.startup_timeout:.0f} s")
        if "error" in box:
            raise RuntimeError(f"{what} to the workers failed: {box['error']}") from box["error"]
        return box["value"]

    def _await(self, key: str, what: str) -> None:
        keys = [NAMESPACE + f"{key}/{w.rank}" for w in self.workers]
        deadline = time.monotonic() + self.startup_timeout
        while not self._store.check(keys):
            problem = self._startup_problem(what)
            if problem:
                raise RuntimeError(problem)
            if time.monotonic() > deadline:
                missing = [w.rank for w, k in zip(self.workers, keys) if not self._store.check([k])]
                raise TimeoutError(f"workers {missing} did not finish {what} within {self.startup_timeout:.0f} s")
            time.sleep(0.05)

    @property
    def max_slots(self) -> int:
        """KV slots every worker can hold within its budget (the smallest)."""
        return min(w.max_slots for w in self.workers)

    def kv_bytes_per_slot(self) -> int:
        """Bytes one KV slot takes over all workers together."""
        return sum(w.bytes_per_slot for w in self.workers)

    def allocate_kv_cache(self, n_slots: int) -> None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if self.n_slots:
            raise RuntimeError("the workers' KV pools are already allocated")
        self._store.set(NAMESPACE + "n_slots", str(n_slots))
        try:
            self._await("allocated", f"allocating {n_slots} KV slots")
        except BaseException:
            self._stopping = True
            self._terminate_processes()
            raise
        self.n_slots = n_slots
        self._sends = SendQueue("orca-driver-sends")
        for w in self.workers:
            t = threading.Thread(target=self._listen, args=(w,), name=f"orca-listen-{w.rank}", daemon=True)
            t.start()
            self._listeners.append(t)
        if any(w.process is not None for w in self.workers):
            threading.Thread(target=self._watch_processes, name="orca-watch-workers", daemon=True).start()

    # -- running ----------------------------------------------------------------------------------
    @property
    def error(self) -> Optional[str]:
        return self._error

    def execute(self, batch, want_logits: bool = False) -> BatchFuture:
        future = BatchFuture()
        problem = self._check_inputs(batch.inputs)
        if problem is not None:  # one bad batch fails alone, as in a single process
            future.resolve(ValueError(problem))
            return future
        rows = [self._sampling_row(req) for req in batch.requests]
        # Results come back in the order batches were posted: pending and posting stay in step.
        with self._send_lock:
            with self._lock:
                free, self._free = self._free, []
                if self._error is not None:
                    future.resolve(WorkerFailedError(self._error))
                    return future
                self._pending.append((batch.index, future))
            hdr, payload = pack_forward(batch.index, batch.inputs, rows, free, want_logits)
            try:
                self._post_all(hdr, payload)
                failed = None
            except Exception as exc:
                failed = exc
        if failed is not None:
            self._on_failure(_Failure(None, "lost", f"sending iteration {batch.index} failed: {failed}"))
        return future

    def wait(self, future: BatchFuture):
        try:
            return future.result(timeout=self.worker_timeout)
        except concurrent.futures.TimeoutError:
            self._on_failure(_Failure(None, "timeout", f"no result from the workers within "
                                                       f"{self.worker_timeout:.0f} s"))
            try:
                return future.result(timeout=5.0)
            except Exception as exc:
                return exc
        except Exception as exc:
            return exc

    def request_finished(self, req) -> None:
        with self._lock:
            seq = self._seq_ids.pop(req, None)
            if seq is not None and req.params.seed is not None:
                self._free.append(seq)

    def _sampling_row(self, req) -> SamplingRow:
        with self._lock:
            seq = self._seq_ids.get(req)
            if seq is None:
                seq = self._seq_ids[req] = self._next_seq
                self._next_seq += 1
        p = req.params
        return SamplingRow(seq, p.seed, p.temperature, p.top_k, p.top_p, req.emits_token)

    def _check_inputs(self, inputs) -> Optional[str]:
        """What the workers' forward would reject, caught here so it fails only this batch."""
        max_pos = self.spec.max_position_embeddings
        for ids, start, slab in inputs:
            end = start + len(ids)
            if slab + end > self.n_slots:
                return f"batch writes KV slot {slab + end - 1} but the cache has n_slots={self.n_slots}"
            if end > max_pos:
                return f"batch has position {end - 1} but the model supports max_position_embeddings={max_pos}"
            if ids and (max(ids) >= self.spec.vocab_size or min(ids) < 0):
                return f"batch has token id {max(ids)} outside the vocabulary [0, {self.spec.vocab_size})"
        return None

    def _post_all(self, *tensors: torch.Tensor) -> None:
        with self._send_lock:  # reentrant: execute() holds it too
            for w in self.workers:
                for t in tensors:
                    self._sends.put(self._ctl.send([t], w.rank + 1, TAG_DOWN), t)

    # -- listening ----------------------------------------------------------------------------------
    def _recv(self, w: WorkerInfo, t: torch.Tensor) -> torch.Tensor:
        self._ctl.recv([t], w.rank + 1, TAG_UP).wait()
        return t

    def _listen(self, w: WorkerInfo) -> None:
        hdr = torch.empty(HEADER_LEN, dtype=torch.int64)
        try:
            while True:
                self._recv(w, hdr)
                kind = int(hdr[0])
                if kind == KIND_RESULT:
                    self._on_result(w, hdr)
                elif kind == KIND_STATS:
                    values = self._recv(w, torch.empty(int(hdr[1]), dtype=torch.float64))
                    with self._lock:
                        self._stats[w.rank] = WorkerTimes.from_tensor(values)
                        self._stats_cond.notify_all()
                elif kind == KIND_ERROR:
                    text = bytes(self._recv(w, torch.empty(int(hdr[2]), dtype=torch.uint8)).tolist())
                    self._on_failure(_Failure(w.rank, "raised", text.decode("utf-8", "replace"),
                                              bool(hdr[3]), int(hdr[1])))
                    return  # the worker exits after reporting
                elif kind == KIND_BYE:
                    return
                else:
                    raise RuntimeError(f"unknown message kind {kind} from {w.name()}")
        except Exception as exc:
            if not self._stopping:
                self._on_failure(_Failure(w.rank, "lost", str(exc).split("\n")[0]))

    def _on_result(self, w: WorkerInfo, hdr: torch.Tensor) -> None:
        index, b, n_err = int(hdr[1]), int(hdr[2]), int(hdr[4])
        tokens = self._recv(w, torch.empty(b, dtype=torch.int64)).tolist()
        errors = unpack_row_errors(self._recv(w, torch.empty(n_err, dtype=torch.uint8)) if n_err else None, tokens)
        logits = self._recv(w, torch.empty(b, self.spec.vocab_size, dtype=torch.float32)) if int(hdr[3]) else None
        with self._lock:
            expected, future = self._pending.popleft() if self._pending else (None, None)
        if expected != index:  # cannot happen while every worker follows messages.py
            if future is not None:
                with self._lock:
                    self._pending.appendleft((expected, future))  # failed with the others below
            self._on_failure(_Failure(w.rank, "raised", f"returned iteration {index} but {expected} was "
                                                        f"expected (control-plane protocol error)", False, index))
            return
        future.logits = logits
        future.resolve(SampleResult([t if t >= 0 else None for t in tokens], errors))

    def _watch_processes(self) -> None:
        alive = {w.process.sentinel: w for w in self.workers if w.process is not None}
        while alive and not self._stopping:
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=1.0):
                w = alive.pop(sentinel)
                if not self._stopping:
                    self._on_failure(_Failure(w.rank, "lost", "the process exited"))

    # -- failures ------------------------------------------------------------------------------------
    def _on_failure(self, failure: _Failure) -> None:
        with self._lock:
            if self._error is not None or (self._stopping and failure.kind != "raised"):
                return
            if any(f.worker == failure.worker and f.worker is not None for f in self._failures):
                return  # one account per worker (its error report, then its exit)
            self._failures.append(failure)
            if self._finalizing:
                return
            self._finalizing = True
        time.sleep(FAILURE_GRACE_S)
        with self._lock:
            failures = list(self._failures)
        message = self._describe(failures)
        log.error("distributed execution failed: %s", message)
        with self._lock:
            self._error = message
            pending = list(self._pending)
            self._pending.clear()
            self._stats_cond.notify_all()
        for _, future in pending:
            future.resolve(WorkerFailedError(message))
        self._terminate_processes()

    def _describe(self, failures: list[_Failure]) -> str:
        def rank(f: _Failure) -> int:
            if f.kind == "raised" and not f.communication:
                return 0
            return {"lost": 1, "raised": 2}.get(f.kind, 3)

        first = min(failures, key=rank)  # min is stable: the earliest of the most telling kind
        if first.kind == "timeout":
            text = first.detail
        else:
            w = self.workers[first.worker] if first.worker is not None else None
            name = w.name() if w is not None else "a worker"
            if first.kind == "raised":
                where = f" in iteration {first.batch}" if first.batch >= 0 else ""
                text = f"{name} failed{where}: {first.detail}"
            else:
                status = w.exit_status() if w is not None else None
                text = f"{name} {status}" if status else f"{name} lost its connection ({first.detail})"
        others = len(failures) - 1
        if others:
            text += f" ({others} other worker(s) failed after it)"
        return text

    def _terminate_processes(self) -> None:
        procs = [w.process for w in self.workers if w.process is not None and w.process.is_alive()]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + 3.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2.0)

    # -- statistics -------------------------------------------------------------------------------------
    def worker_stats(self, reset: bool = False, timeout: float = 60.0) -> list[WorkerTimes]:
        """Each worker's time split (WorkerTimes) since start or the last reset, in worker order.
        Answered after every batch sent before it."""
        with self._lock:
            self._stats.clear()
        self._post_all(header(OP_STATS, int(reset)))
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._stats) < self.num_workers:
                if self._error is not None:
                    raise WorkerFailedError(self._error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"worker statistics did not arrive within {timeout} s")
                self._stats_cond.wait(left)
            return [self._stats[w.rank] for w in self.workers]

    def describe_workers(self) -> list[dict]:
        return [{"rank": w.rank, "stage": w.stage, "tp_rank": w.tp_rank, "pid": w.pid, "host": w.host,
                 "device": w.device, "alive": (w.process.is_alive() if w.process is not None else None)}
                for w in self.workers]

    # -- shutdown ---------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker: they finish the batches already sent, then exit; stragglers are
        terminated after STOP_TIMEOUT_S. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._stopping = True
        if self._error is None and self._ctl is not None and self._sends is not None:
            try:
                self._post_all(header(OP_STOP))
            except Exception as exc:
                log.debug("could not send STOP: %s", exc)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for t in self._listeners:
            t.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.process is not None:
                w.process.join(max(0.0, deadline - time.monotonic()))
        self._terminate_processes()
        for w in self.workers:
            if w.pipe is not None:
                w.pipe.close()
                w.pipe = None
        if self._sends is not None:
            self._sends.close(1.0)
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        for _, future in pending:
            future.resolve(WorkerFailedError("the executor was shut down"))
