"""Exact prefix caching on KV slabs (docs/DESIGN.md section 6, "Prefix caching").

A finished request's slab is not freed at once: its first `num_cached` KV rows, the K/V of its
prompt and generated tokens, stay in slab space that no running request owns, as a cache entry.
A later request whose prompt starts with the same tokens gets its own slab as always, and the
scheduler copies the matching rows into it (or takes the entry's slab over in place); the
request then prefills only the rest, as a chunk starting at position = hit length.

The index keys token blocks of `block_size` with a hash chain: block i's key is a digest of
block i-1's key and block i's tokens, so a key names a whole prefix and an entry that holds
block i's key holds blocks 0..i. Past the last full block that matches, a hit extends token by
token into the entry's tail, and every hit is checked against the entry's tokens (a digest
collision can never hand out wrong rows).

Memory policy: entries live only in slots that no admitted request reserves (`n_rsrv` does not
count them) and are always evictable. The scheduler evicts least recently used entries whenever
an admission cannot otherwise allocate its slab (the admitting client's own entries first, so a
client takes others' entries only for slots its own requests reserve), so caching never delays
an admission. An entry
holds exactly its cached rows (the slab is cut to them when the request leaves). One request
inserts at most one entry of its own tokens, and one client's entries hold at most an equal
share of the slots between the clients that have entries (its own oldest go first), so a client
that sends a stream of unique prompts cannot fill the cache with them.

This module is bookkeeping only: which slots hold which tokens. It allocates and frees nothing
itself; the scheduler owns the allocator and asks the executor to copy rows.
"""
from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections import OrderedDict
from typing import Any, Hashable, Optional, Sequence

DEFAULT_BLOCK_SIZE = 16
_ROOT = b"orca-prefix-root"


