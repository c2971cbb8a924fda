"""Iteration-level scheduling: Algorithm 1 of the Orca paper (docs/DESIGN.md section 3), its
extensions (chunked prefill, slab compaction, fair admission: section 6; pipeline balance: 3) and the
request-level `static` baseline. Pure Python over request objects; no model, no threads.

A request object needs: `state` (RequestState), `reservation` (int), `slab_start` (int, -1 when
none), `finished` (bool), `prompt_remaining` (int), `emits_token` (bool), `client` (fair
admission's key) and `num_scheduled` (int, written here); fair admission also reads
`num_cached` (int, the position of the next prompt chunk). The engine marks requests finished;
the scheduler owns state transitions, slabs, the reservation count and the count of batches in
flight (`n_scheduled`). With a prefix cache attached (`attach_prefix_cache`, prefix_cache.py) it
also owns the cache entries' slabs and reads `output_token_ids`, `finish_reason`,
`prefix_cache_limit` and calls `start_from_cache` at admission.

Per iteration: batch = s.schedule(); run it; s.complete(batch). Up to n_workers batches may be
in flight; their requests are RUNNING and are not selected again until their batch completes.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

from .checks import check_positive_int
from .fairness import FairShares, kv_cap_slots
from .prefix_cache import PrefixCache, PrefixHit, common_prefix
from .request import RequestState

log = logging.getLogger(__name__)


def make_allocator(n_slots: int):
    try:
        from . import _C  # type: ignore[attr-defined]
    except ImportError:
        from .reference import SlabAllocatorReference
        log.warning("orca_ext._C is not built; using the slow pure-Python slab allocator")
        return SlabAllocatorReference(n_slots)
    return _C.SlabAllocator(n_slots)


class _SchedulerBase:
    """`config` (a resolved EngineConfig) gives the policy's limits: max_batch_size and, for the
    orca policy, max_num_batched_tokens (None: whole prompts), prefill_only_tokens (the budget of
    an iteration in which no request generates) and the admission policy.
    `n_slots` is the KV cache's capacity and `n_workers` the batches that may be in flight."""

    def __init__(self, config, n_slots: int, n_workers: int = 1, allocator=None):
        check_positive_int("n_slots", n_slots)
        check_positive_int("n_workers", n_workers)
        self.max_batch_size = config.max_batch_size
        self.n_slots = n_slots
        self.n_workers = n_workers
        self.max_num_batched_tokens = self._token_budget(config)  # None: whole prompts (plain Orca)
        self.prefill_only_tokens = self._prefill_only_budget(config)  # an iteration without decodes
        self.allocator = allocator if allocator is not None else make_allocator(n_slots)
        if self.allocator.n_slots != n_slots:
            raise ValueError(f"allocator has {self.allocator.n_slots} slots, scheduler {n_slots}")
        self.pool: list = []       # unfinished requests, arrival order
        self.n_rsrv = 0            # slots reserved by admitted requests
        self.n_scheduled = 0       # batches launched and not yet completed (owned here alone)
        # slab_mover(moves) copies the KV rows of [(holder, old_start, new_start)]; None: no
        # compaction. A holder is a request or a prefix cache entry: its first `num_cached` rows live.
        self.slab_mover: Optional[Callable[[list], None]] = None
        # Prefix caching (attach_prefix_cache): the index of cached rows in slots no request
        # reserves, and slab_copier(rows) for rows (src, dst, n) into a newly admitted slab.
        self.prefix_cache: Optional[PrefixCache] = None
        self.slab_copier: Optional[Callable[[list], None]] = None
        self.compaction_pending = False    # the head waits for in-flight batches before compacting
        self.num_compactions = 0
        self.num_fragmentation_stalls = 0  # selections where the head fit in total but not in one run

    @staticmethod
    def _token_budget(config) -> Optional[int]:
        return None

    def _prefill_only_budget(self, config) -> Optional[int]:
        """config.prefill_only_tokens (EngineConfig keeps it >= max_num_batched_tokens); None or
        not resolved for a device ('auto', as in a config built for a scheduler alone):
        max_num_batched_tokens."""
        value = config.prefill_only_tokens
        if self.max_num_batched_tokens is None or value is None or value == "auto":
            return self.max_num_batched_tokens
        return value

    def attach_prefix_cache(self, cache: PrefixCache, copier: Callable[[list], None]) -> None:
        """Keep finished requests' KV rows in `cache` and start admitted requests from them.
        `copier(rows)` copies KV rows (src, dst, n), ranges disjoint or overlapping as
        ops.slab_move allows, ordered before any batch launched after the call."""
        if cache.n_slots != self.n_slots:
            raise ValueError(f"prefix cache sized for {cache.n_slots} slots, scheduler has {self.n_slots}")
        self.prefix_cache = cache
        self.slab_copier = copier

    # -- pool -------------------------------------------------------------------------------
    def add(self, req) -> None:
        if req.reservation > self.n_slots:
            # The server validates this at submit; a request that can never fit would block FCFS forever.
            raise ValueError(f"request needs {req.reservation} slots but n_slots is {self.n_slots}")
        req.state = RequestState.INITIATION
        req.slab_start = -1
        self.pool.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.pool)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.pool if r.state is RequestState.INITIATION)

    @property
    def slots_allocated(self) -> int:
        """Slots in admitted requests' slabs (prefix cache entries' slots are not counted)."""
        cached = self.prefix_cache.cached_slots if self.prefix_cache is not None else 0
        return self.allocator.n_used - cached

    @property
    def num_running(self) -> int:
        """Admitted, unfinished requests (an aborted one may still sit in an executing batch)."""
        return sum(1 for r in self.pool if r.state is not RequestState.INITIATION and not r.finished)

    # -- Algorithm 1 main loop hooks ---------------------------------------------------------
    def schedule(self) -> list:
        """select() and launch: the returned requests are RUNNING (none while n_workers are in flight)."""
        if self.n_scheduled >= self.n_workers:
            return []
        if self.compaction_pending:
            if self.n_scheduled > 0:
                return []  # slabs move only once no batch that reads or writes them is executing
            self.compaction_pending = False
        batch = self._select()
        if batch:
            for req in batch:
                req.state = RequestState.RUNNING
            self.n_scheduled += 1
        return batch

    def complete(self, batch: list) -> None:
        """A launched batch returned: its requests become INCREMENT, finished ones leave the pool
        and give back their reservation before the next selection."""
        if self.n_scheduled < 1:
            raise RuntimeError("complete() without a scheduled batch")
        self.n_scheduled -= 1
        for req in batch:
            if req.finished:
                self._release(req)
            elif req.state is RequestState.RUNNING:
                req.state = RequestState.INCREMENT

    def abandon_batches(self) -> None:
        """Every launched batch is given up (shutdown, or a loop error lost its result): nothing
        is executing any more, so RUNNING requests become INCREMENT and none count as in flight."""
        for req in self.pool:
            if req.state is RequestState.RUNNING:
                req.state = RequestState.INCREMENT
        self.n_scheduled = 0

    def remove(self, req) -> None:
        """A finished request ended outside a batch return (abort, shutdown). Its slab is freed now,
        unless it is inside a running batch, which may be writing it: then complete() frees it."""
        if req.state is RequestState.RUNNING or req.state is RequestState.RELEASED:
            return
        self._release(req)

    # -- admission -----------------------------------------------------------------------------
    def _admit(self, req) -> bool:
        need = req.reservation
        if self.n_rsrv + need > self.n_slots:
            return False
        cache = self.prefix_cache
        hit = self._lookup(req) if cache is not None else None
        start = self.allocator.allocate(need)
        if cache is not None:
            # Cached rows live in slots nobody reserves: evict least recently used entries until
            # the slab fits (this client's own first, the hit's entry last), so caching never
            # delays an admission.
            while start < 0:
                victim = cache.evict_lru(keep=hit.entry if hit else None, client=req.client)
                if victim is None:
                    break
                self.allocator.free(victim.slab_start)
                start = self.allocator.allocate(need)
            if start < 0 and hit is not None and hit.entry in cache.entries:
                # Its rows stay intact in the freed slots until the copy below, which comes
                # before anything else can write there (or the slab lands on them: no copy).
                cache.evict(hit.entry)
                self.allocator.free(hit.entry.slab_start)
                start = self.allocator.allocate(need)
        if start < 0 and self._compact():  # enough slots in total but no contiguous run
            hit = None  # compaction may have moved live slabs over a freed entry's rows
            start = self.allocator.allocate(need)
        if start < 0:  # wait, as FCFS requires
            self.num_fragmentation_stalls += 1
            return False
        req.slab_start = start
        self.n_rsrv += need
        if cache is not None and req.prefix_cache_limit > 0:
            self._start_from_cache(req, hit)
        return True

    def _lookup(self, req) -> Optional[PrefixHit]:
        """The request's longest cached prompt prefix, leaving at least one prompt token to
        compute (its logits give the first output token): from a cache entry, or from an
        admitted request that has computed it (requests that arrive together with the same
        system prompt: the first computes it, the next ones copy it)."""
        limit = req.prefix_cache_limit
        if limit < 1:
            return None
        prompt = req.prompt_token_ids
        hit = self.prefix_cache.lookup(prompt, limit)
        best = hit.n_tokens if hit is not None else self.prefix_cache.block_size - 1
        for other in self.pool:
            if other.slab_start < 0 or other.num_cached <= best or other.prompt_token_ids[:1] != prompt[:1]:
                continue
            computed = other.prompt_token_ids
            if other.num_cached > len(computed):
                computed = computed + other.output_token_ids
            n = common_prefix(computed, prompt, 0, min(limit, other.num_cached))
            if n > best:
                hit, best = PrefixHit(other, n), n
        return hit

    def _start_from_cache(self, req, hit: Optional[PrefixHit]) -> None:
        """Fill the newly admitted slab's first rows from the hit: the request then prefills
        only the rest, as a chunk at position hit.n_tokens."""
        self.prefix_cache.record_lookup(hit, used=hit is not None)
        if hit is None:
            return
        src = hit.source.slab_start
        if src != req.slab_start:
            self.slab_copier([(src, req.slab_start, hit.n_tokens)])
        req.start_from_cache(hit.n_tokens)

    def _compact(self) -> bool:
        """Slide every live slab toward slot 0 so that the free slots form one run; True when it
        did. A slab that an executing batch may read or write never moves: with batches in
        flight this only asks schedule() to let them return first."""
        if self.slab_mover is None:
            return False
        if self.n_scheduled > 0:
            self.compaction_pending = True
            return False
        owner = {r.slab_start: r for r in self.pool if r.slab_start >= 0}
        if self.prefix_cache is not None:
            owner.update((e.slab_start, e) for e in self.prefix_cache.entries)
        moves = []
        for old, new, _ in self.allocator.compact():
            owner[old].slab_start = new
            moves.append((owner[old], old, new))
        self.slab_mover(moves)
        self.num_compactions += 1
        log.debug("compacted the KV slabs: %d moved", len(moves))
        return True

    @staticmethod
    def _take(req, n_tokens: int) -> int:
        """Put `n_tokens` of the request's next input into this iteration; returns n_tokens."""
        req.num_scheduled = n_tokens
        return n_tokens

    def _release(self, req) -> None:
        if req.state is RequestState.RELEASED:
            return
        self.pool.remove(req)
        if req.slab_start >= 0:
            self.allocator.free(req.slab_start)
            if self.prefix_cache is not None:
                self._cache_rows(req)
            req.slab_start = -1
            self.n_rsrv -= req.reservation
        req.state = RequestState.RELEASED

    def _cache_rows(self, req) -> None:
        """Keep a leaving request's cached rows (prompt and generated tokens) as a prefix cache
        entry, in a slab of exactly those rows carved from the one just freed (copied down when
        the allocator places it elsewhere). Not after an error: its rows may be incomplete."""
        cache = self.prefix_cache
        tokens = (req.prompt_token_ids + req.output_token_ids)[:req.num_cached]
        if req.finish_reason == "error" or not cache.worth_caching(tokens):
            return
        start = self.allocator.allocate(len(tokens))  # fits: the freed slab alone is larger
        if start != req.slab_start:
            self.slab_copier([(req.slab_start, start, len(tokens))])
        for dropped in cache.insert(start, tokens, req.client):
            self.allocator.free(dropped.slab_start)

    def clear_prefix_cache(self) -> None:
        """Free every cache entry's slab."""
        if self.prefix_cache is not None:
            for entry in self.prefix_cache.clear():
                self.allocator.free(entry.slab_start)


