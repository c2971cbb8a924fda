"""One engine iteration: schedule -> run (ForwardBatch.build + model.forward + sample) -> postprocess.

The engine is single-threaded by design: the server's loop thread is its only caller. Server
calls that touch requests (submit, abort) take the same lock that `step` holds while scheduling
and postprocessing; the lock is released while the model runs, so submissions never wait for a
forward pass.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import ops
from .detokenizer import find_stop, partial_stop_len
from .models.batch import ForwardBatch, count_tokens
from .request import IterationRecord, Request
from .sampling import Sampler

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """A launched iteration: its requests and the inputs captured when it was selected."""

    index: int
    requests: list
    inputs: list  # [(new_token_ids, start_pos, slab_start)] in batch order


class Engine:
    def __init__(self, model, scheduler, *, record_iterations: bool = False,
                 sampler: Optional[Sampler] = None, slab_compaction: bool = True):
        self.model = model
        self.scheduler = scheduler
        self.sampler = sampler or Sampler()
        self.kv_cache = model.allocate_kv_cache(scheduler.n_slots)
        self.compaction_moved_bytes = 0
        if slab_compaction:
            if getattr(model, "kv_pools", None) is None:
                log.warning("%s exposes no kv_pools; slab compaction is off", type(model).__name__)
            else:
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

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)

    def abort_request(self, req: Request, reason: str = "abort", error: Optional[str] = None) -> bool:
        """End a request that has not finished. Its slab is returned now, or when its running
        batch returns (never while the model may still write it)."""
        if req.finished:
            return False
        self._end(req, reason, error)
        self.scheduler.remove(req)
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
            batch = self._schedule()
        if batch is not None:
            result = self._execute(batch)
            self._inflight.append((batch, result))
        changed: list = []
        self.last_step_idle = batch is None and not self._inflight
        # Wait for one launched batch when n_workers batches are in flight, or when nothing new
        # could be launched (so in-flight work always drains).
        if self._inflight and (len(self._inflight) >= self.scheduler.n_workers or batch is None):
            done, result = self._inflight.popleft()
            with lock:
                changed = self._postprocess(done, result)
                if publish is not None:
                    publish(changed)
        return changed

    def _schedule(self) -> Optional[ScheduledBatch]:
        reqs = self.scheduler.schedule()
        if not reqs:
            return None
        index = self.num_iterations
        self.num_iterations += 1
        inputs = [(*r.next_inputs(), r.slab_start) for r in reqs]
        if self.record_iterations:
            n_prefill, n_decode = count_tokens(inputs)
            self.records.append(IterationRecord(index, tuple(r.request_id for r in reqs), n_prefill,
                                                n_decode, self.scheduler.n_rsrv,
                                                tuple(len(new_ids) for new_ids, _, _ in inputs)))
        return ScheduledBatch(index, reqs, inputs)

    def _execute(self, batch: ScheduledBatch):
        """Run the model and the sampler. Returns a SampleResult, or the exception that failed the
        whole batch."""
        try:
            with torch.inference_mode():
                fb = ForwardBatch.build(batch.inputs, self.model.device)
                logits = self.model.forward(fb)
                return self.sampler(logits, batch.requests)
        except Exception as exc:  # one bad batch must not kill the loop
            log.exception("iteration %d failed; failing its %d requests", batch.index, len(batch.requests))
            return exc

    def _postprocess(self, batch: ScheduledBatch, result) -> list:
        changed = []
        for i, req in enumerate(batch.requests):
            if req.finished:  # aborted while running: its token is dropped, complete() frees the slab
                continue
            if isinstance(result, BaseException):
                self._end(req, "error", f"model forward failed: {type(result).__name__}: {result}")
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
                        log.exception("request %s failed in postprocessing", req.request_id)
                        self._end(req, "error", f"{type(exc).__name__}: {exc}")
            changed.append(req)
        self.scheduler.complete(batch.requests)
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
        searched = req.stop_searched
        if final:
            detok.flush()
        full = detok.text
        stops = req.params.stop
        if stops:
            hit = find_stop(full, stops, searched)
            req.stop_searched = len(full)
            if hit is not None:
                req.text = full[:hit[0]]
                self._end(req, "stop")
                return
            if not final:
                full = full[:len(full) - partial_stop_len(full, stops)]
        req.text = full