def block_keys(tokens: Sequence[int], block_size: int, n_blocks: Optional[int] = None) -> list[bytes]:
    """The chain keys of the first n_blocks full blocks of `tokens` (default: all full blocks)."""
    full = len(tokens) // block_size
    n = full if n_blocks is None else min(n_blocks, full)
    keys, prev = [], _ROOT
    for b in range(n):
        block = array("q", tokens[b * block_size:(b + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        keys.append(prev)
    return keys


def common_prefix(a: Sequence[int], b: Sequence[int], start: int, stop: int) -> int:
    """The largest n <= stop with a[start:n] == b[start:n] (n >= start). Binary search over
    slice comparisons (prefix equality is monotone), so the token loop runs in C."""
    a, b = list(a), list(b)
    lo, hi = start, max(start, min(stop, len(a), len(b)))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclasses.dataclass(eq=False)
class CacheEntry:
    """Cached KV rows: rows [0, num_cached) of the slab at slab_start hold the K/V of `tokens`
    (the slab is exactly num_cached slots long)."""

    slab_start: int
    tokens: tuple[int, ...]
    keys: list[bytes]
    client: Optional[Hashable] = None

    @property
    def num_cached(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The first `n_tokens` tokens of a prompt have their KV rows at the start of `source`'s
    slab: a cache entry, or an admitted request that has computed them (its first num_cached
    rows are final: its batches write only later rows)."""

    source: Any  # CacheEntry or Request: anything with slab_start
    n_tokens: int

    @property
    def entry(self) -> Optional["CacheEntry"]:
        return self.source if isinstance(self.source, CacheEntry) else None


@dataclasses.dataclass
class PrefixCacheStats:
    lookups: int = 0            # admissions that consulted the index
    hits: int = 0               # of them, admissions that started from cached rows
    hit_tokens: int = 0         # prompt tokens taken from the cache instead of computed
    live_hits: int = 0          # of the hits, those copied from a request still in the pool
    inserted: int = 0           # entries made from finished requests
    evictions: int = 0          # entries dropped to make room for an admission (LRU)
    superseded: int = 0         # entries dropped because a newer one holds all their tokens
    share_evictions: int = 0    # entries dropped to keep their client within its share


class PrefixCache:
    """The index of cache entries, in least recently used order. `n_slots` is the KV cache's
    capacity (for the per-client share)."""

    def __init__(self, n_slots: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.n_slots = n_slots
        self.block_size = block_size
        self.entries: OrderedDict[CacheEntry, None] = OrderedDict()  # least recently used first
        self.index: dict[bytes, dict[CacheEntry, None]] = {}         # key -> entries holding it
        self.slots_by_client: dict = {}
        self.stats = PrefixCacheStats()

    # -- views -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    @property
    def cached_slots(self) -> int:
        """Slots held by entries (each entry holds exactly its cached rows)."""
        return sum(self.slots_by_client.values())

    # -- lookup --------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], limit: int) -> Optional[PrefixHit]:
        """The longest cached prefix of `tokens`, at most `limit` tokens (the caller keeps at
        least one token to compute), or None. Counting it and refreshing its entry is
        `record_lookup`'s, once the admission has used it."""
        bs = self.block_size
        holders, n_blocks = None, 0
        for key in block_keys(tokens, bs, max(0, limit) // bs):
            found = self.index.get(key)
            if not found:
                break
            holders, n_blocks = found, n_blocks + 1
        if holders is None:
            return None
        matched = n_blocks * bs
        best: Optional[PrefixHit] = None
        head = tuple(tokens[:matched])
        for entry in reversed(holders):  # most recently inserted first
            if entry.tokens[:matched] != head:
                continue  # a digest collision: these rows are not this prompt's
            n = common_prefix(entry.tokens, tokens, matched, limit)
            if best is None or n > best.n_tokens:
                best = PrefixHit(entry, n)
        return best

    def record_lookup(self, hit: Optional[PrefixHit], used: bool) -> None:
        """An admission consulted the index; `used`: it started from the hit's rows."""
        self.stats.lookups += 1
        if hit is not None and used:
            self.stats.hits += 1
            self.stats.hit_tokens += hit.n_tokens
            if hit.entry is None:
                self.stats.live_hits += 1
            elif hit.entry in self.entries:
                self.entries.move_to_end(hit.entry)

    # -- insertion -------------------------------------------------------------------------------
    def worth_caching(self, tokens: Sequence[int]) -> bool:
        """Whether an entry of `tokens` would add a block the index does not have."""
        keys = block_keys(tokens, self.block_size)
        return bool(keys) and keys[-1] not in self.index

    def insert(self, slab_start: int, tokens: Sequence[int], client: Optional[Hashable] = None) -> list[CacheEntry]:
        """Index the rows of a slab of exactly len(tokens) slots at slab_start. Returns the
        entries this drops (their slabs are the caller's to free): older entries whose tokens
        the new one holds, and the client's oldest entries past its share; the new entry itself
        when it alone is past the share (then it is not cached)."""
        tokens = tuple(tokens)
        entry = CacheEntry(slab_start, tokens, block_keys(tokens, self.block_size), client)
        if not entry.keys:
            raise ValueError(f"an entry needs at least one full block of {self.block_size} tokens")
        dropped = [old for old in self.index.get(entry.keys[0], ()) if self._holds(entry, old)]
        for old in dropped:
            self._drop(old)
            self.stats.superseded += 1
        self._add(entry)
        self.stats.inserted += 1
        share = self.n_slots // max(1, len(self.slots_by_client))
        while self.slots_by_client.get(client, 0) > share:
            oldest = next(e for e in self.entries if e.client == client)
            self._drop(oldest)
            self.stats.share_evictions += 1
            dropped.append(oldest)
        return dropped

    @staticmethod
    def _holds(new: CacheEntry, old: CacheEntry) -> bool:
        """Whether `new` holds every token of `old` (so `old` can go)."""
        n = len(old.keys)
        return (old.num_cached <= new.num_cached and new.keys[n - 1] == old.keys[-1]
                and new.tokens[:old.num_cached] == old.tokens)

    # -- removal ---------------------------------------------------------------------------------
    def evict_lru(self, keep: Optional[CacheEntry] = None, client: Optional[Hashable] = None) -> Optional[CacheEntry]:
        """Drop the least recently used entry other than `keep`, `client`'s own entries first
        (an admission makes room from its own client's entries before anyone else's); returns
        it (None: none left)."""
        mine = self.slots_by_client.get(client, 0) > 0
        for pass_mine in ((True, False) if mine else (False,)):
            for entry in self.entries:
                if entry is not keep and (not pass_mine or entry.client == client):
                    self._drop(entry)
                    self.stats.evictions += 1
                    return entry
        return None

    def evict(self, entry: CacheEntry) -> None:
        """Drop this entry to make room for an admission."""
        self._drop(entry)
        self.stats.evictions += 1

    def clear(self) -> list[CacheEntry]:
        """Drop every entry; returns them (their slabs are the caller's to free)."""
        entries = list(self.entries)
        for entry in entries:
            self._drop(entry)
        return entries

    # -- internals -------------------------------------------------------------------------------
    def _add(self, entry: CacheEntry) -> None:
        self.entries[entry] = None
        for key in entry.keys:
            self.index.setdefault(key, {})[entry] = None
        self.slots_by_client[entry.client] = self.slots_by_client.get(entry.client, 0) + entry.num_cached

    def _drop(self, entry: CacheEntry) -> None:
        del self.entries[entry]
        for key in entry.keys:
            holders = self.index[key]
            del holders[entry]
            if not holders:
                del self.index[key]
        left = self.slots_by_client[entry.client] - entry.num_cached
        if left:
            self.slots_by_client[entry.client] = left
        else:
            del self.slots_by_client[entry.client]