class OrcaScheduler(_SchedulerBase):
    """Iteration-level scheduling: every iteration re-selects from the whole pool."""

    @staticmethod
    def _token_budget(config) -> Optional[int]:
        if config.max_num_batched_tokens == "auto":
            raise ValueError("max_num_batched_tokens='auto' must be resolved first (EngineConfig.resolve())")
        return config.max_num_batched_tokens

    def _select(self) -> list:
        batch = []
        budget = self.max_num_batched_tokens or math.inf  # tokens this iteration may still take
        # Decodes first, one token each: a long prompt never holds up a running request's token.
        decodes = self._decode_limit()
        for req in self._decode_order():
            if len(batch) == decodes:
                break
            budget -= self._take(req, 1)
            batch.append(req)
        # Then prompts, whole or their next chunk, in arrival order (FCFS) until the budget is spent.
        # While no request generates, no stream waits on this iteration: it takes larger chunks.
        if not batch and not self._generating():
            budget = self.prefill_only_tokens or math.inf
        prompts = self._prompt_order()
        while len(batch) < self.max_batch_size and budget > 0:
            req = next(prompts, None)
            if req is None or (req.slab_start < 0 and not self._admit(req)):
                break  # no skipping: a request that does not fit blocks everything behind it
            budget -= self._take(req, min(req.prompt_remaining, budget))
            batch.append(req)
        return batch

    def _generating(self) -> bool:
        """Some request generates: its whole prompt is cached (its token ready, or a decode in a
        batch in flight), or its prompt's last chunk runs in a batch in flight."""
        return any(r.prompt_remaining == 0 or (r.state is RequestState.RUNNING and r.emits_token)
                   for r in self.pool)

    def _decode_order(self):
        """Requests whose next input is one generated token, in arrival order."""
        return (r for r in self.pool if r.state is RequestState.INCREMENT and r.prompt_remaining == 0)

    def _prompt_order(self):
        """Requests with prompt tokens to run (waiting, or admitted with a chunk left), in arrival order."""
        return (r for r in self.pool if r.state is not RequestState.RUNNING and r.prompt_remaining)

    def _decode_limit(self) -> int:
        """max_batch_size, and with n_workers > 1 an even share of the admitted requests (DESIGN section 3)."""
        n_workers = self.n_workers
        return self.max_batch_size if n_workers == 1 else min(self.max_batch_size, -(-self.num_running // n_workers))


class FairScheduler(OrcaScheduler):
    """The orca policy with client-aware admission (fairness.py). `config.max_kv_per_client` (a
    share of the slots, a slot count, 'auto' or None) becomes a cap in slots of this cache;
    `config.share_decode_rows` holds a client that is ahead to the others' decode rows."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if config.share_decode_rows is None:
            raise ValueError("share_decode_rows=None must be resolved first (EngineConfig.resolve())")
        self.share_decode_rows = config.share_decode_rows
        self.max_kv_per_client = kv_cap_slots(config.max_kv_per_client, self.n_slots)
        self.shares = FairShares(self.max_kv_per_client, self.max_num_batched_tokens)

    def _select(self) -> list:
        self.shares.begin()
        batch = super()._select()
        if not batch:  # only held decode rows were ready: one runs rather than none
            req = self.shares.release_held()
            if req is not None:
                self._take(req, 1)
                batch.append(req)
        return batch

    def _take(self, req, n_tokens: int) -> int:
        return super()._take(req, self.shares.take(req, n_tokens))

    def complete(self, batch: list) -> None:
        for req in batch:
            if req.finished:
                self.shares.finished(req)
        super().complete(batch)

    def _decode_order(self):
        ready = super()._decode_order()
        return self.shares.decode_rows(list(ready), self.pool) if self.share_decode_rows else ready

    def _prompt_order(self):
        return self.shares.order(self.pool, self._admit)


class StaticScheduler(_SchedulerBase):
    """Request-level batching baseline: a batch runs until all its members finish; only then are
    new requests admitted. Members that finish early leave (and free their slab) at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # whole prompts: the token budget is the orca policy's
        self.current: list = []

    def _select(self) -> list:
        live = [r for r in self.current if r.state is not RequestState.RELEASED]
        if live:
            self.current = live
            return [r for r in live if r.state is not RequestState.RUNNING]
        self.current = []
        for req in self.pool:  # all INITIATION here: the previous batch has fully left
            if len(self.current) == self.max_batch_size or not self._admit(req):
                break
            self.current.append(req)
        return list(self.current)


SCHEDULERS = {"orca": OrcaScheduler, "static": StaticScheduler}


def make_scheduler(config, n_slots: int, n_workers: int = 1, allocator: Optional[object] = None) -> _SchedulerBase:
    """The scheduler of `config.scheduler` ('orca' or 'static') and `config.admission` over n_slots KV slots."""
    policy = FairScheduler if config.admission == "fair" else SCHEDULERS[config.scheduler]
    return policy(config, n_slots, n_workers, allocator)
