"""DistributedExecutor: the driver's side of tensor x pipeline parallel execution, behind the
engine's Executor protocol (executor.py).

The driver process keeps the request pool, the scheduler, the slab allocator (so slot numbers
are the same in every worker's pools), tokenizer and detokenizer, Server and HTTP. The tp x pp
workers own the weights and KV pools (worker.py). Per iteration the driver posts the batch's
inputs to every worker on the control group and returns a future at once; the sampling worker
(last stage, tensor rank 0) sends the token ids back, with the logits rows of the requests that
need request-side state to be sampled (logprobs, logits controls, grammars), which the driver
samples itself (driver_sampling.py); a listener thread resolves the future.
Up to n_workers = pp batches are in flight, one per stage. Slab compaction posts the moves to
every worker the same way; each worker applies them between the batches posted before and after.

This class is the facade; each of its jobs lives in its own module:
    startup.py      store, worker processes (or torchrun's ranks), control group, handshake
    channel.py      posting a message to every worker, receiving from one
    inflight.py     the posted batches not yet answered, in order
    listener.py     one thread per worker receiving its answers; a watcher of the processes
    failures.py     the failure record and the root cause's message
    stats.py        the workers' time splits (benchmarks)
    driver_sampling.py  the rows sampled on the driver, merged into the workers' result

Faults. A row whose sampling parameters cannot be packed fails alone, and a batch that cannot be
packed fails alone, before anything is sent (as in one process). Any failure of the group (a
worker raised, its connection closed, its process ended, it sent no heartbeat for
`heartbeat_timeout` seconds (heartbeat.py), a send failed, or a batch's result did not arrive
within `wait_timeout` seconds) is fatal for the whole group: after a short grace period the root
cause is named (failures.py), every in-flight future fails with an error naming that worker, the
remaining worker processes are terminated, and `error` stays set.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Optional, Sequence

import torch

from .. import modes
from ..config import DEFAULT_WORKER_TIMEOUT_S
from ..executor import BatchFuture
from ..models.sharding import check_shardable
from ..sampling import Sampler
from .channel import ControlChannel
from .driver_sampling import DriverRows, samples_on_driver
from .failures import FAILURE_GRACE_S, Failure, FailureLog, WorkerFailedError, root_cause
from .groups import store_client
from .heartbeat import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S, HeartbeatMonitor, \
    check_heartbeat_options
from .inflight import InFlight
from .listener import Listeners
from .messages import OP_STATS, OP_STOP, SamplingRow, header, pack_forward, pack_logits_request, pack_moves, \
    sampling_row, spec_to_dict
from .startup import StartupWatch, allocate_pools, open_store, start_workers
from .stats import StatsBoard
from .torchrun import torchrun_env
from .worker_info import WorkerInfo, terminate_processes

__all__ = ["DistributedExecutor", "WorkerFailedError"]

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0      # how long shutdown() waits for workers to finish before killing them
DEFAULT_STARTUP_TIMEOUT_S = 600.0


class DistributedExecutor:
    """tp x pp worker processes (torch.multiprocessing spawn on this node, or the ranks of a
    torchrun launch whose rank 0 is this process). The workers run with this process's kernel
    modes (modes.current() when the executor is created).

    `worker_timeout`: the longest one batch's result may take. `startup_timeout`: the longest
    the workers may take to start (a worker that dies or raises meanwhile fails it at once).
    `heartbeat_interval` / `heartbeat_timeout`: each worker beats every interval; one silent for
    the timeout (stopped, or its host froze) fails the group, naming it."""

    def __init__(self, model_path: str, spec, *, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, device: str = "cpu", dtype: str = "float32",
                 kv_cache_memory: Optional[int] = None, threads_per_worker: Optional[int] = None,
                 worker_timeout: float = DEFAULT_WORKER_TIMEOUT_S,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
                 heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S, sync_timing: bool = False,
                 quantization: str = "auto"):
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        check_shardable(spec, tp, pp)
        self._heartbeat_interval, self._heartbeat_timeout = check_heartbeat_options(heartbeat_interval,
                                                                                    heartbeat_timeout)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' for parallel workers (each worker uses "
                             f"its own GPU, cuda:local_rank), got {device!r}")
        self.spec = spec
        self.tp, self.pp = tp, pp
        self.num_processes = tp * pp             # worker processes
        self.n_workers = pp                      # batches in flight: one per pipeline stage
        self.device_type = device
        self.dtype = dtype
        self.workers = WorkerInfo.grid(tp, pp)
        self.n_slots = 0
        self._worker_timeout = float(worker_timeout)
        torchrun = torchrun_env()
        self._lock = threading.Lock()
        self._seq_ids: dict = {}                 # Request -> seq id (identity-hashed)
        self._next_seq = 0
        self._free: list[int] = []               # seq ids whose generators the sampler may drop
        self._sampler = Sampler()                # the rows sampled here (driver_sampling.py)
        self._failures = FailureLog()
        self._error: Optional[str] = None
        self._stopping = False
        self._closed = False
        self._inflight = InFlight()
        self._stats = StatsBoard()
        self._channel: Optional[ControlChannel] = None
        self._listeners: Optional[Listeners] = None
        self._watch: Optional[StartupWatch] = None
        cfg = {
            "model_path": str(model_path), "spec": spec_to_dict(spec), "dtype": str(dtype).replace("torch.", ""),
            "device": device, "tp": tp, "pp": pp, "kv_cache_memory": kv_cache_memory, "quantization": quantization,
            # torchrun sets OMP_NUM_THREADS for its ranks; spawned workers share this host's cores.
            "threads": threads_per_worker or (None if torchrun else self._default_threads()),
            "loopback": torchrun is None,
            "workers_per_host": self.num_processes, "data_timeout_s": self._worker_timeout,
            "heartbeat_interval_s": self._heartbeat_interval,
            "sync_timing": sync_timing, "modes": dataclasses.asdict(modes.current()),
            "log_level": logging.getLevelName(logging.getLogger("orca_ext").getEffectiveLevel()),
        }
        try:
            t0 = time.perf_counter()
            # No local name holds the store: closing the watch must be able to close it.
            self._watch = StartupWatch(open_store(torchrun, self.workers, device, float(startup_timeout)),
                                       self.workers, float(startup_timeout))
            ctl = start_workers(cfg, self.workers, self._watch, spawn=torchrun is None)
            self._channel = ControlChannel(ctl, [w.rank for w in self.workers])
            log.info("%d workers (tp=%d x pp=%d) ready in %.1fs", self.num_processes, tp, pp,
                     time.perf_counter() - t0)
        except BaseException:
            self._fail_startup()
            raise

    def _fail_startup(self) -> None:
        self._stopping = True
        terminate_processes(self.workers)
        if self._watch is not None:
            self._watch.close()

    def _default_threads(self) -> int:
        # Workers on this host share its cores (the driver needs little CPU of its own).
        return max(1, (os.cpu_count() or 1) // self.num_processes)

    # -- the KV cache ------------------------------------------------------------------------------
    @property
    def max_slots(self) -> Optional[int]:
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
        try:
            allocate_pools(self._watch, n_slots)
        except BaseException:
            self._fail_startup()
            raise
        self.n_slots = n_slots
        self._listeners = Listeners(self._channel, self.workers, self._inflight, self._stats,
                                    self._on_failure, lambda: self._stopping)
        self._listeners.start()
        beats = store_client(self._watch.store, self._heartbeat_timeout)
        HeartbeatMonitor(beats, self.workers, self._heartbeat_interval, self._heartbeat_timeout,
                         self._on_silent, lambda: self._stopping or self._error is not None).start()

    def move_slabs(self, moves: Sequence[Sequence[int]]) -> None:
        """Slab compaction and prefix cache copies: rows (src, dst, n) move KV rows [src, src+n)
        of every layer's K and V pool to [dst, dst+n) in every worker, move after move
        (ops.slab_move). Workers handle messages in order, so the move lands after every batch
        posted before it and before any batch posted after it, with batches in flight too.
        Returns at once; a worker that fails to move fails the group."""
        rows = self._check_moves(moves)
        if not rows or self._error is not None:  # a failed group runs nothing more: nothing to keep in step
            return
        try:
            self._channel.post_all(*pack_moves(torch.tensor(rows, dtype=torch.int64)))
        except Exception as exc:
            self._on_failure(Failure(None, "lost", f"sending a slab move failed: {exc}"))

    def _check_moves(self, moves) -> list[tuple[int, int, int]]:
        if not self.n_slots:
            raise RuntimeError("move_slabs before allocate_kv_cache: the workers have no KV pools yet")
        rows = [tuple(int(v) for v in row) for row in (moves.tolist() if torch.is_tensor(moves) else moves)]
        for i, row in enumerate(rows):
            if len(row) != 3:
                raise ValueError(f"moves[{i}] must be (src, dst, n), got {row}")
            src, dst, n = row
            if n < 0 or src < 0 or dst < 0 or max(src, dst) + n > self.n_slots:
                raise ValueError(f"moves[{i}] = (src={src}, dst={dst}, n={n}): rows [src, src+n) and "
                                 f"[dst, dst+n) must lie in [0, n_slots={self.n_slots}) with n >= 0")
        return rows

    # -- running batches ---------------------------------------------------------------------------
    @property
    def error(self) -> Optional[str]:
        return self._error

    @property
    def wait_timeout(self) -> Optional[float]:
        """The longest a batch's result may take (then the group is failed)."""
        return self._worker_timeout

    def execute(self, batch) -> BatchFuture:
        """Post one batch (the engine has checked every row's inputs). Never raises: a row whose
        sampling parameters cannot be packed fails alone, and a batch that cannot be packed fails
        alone, before anything reaches the workers (nothing is left in flight to answer)."""
        future = BatchFuture()
        rows, row_errors, driver_rows = self._sampling_rows(batch)
        with self._channel.lock:
            with self._lock:
                free, self._free = self._free, []
            try:
                message = pack_forward(batch.index, batch.inputs, rows, free)
            except Exception as exc:
                with self._lock:
                    self._free[:0] = free
                log.exception("iteration %d could not be packed; failing its %d requests", batch.index, len(rows))
                future.resolve(RuntimeError(f"iteration {batch.index} could not be packed for the workers: "
                                            f"{type(exc).__name__}: {exc}"))
                return future
            self._post(batch.index, self._completion(batch.index, future, driver_rows, row_errors), *message)
        return future

    def forward_logits(self, inputs: list, index: int = -1) -> BatchFuture:
        """Not for serving: run one batch of (new_token_ids, start_pos, slab_start) rows on the
        workers (writing their KV slots) and resolve to its last-token logits, float32 [B, V],
        instead of tokens. Tests and benchmarks compare them with a single process."""
        future = BatchFuture()
        self._post(index, future, *pack_logits_request(index, inputs))
        return future

    def _post(self, index: int, future: BatchFuture, *message: torch.Tensor) -> None:
        # Answers come back in the order batches were posted: in-flight entries and posts stay in step.
        with self._channel.lock:
            closed = self._inflight.add(index, future)
            if closed is not None:
                future.resolve(WorkerFailedError(closed))
                return
            try:
                self._channel.post_all(*message)
                failed = None
            except Exception as exc:
                failed = exc
        if failed is not None:
            self._on_failure(Failure(None, "lost", f"sending iteration {index} failed: {failed}"))

    def wait(self, future: BatchFuture):
        try:
            return future.result(timeout=self._worker_timeout)
        except concurrent.futures.TimeoutError:
            self._on_failure(Failure(None, "timeout", f"no result from the workers within "
                                                      f"{self._worker_timeout:.0f} s"))
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

    def _sampling_rows(self, batch) -> tuple[list[SamplingRow], dict[int, str], DriverRows]:
        """The batch's sampling rows, the error of each row whose values cannot be packed (a
        stand-in that draws nothing takes its place; its error replaces its result), and the
        rows this driver samples from the logits the sampling worker sends back."""
        rows, errors, on_driver = [], {}, []
        for i, req in enumerate(batch.requests):
            seq = self._seq_id(req)
            n_logits = 1 if batch.logit_rows is None else int(batch.logit_rows[i])
            try:
                here = samples_on_driver(req, n_logits)
                rows.append(sampling_row(seq, req.params, req.emits_token, self.spec.vocab_size, on_driver=here,
                                         logit_rows=n_logits))
                if here:
                    on_driver.append(i)
            except Exception as exc:
                errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
                rows.append(SamplingRow(seq, None, 0.0, 0, 1.0, emits_token=False))
        return rows, errors, DriverRows(batch.requests, batch.inputs, batch.logit_rows, on_driver)

    def _completion(self, index: int, future: BatchFuture, driver_rows: DriverRows,
                    errors: dict[int, str]) -> BatchFuture:
        """The future to post for a batch: when the sampling worker's answer arrives, the rows
        this driver samples are sampled, the rows that failed here get their errors, and
        `future` resolves with the batch's SampleResult. Runs on the listener thread; the
        engine touches none of these requests until `future` resolves."""
        posted = BatchFuture()

        def complete(done: BatchFuture) -> None:
            try:
                answer = done.result()
            except BaseException as exc:
                future.resolve(exc)
                return
            try:
                result = driver_rows.merge(self._sampler, answer)
                for i, error in errors.items():
                    result.tokens[i] = None
                    result.errors[i] = error
            except BaseException as exc:  # the future must resolve, whatever happened
                log.exception("completing iteration %d failed", index)
                result = exc
            future.resolve(result)

        posted.add_done_callback(complete)
        return posted

    def _seq_id(self, req) -> int:
        with self._lock:
            seq = self._seq_ids.get(req)
            if seq is None:
                seq = self._seq_ids[req] = self._next_seq
                self._next_seq += 1
            return seq

    # -- failures ----------------------------------------------------------------------------------
    def _on_failure(self, failure: Failure) -> None:
        with self._lock:
            if self._error is not None or (self._stopping and failure.kind != "raised"):
                return
            if not self._failures.add(failure):
                return  # recorded; the first failure's caller names the root cause
        time.sleep(FAILURE_GRACE_S)
        with self._lock:
            failures = self._failures.snapshot()
        message = root_cause(failures, self.workers)
        log.error("distributed execution failed: %s", message)
        with self._lock:
            self._error = message
        for future in self._inflight.close(message):
            future.resolve(WorkerFailedError(message))
        self._stats.wake()
        terminate_processes(self.workers)

    def _on_silent(self, worker, seconds: float) -> None:
        state = " (its process is stopped)" if worker.is_stopped() else ""
        self._on_failure(Failure(worker.rank, "hung", f"stopped responding: no heartbeat for {seconds:.0f} s "
                                                      f"(heartbeat_timeout={self._heartbeat_timeout:g} s){state}"))

    # -- statistics (benchmarks) ---------------------------------------------------------------------
    def worker_stats(self, reset: bool = False, timeout: float = 60.0) -> list:
        """Each worker's time split (WorkerTimes) since start or the last reset, in worker order.
        Answered after every batch sent before it."""
        self._stats.clear()
        self._channel.post_all(header(OP_STATS, int(reset)))
        return self._stats.wait_all([w.rank for w in self.workers], timeout,
                                    lambda: WorkerFailedError(self._error) if self._error is not None else None)

    def describe_workers(self) -> list[dict]:
        return [w.describe() for w in self.workers]

    # -- shutdown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker: they finish the batches already sent, then exit; stragglers are
        terminated after STOP_TIMEOUT_S. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._stopping = True
        if self._error is None and self._listeners is not None:
            try:
                self._channel.post_all(header(OP_STOP))
            except Exception as exc:
                log.debug("could not send STOP: %s", exc)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        if self._listeners is not None:
            self._listeners.join(lambda: max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.process is not None:
                w.process.join(max(0.0, deadline - time.monotonic()))
        terminate_processes(self.workers)
        for w in self.workers:
            if w.pipe is not None:
                w.pipe.close()
                w.pipe = None
        if self._channel is not None:
            self._channel.close(1.0)
        for future in self._inflight.close("the executor was shut down"):
            future.resolve(WorkerFailedError("the executor was shut down"))

