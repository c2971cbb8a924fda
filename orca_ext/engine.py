"""One engine iteration: schedule -> launch on the executor -> postprocess when tokens return.

The engine is single-threaded by design: the server's loop thread is its only caller of `step`.
Calls that touch requests (add, abort) take the engine's lock, which `step` holds while
scheduling and postprocessing and releases while the model runs, so submissions never wait for a
forward pass. The server passes its own lock, so its request table and the engine change
together.

Two steps, chosen once by the executor's pipeline depth (vLLM's `step` and
`step_with_batch_queue`):
    step()                    n_workers = 1: select, run, postprocess; one batch at a time
    step_with_batch_queue()   n_workers > 1: launch whenever a stage is free and a batch can be
                              selected; otherwise postprocess the oldest batch in flight
One condition, `wakeup` (on the engine's lock), is signalled whenever something the next
selection depends on changes: a request arrives or is aborted, a batch in flight returns (the
pipelined step's; step_one waits on its one batch directly), or the server shuts down. Whoever
waits for work waits on it.

The executor (executor.py) runs batches: in this process (`LocalExecutor`: the forward pass is
done when `execute` returns), or on tensor x pipeline parallel workers (`DistributedExecutor`:
`execute` only sends the batch). The engine checks every row's inputs before launching it
(`_input_error`); nothing below it checks them again.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from .executor import BatchFuture, Executor
from .models.batch import count_tokens
from .prefix_cache import PrefixCache
from .request import IterationRecord, Request, RequestState

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
    # Logits rows per request (Request.logit_rows); None: one each, as every batch without a
    # prompt-logprobs request has.
    logit_rows: Optional[list] = None


class Engine:
    def __init__(self, executor: Executor, scheduler, *, record_iterations: bool = False,
                 slab_compaction: bool = True, lock=None,
                 publish: Optional[Callable[[list], None]] = None,
                 prefix_cache: Optional[PrefixCache] = None):
        """`executor`: what runs the batches (executor.Executor). `slab_compaction`: let the
        scheduler slide live slabs together (executor.move_slabs, between batches). `lock`: the
        lock that guards the requests (an RLock; default: a new one). `publish(changed)` is called
        under it with the requests whose output changed in a step. `prefix_cache`: keep finished
        requests' KV rows there and start new requests from them (None: no prefix caching); the
        rows are copied with executor.move_slabs before the request's first batch."""
        if not isinstance(executor, Executor):
            raise TypeError(f"executor must implement orca_ext.executor.Executor, got {type(executor).__name__}")
        self.executor = executor
        # The scheduler's n_workers bounds the batches in flight: the executor's pipeline depth.
        self.scheduler = scheduler
        self.executor.allocate_kv_cache(scheduler.n_slots)
        self.compaction_moved_bytes = 0
        if slab_compaction:
            # The scheduler calls it only while no batch is in flight (see its _compact), so no
            # executing batch ever reads or writes a slab that moves.
            scheduler.slab_mover = self._move_slabs
        self.prefix_copied_bytes = 0
        if prefix_cache is not None:
            scheduler.attach_prefix_cache(prefix_cache, self._copy_cached_rows)
        self.record_iterations = record_iterations
        self.records: list[IterationRecord] = []
        self.num_iterations = 0
        self.num_finished = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.lock = lock if lock is not None else threading.RLock()
        self.wakeup = threading.Condition(self.lock)
        self._changes = 0                 # bumped with every wakeup signal (see wait_for_change)
        self.publish = publish
        # Launched batches not yet postprocessed, oldest first. How many batches are in flight
        # is the scheduler's count (n_scheduled); this only holds their futures.
        self._inflight: deque = deque()   # (ScheduledBatch, BatchFuture)
        # Siblings waiting for their fork_of request's prompt to be cached: parent -> [siblings].
        self._held: dict = {}
        self.num_forked_tokens = 0        # prompt tokens copied instead of prefilled
        self.step = self.step_with_batch_queue if scheduler.n_workers > 1 else self.step_one

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        with self.lock:
            parent = req.fork_of
            if parent is not None and not parent.finished and parent.prompt_remaining:
                self._held.setdefault(parent, []).append(req)  # enters the pool with _release_held
            else:
                self.scheduler.add(req)
            self.signal()

    @property
    def num_held(self) -> int:
        """Siblings held until their parent's prompt is cached (not yet in the pool)."""
        return sum(len(siblings) for siblings in self._held.values())

    def _release_held(self, parent: Request) -> None:
        """parent's prompt is cached (or it ended): its held siblings join the pool."""
        for sibling in self._held.pop(parent, ()):
            if not sibling.finished:
                self.scheduler.add(sibling)

    def _fork(self, reqs: list) -> None:
        """Newly admitted siblings copy the KV rows of the prompt prefix they share with their
        parent (n > 1: the whole prompt; a batch's prompts: the context they start with) into
        their own slabs instead of prefilling them, and prefill the rest. At least the prompt's
        last token always runs, so that a sibling's first token is drawn from its own logits row
        with its own generator. A sibling that asks for prompt logprobs takes the parent's
        entries for the copied rows (the same raw logits rows, bit for bit) and recomputes the
        last shared row when the prompts part there, since that row scores its own next token.
        Only with no batch in flight (executor.move_slabs' rule); a sibling whose parent has left
        the pool, or lacks the prompt logprobs it needs, prefills in full."""
        if self._inflight:
            return
        moves = []
        for r in reqs:
            parent, r.fork_of = r.fork_of, None
            if parent is None or r.num_cached or parent.slab_start < 0 or parent.state is RequestState.RELEASED:
                continue
            n = r.rows_shared_with(parent)
            if n < 1 or parent.num_cached < n:
                continue
            if r.prompt_logprobs is not None:
                # Entries 1..n are the logprobs of prompt tokens 1..n, which the parent's rows
                # 0..n-1 gave; the sibling's own rows from n on score the rest.
                copied = parent.prompt_logprobs_upto(n + 1, r.params.prompt_logprobs)
                if copied is None:
                    continue
                r.prompt_logprobs = copied
            moves.append((parent.slab_start, r.slab_start, n))
            r.num_cached = n
            self.num_forked_tokens += n
        if moves:
            self.executor.move_slabs(moves)

    def abort_request(self, req: Request, reason: str = "abort", error: Optional[str] = None) -> bool:
        """End a request that has not finished. Its slab is returned now, or when its running
        batch returns (never while the model may still write it)."""
        with self.lock:
            if req.finished:
                return False
            self._end(req, reason, error)
            parent = req.fork_of
            if parent is not None and req in self._held.get(parent, ()):
                self._held[parent].remove(req)  # never entered the pool
                return True
            self.scheduler.remove(req)
            self.signal()  # its slab may let a waiting request in
            return True

    def abort_all(self, reason: str, error: Optional[str] = None) -> list:
        """End every unfinished request and return all slabs (shutdown, or recovery after an
        unexpected loop error). Only call when no batch is executing: in-flight results are
        dropped."""
        changed = []
        held, self._held = self._held, {}  # first, so that no parent's end lets them in
        for req in [r for siblings in held.values() for r in siblings] + list(self.scheduler.pool):
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

    # -- waking up ---------------------------------------------------------------------------
    def signal(self) -> None:
        """Something the next selection depends on changed: wake whoever waits on `wakeup`."""
        with self.lock:
            self._changes += 1
            self.wakeup.notify_all()

    def wait_for_change(self, since: int, timeout: Optional[float] = None) -> bool:
        """Wait (lock held) until a signal after the one numbered `since`; False on timeout."""
        return self.wakeup.wait_for(lambda: self._changes != since, timeout)

    # -- one iteration -------------------------------------------------------------------------
    def step_one(self) -> list:
        """One iteration of Algorithm 1's loop with one batch at a time: select, run, postprocess.
        Returns the requests whose output changed."""
        with self.lock:
            seen = self._changes
            batch = self._schedule()
            if batch is None:
                # Work exists but none can be scheduled (cannot happen with n_workers = 1, where
                # an empty KV cache fits any validated request): sleep until the pool changes.
                if self.has_work():
                    self.wait_for_change(seen)
                return []
            if not batch.requests:  # every row failed its input check
                return self._finish(batch, None)
        future = self._launch(batch)
        result = self.executor.wait(future)
        with self.lock:
            return self._finish(batch, result, future)

    def step_with_batch_queue(self) -> list:
        """One iteration of Algorithm 1's loop with up to n_workers batches in flight: launch a
        batch when a stage is free and one can be selected (and return at once, to select the
        next); else wait for the oldest batch's tokens, or for a change to the pool that may
        fill a free stage, whichever comes first; postprocess the oldest batch once it is back.
        Returns the requests whose output changed."""
        with self.lock:
            seen = self._changes
            batch = self._schedule()
            if batch is not None and not batch.requests:
                return self._finish(batch, None)
        if batch is not None:
            launched = self._launch(batch)
            launched.add_done_callback(lambda _: self.signal())  # ends a free stage's wait below
            self._inflight.append((batch, launched))
            if len(self._inflight) < self.scheduler.n_workers:
                return []  # another stage is free: select again
        done, future = self._inflight[0] if self._inflight else (None, None)
        if batch is None and (future is None or not future.done()):
            with self.lock:
                if future is None and not self.has_work():
                    return []
                # Nothing could be launched: whichever comes first, the oldest batch's tokens
                # (its future signals) or a request that can fill the free stage.
                woke = self.wait_for_change(seen, self.executor.wait_timeout)
            if future is None or (woke and not future.done()):
                return []  # the caller steps again and launches the newcomer
            # Timed out: executor.wait below bounds the rest of the wait and names the fault.
        self._inflight.popleft()
        result = self.executor.wait(future)
        with self.lock:
            return self._finish(done, result, future)

    def _launch(self, batch: ScheduledBatch) -> BatchFuture:
        """Hand the batch to the executor; returns its future."""
        launched = time.perf_counter()
        future = self.executor.execute(batch)
        if batch.record >= 0:
            rec = self.records[batch.record]
            self.records[batch.record] = dataclasses.replace(rec, launch_time=launched)
        return future

    def _finish(self, batch: ScheduledBatch, result, future: Optional[BatchFuture] = None) -> list:
        """Postprocess a returned batch (lock held) and publish what changed."""
        if future is not None:
            self._record_completion(batch, future)
        changed = self._postprocess(batch, result)
        if self.executor.error is not None:  # the workers are gone: nothing can run any more
            changed += self.abort_all("error", f"the engine stopped: {self.executor.error}")
        if self.publish is not None:
            self.publish(changed)
        return changed

    def shutdown(self) -> None:
        """Stop the executor (its worker processes, if any). Call after abort_all."""
        self.executor.shutdown()

    def _schedule(self) -> Optional[ScheduledBatch]:
        reqs = self.scheduler.schedule()
        if not reqs:
            return None
        if any(r.fork_of is not None for r in reqs):
            self._fork(reqs)
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
        rows = [r.logit_rows for r in reqs]
        return ScheduledBatch(index, reqs, inputs, record, dropped,
                              logit_rows=None if all(n == 1 for n in rows) else rows)

    def _record_completion(self, batch: ScheduledBatch, future: BatchFuture) -> None:
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
                if result.prompt_logprobs is not None and result.prompt_logprobs[i] is not None:
                    req.prompt_logprobs.extend(result.prompt_logprobs[i])
                if req.num_cached == len(req.prompt_token_ids):
                    self.num_prompt_tokens += req.num_cached
                elif req.prompt_remaining:
                    continue  # a prompt chunk that is not the last: its KV is cached, no token yet
                err = result.errors[i]
                if err is not None:
                    self._end(req, "error", err)
                elif req.params.max_tokens == 0:  # a scored prompt: nothing to generate
                    self._end(req, "length")
                else:
                    if result.logprobs is not None and req.logprobs is not None:
                        req.logprobs.append(result.logprobs[i])
                    try:
                        self._append_token(req, result.tokens[i])
                    except Exception as exc:  # e.g. a detokenizer error: only this request fails
                        log.exception("request %r failed in postprocessing", req.request_id)
                        self._end(req, "error", f"{type(exc).__name__}: {exc}")
            changed.append(req)
            if self._held and req in self._held and (req.finished or not req.prompt_remaining):
                self._release_held(req)
        self.scheduler.complete(batch.requests + batch.dropped)
        return changed

    def _move_slabs(self, moves: list) -> None:
        """The scheduler compacted the slabs: copy each moved request's cached KV rows from its
        old slab start to its new one, in the order given (the scheduler's slab_mover)."""
        rows = [(old, new, req.num_cached) for req, old, new in moves if req.num_cached > 0]
        if rows:
            self.executor.move_slabs(rows)
            self.compaction_moved_bytes += sum(n for _, _, n in rows) * self.executor.kv_bytes_per_slot()
        log.debug("slab compaction moved %d slabs (%d with cached KV)", len(moves), len(rows))

    def _copy_cached_rows(self, rows: list) -> None:
        """The scheduler's slab_copier: KV rows (src, dst, n) for the prefix cache (cached or
        already computed rows into a newly admitted slab; a leaving request's rows into its
        entry's slab). No launched batch writes those rows; issued now, so they land before any
        batch launched later."""
        self.executor.move_slabs(rows)
        self.prefix_copied_bytes += sum(n for _, _, n in rows) * self.executor.kv_bytes_per_slot()

    @property
    def num_compactions(self) -> int:
        return self.scheduler.num_compactions

    def _end(self, req: Request, reason: str, error: Optional[str] = None) -> None:
        """Set a request's finish reason once; it leaves the pool through the scheduler."""
        if not req.finished:
            req.mark_finished(reason, error)
            self.num_finished += 1
            self.executor.request_finished(req)
            if req in self._held:
                self._release_held(req)

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
