"""One engine iteration: schedule -> launch on the executor -> postprocess when tokens return.

The engine is single-threaded by design: the server's loop thread is its only caller. Server
calls that touch requests (submit, abort) take the same lock that `step` holds while scheduling
and postprocessing; the lock is released while the model runs, so submissions never wait for a
forward pass.

The executor (executor.py) runs batches: in this process (`LocalExecutor`: the forward pass is
done when `execute` returns), or on tensor x pipeline parallel workers (`DistributedExecutor`:
`execute` only sends the batch, and up to n_workers = pipeline stages batches are in flight, as
in Algorithm 1). Either way the engine code path is the same.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import ops
from .executor import LocalExecutor
from .models.batch import count_tokens
from .request import IterationRecord, Request
from .sampling import Sampler

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """A launched iteration: its requests and the inputs captured when it was selected."""

    index: int
    requests: list
    inputs: list  # [(new_token_ids, start_pos, slab_start)] in batch order
    record: int = -1  # position of its IterationRecord in Engine.records (-1: not recorded)
    # Selected requests whose inputs the model cannot take (token id, position or slot out of
    # range): already failed, left out of the forward, and completed with the batch.
    dropped: list = dataclasses.field(default_factory=list)


class Engine:
    def __init__(self, model, scheduler, *, record_iterations: bool = False,
                 sampler: Optional[Sampler] = None, slab_compaction: bool = True):
        """`model`: a model (run here through a LocalExecutor) or an executor. `slab_compaction`:
        let the scheduler slide live slabs together (needs the model's `kv_pools` in this
        process; off for executors whose pools live in worker processes)."""
        self.executor = model if hasattr(model, "execute") else LocalExecutor(model, sampler)
        self.model = getattr(self.executor, "model", None)  # the local model, if any
        # The scheduler's n_workers bounds the batches in flight; the server sets it to the
        # executor's pipeline depth (with a LocalExecutor more only delays postprocessing).
        self.scheduler = scheduler
        self.kv_cache = self.executor.allocate_kv_cache(scheduler.n_slots)
        self.compaction_moved_bytes = 0
        if slab_compaction:
            if getattr(self.model, "kv_pools", None) is None:
                log.warning("%s exposes no kv_pools in this process; slab compaction is off",
                            type(self.model if self.model is not None else self.executor).__name__)
            else:
                # The scheduler calls it only while no batch is in flight (see _compact), so no
                # executing batch ever reads or writes a slab that moves.
                scheduler.slab_mover = self._move_slabs
        self.record_iterations = record_iterations
        self.records: list[IterationRecord] = []
        self.num_iterations = 0
        self.num_finished = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        # Results of launched batches not yet postprocessed, oldest first. How many batches are
        # in flight is the scheduler's count (n_scheduled); this only holds their results.
        self._inflight: deque = deque()   # (ScheduledBatch, result)
        self.last_step_idle = False       # the last step neither launched nor completed a batch
        # Set when the pool changes (submit, abort) or a launched batch returns: a free pipeline
        # stage may then take a new batch. Cleared under the lock before each selection.
        self._wake = threading.Event()

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)
        self._wake.set()

    def abort_request(self, req: Request, reason: str = "abort", error: Optional[str] = None) -> bool:
        """End a request that has not finished. Its slab is returned now, or when its running
        batch returns (never while the model may still write it)."""
        if req.finished:
            return False
        self._end(req, reason, error)
        self.scheduler.remove(req)
        self._wake.set()  # its slab may let a waiting request in
        return True

    def abort_all(self, reason: str, error: Optional[str] = None) -> list:
        """End every unfinished request and return all slabs (shutdown, or recovery after an
        unexpected loop error). Only call when no batch is executing: in-flight results are
        dropped."""
        changed = []
        for req in list(self.scheduler.pool):
            if not req.finished:
                self._end(req, reason, error)
                changed.append(req)
        self._inflight.clear()
        self.scheduler.abandon_batches()
        for req in list(self.scheduler.pool):
            self.scheduler.remove(req)
        return changed

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._inflight)

    @property
    def slots_used(self) -> int:
        """KV slots that hold a computed token (<= slots_reserved)."""
        return sum(r.num_cached for r in self.scheduler.pool)

    # -- one iteration -------------------------------------------------------------------------
    def step(self, lock=None, publish: Optional[Callable[[list], None]] = None) -> list:
        """Run one iteration of Algorithm 1's loop; returns the requests whose output changed.

        `lock` (if given) is held while the scheduler and requests are touched, not during the
        forward pass; `publish(changed)` is called with the lock still held.
        """
        lock = lock if lock is not None else contextlib.nullcontext()
        with lock:
            self._wake.clear()
            batch = self._schedule()
            if batch is not None and not batch.requests:  # every row failed its input check
                changed = self._postprocess(batch, None)
                if publish is not None:
                    publish(changed)
                return changed
        if batch is not None:
            self._inflight.append((batch, self._execute(batch)))
        changed: list = []
        self.last_step_idle = batch is None and not self._inflight
        # Wait for one launched batch when n_workers batches are in flight, or when nothing new
        # could be launched (so in-flight work always drains).
        if self._inflight and (len(self._inflight) >= self.scheduler.n_workers or batch is None):
            done, future = self._inflight[0]
            if batch is None and len(self._inflight) < self.scheduler.n_workers and not future.done():
                # A pipeline stage is free: whichever comes first, the oldest batch's tokens or a
                # request that can fill the stage (Orca launches as soon as a worker is free).
                future.add_done_callback(lambda _: self._wake.set())
                if self._wake.wait(getattr(self.executor, "worker_timeout", None)) and not future.done():
                    return changed  # the caller steps again and launches the newcomer
            self._inflight.popleft()
            result = self.executor.wait(future)
            with lock:
                self._record_completion(done, future)
                changed = self._postprocess(done, result)
                if self.executor.error is not None:  # the workers are gone: nothing can run any more
                    changed += self.abort_all("error", f"the engine stopped: {self.executor.error}")
                if publish is not None:
                    publish(changed)
        return changed

    def shutdown(self) -> None:
        """Stop the executor (its worker processes, if any). Call after abort_all."""
        self.executor.shutdown()

    def _schedule(self) -> Optional[ScheduledBatch]:
        reqs = self.scheduler.schedule()
        if not reqs:
            return None
        index = self.num_iterations
        self.num_iterations += 1
        inputs = [(*r.next_inputs(), r.slab_start) for r in reqs]
        # One row the model cannot take would fail the whole forward: it fails alone instead.
        errors = [self._input_error(inp) for inp in inputs]
        dropped = [r for r, err in zip(reqs, errors) if err is not None]
        if dropped:
            for r, err in zip(reqs, errors):
                if err is not None:
                    self._end(r, "error", err)
            log.warning("iteration %d: %d request(s) failed their input check", index, len(dropped))
            inputs = [inp for inp, err in zip(inputs, errors) if err is None]
            reqs = [r for r, err in zip(reqs, errors) if err is None]
        record = -1
        if self.record_iterations:
            n_prefill, n_decode = count_tokens(inputs)
            record = len(self.records)
            self.records.append(IterationRecord(index, tuple(r.request_id for r in reqs), n_prefill,
                                                n_decode, self.scheduler.n_rsrv,
                                                chunk_sizes=tuple(len(new_ids) for new_ids, _, _ in inputs)))
        return ScheduledBatch(index, reqs, inputs, record, dropped)

    def _execute(self, batch: ScheduledBatch):
        """Launch the batch; returns its BatchFuture (already resolved for a LocalExecutor)."""
        launched = time.perf_counter()
        future = self.executor.execute(batch)
        if batch.record >= 0:
            rec = self.records[batch.record]
            self.records[batch.record] = dataclasses.replace(rec, launch_time=launched)
        return future

    def _record_completion(self, batch: ScheduledBatch, future) -> None:
        if batch.record >= 0:
            done = future.completed_at if future.completed_at is not None else time.perf_counter()
            rec = self.records[batch.record]
            self.records[batch.record] = dataclasses.replace(rec, complete_time=done)

    def _input_error(self, inputs) -> Optional[str]:
        """Why the model cannot take one request's `(new_token_ids, start_pos, slab_start)`, or None.
        The same bounds the model checks for the whole batch, per row and on host ints."""
        new_ids, start_pos, slab_start = inputs
        spec = self.executor.spec
        vocab = spec.vocab_size
        if min(new_ids) < 0 or max(new_ids) >= vocab:
            return f"input token id outside the vocabulary [0, {vocab}): {[t for t in new_ids if not 0 <= t < vocab][:4]}"
        last = start_pos + len(new_ids) - 1
        if last >= spec.max_position_embeddings:
            return f"position {last} is past the model's max_position_embeddings"
        if slab_start < 0 or slab_start + last >= self.scheduler.n_slots:
            return f"KV slot {slab_start + last} is outside the cache of {self.scheduler.n_slots} slots"
        return None

    def _postprocess(self, batch: ScheduledBatch, result) -> list:
        changed = list(batch.dropped)
        for i, req in enumerate(batch.requests):
            if req.finished:  # aborted while running: its token is dropped, complete() frees the slab
                continue
            if isinstance(result, BaseException):
                self._end(req, "error", _forward_failed(result))
            else:
                req.num_cached += len(batch.inputs[i][0])
                if req.num_cached == len(req.prompt_token_ids):
                    self.num_prompt_tokens += req.num_cached
                elif req.prompt_remaining:
                    continue  # a prompt chunk that is not the last: its KV is cached, no token yet
                err = result.errors[i]
                if err is not None:
                    self._end(req, "error", err)
                else:
                    try:
                        self._append_token(req, result.tokens[i])
                    except Exception as exc:  # e.g. a detokenizer error: only this request fails
                        log.exception("request %r failed in postprocessing", req.request_id)
                        self._end(req, "error", f"{type(exc).__name__}: {exc}")
            changed.append(req)
        self.scheduler.complete(batch.requests + batch.dropped)
        return changed

    def _move_slabs(self, moves: list) -> None:
        """The scheduler compacted the slabs: copy each moved request's cached KV rows from its
        old slab start to its new one, in the order given (the scheduler's slab_mover)."""
        rows = [(old, new, req.num_cached) for req, old, new in moves if req.num_cached > 0]
        if rows:
            pools = self.model.kv_pools  # [P, n_slots, ...]: every layer's K and V pool
            ops.slab_move(pools, torch.tensor(rows, dtype=torch.int64))
            row_bytes = pools[0, 0].numel() * pools.element_size() * pools.shape[0]
            self.compaction_moved_bytes += sum(n for _, _, n in rows) * row_bytes
        log.debug("slab compaction moved %d slabs (%d with cached KV)", len(moves), len(rows))

    @property
    def num_compactions(self) -> int:
        return self.scheduler.num_compactions

    def _end(self, req: Request, reason: str, error: Optional[str] = None) -> None:
        """Set a request's finish reason once; it leaves the pool through the scheduler."""
        if not req.finished:
            req.mark_finished(reason, error)
            self.num_finished += 1
            self.executor.request_finished(req)

    # -- per-request postprocessing --------------------------------------------------------------
    def _append_token(self, req: Request, token: int) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.time()
        req.output_token_ids.append(token)
        req.version += 1
        self.num_generated_tokens += 1
        params = req.params
        if token in req.stop_token_ids:
            # The stop/EOS token stays in token_ids but adds no text.
            self._update_text(req, final=True)
            self._end(req, "stop")
            return
        final = len(req.output_token_ids) >= params.max_tokens
        if req.detokenizer is not None:
            req.detokenizer.add(token)
        self._update_text(req, final=final)
        if final:
            self._end(req, "length")

    def _update_text(self, req: Request, final: bool) -> None:
        detok = req.detokenizer
        if detok is None:
            return
        if final:
            detok.flush()
        full = detok.text
        matcher = req.stop_matcher
        if matcher is not None:
            hit = matcher.feed(full)  # reads only the new characters
            if hit is not None:
                req.text = full[:hit]
                self._end(req, "stop")
                return
            if not final:
                full = full[:len(full) - matcher.held]
        req.text = full


def _forward_failed(exc: BaseException) -> str:
    return f"model forward failed: {type(exc).__name__}: {exc}"
