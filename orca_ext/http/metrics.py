"""Prometheus metrics of the HTTP server, in a private CollectorRegistry.

Two sources:
- per request, observed by the HTTP layer when a request ends: outcome counter and the
  TTFT / time-per-output-token / end-to-end latency histograms, computed from the
  RequestOutput timestamps (arrival_time, first_token_time, finish_time), so they measure
  the engine and not the network;
- engine state, read from ``server.stats()`` at scrape time by a custom collector: waiting,
  running, KV slots reserved/used, iterations, and the mean iteration time since the
  previous scrape = busy seconds / iterations run (``stats()["busy_seconds"]`` is the engine
  loop's time inside steps).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "orca"

# Latency buckets in seconds; CPU serving of small models spans milliseconds to minutes.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)

# Names of server.stats() keys we export with a specific metric (the rest as orca_engine_<key>).
_STAT_GAUGES = {
    "waiting": ("requests_waiting", "Requests admitted to the engine that wait for their first iteration."),
    "running": ("requests_running", "Requests the engine is generating for."),
    "slots_reserved": ("kv_slots_reserved", "KV-cache token slots reserved by admitted requests (Orca's n_rsrv)."),
    "slots_used": ("kv_slots_used", "KV-cache token slots holding computed tokens."),
    "n_slots": ("kv_slots_total", "KV-cache capacity in token slots."),
}
_STAT_COUNTERS = {
    "iterations": ("iterations", "Model iterations run by the engine."),
    "finished": ("engine_requests_finished", "Requests the engine has finished (any reason)."),
    "compactions": ("kv_slab_compactions", "Slab compactions: live KV slabs slid together to admit the queue head."),
    "compaction_moved_bytes": ("kv_slab_compaction_moved_bytes", "KV bytes copied by slab compactions."),
}
# server.stats()["prefix_cache"] (absent when prefix caching is off): key -> (name, doc, is a counter).
_PREFIX_CACHE = {
    "lookups": ("prefix_cache_lookups", "Admissions that looked up their prompt in the prefix cache.", True),
    "hits": ("prefix_cache_hits", "Admissions that started from cached KV rows.", True),
    "hit_tokens": ("prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache instead of computed.", True),
    "evictions": ("prefix_cache_evictions", "Prefix cache entries evicted (LRU) to make room for an admission.",
                  True),
    "share_evictions": ("prefix_cache_share_evictions",
                        "Prefix cache entries dropped to keep their client within its share of the slots.", True),
    "entries": ("prefix_cache_entries", "Prefix cache entries.", False),
    "cached_tokens": ("prefix_cache_tokens", "KV slots held by prefix cache entries (always evictable).", False),
    "cached_bytes": ("prefix_cache_bytes", "KV bytes held by prefix cache entries (always evictable).", False),
}


class _EngineCollector(Collector):
    """Reads server.stats() on every scrape."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats
        self._lock = threading.Lock()
        self._prev: tuple[float, float] | None = None  # (iterations, busy seconds) at the last scrape
        self._iter_time: float | None = None

    def _iteration_time(self, stats: dict) -> float | None:
        """Mean seconds per iteration since the last scrape; kept while no iteration runs."""
        iterations = float(stats["iterations"])
        busy = float(stats["busy_seconds"])
        with self._lock:
            if self._prev is not None:
                d_iter = iterations - self._prev[0]
                if d_iter > 0:
                    self._iter_time = max(0.0, busy - self._prev[1]) / d_iter
            self._prev = (iterations, busy)
            return self._iter_time

    def collect(self) -> Iterable:
        try:
            stats = self._stats()
        except Exception:  # a closed server has no stats; the scrape still works
            logger.debug("server.stats() failed during scrape", exc_info=True)
            return
        yield from _prefix_cache_metrics(stats.get("prefix_cache"))
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key in _STAT_COUNTERS:
                name, doc = _STAT_COUNTERS[key]
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
            elif key in _STAT_GAUGES:
                name, doc = _STAT_GAUGES[key]
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
            else:
                safe = "".join(c if c.isalnum() else "_" for c in key)
                yield GaugeMetricFamily(f"{PREFIX}_engine_{safe}", f"server.stats()['{key}']", value=value)
        iter_time = self._iteration_time(stats)
        if iter_time is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_iteration_seconds",
                "Mean duration of one engine iteration since the previous scrape (busy time / iterations).",
                value=iter_time,
            )


def _prefix_cache_metrics(cache: dict | None) -> Iterable:
    for key, (name, doc, counter) in _PREFIX_CACHE.items() if cache else ():
        family = CounterMetricFamily if counter else GaugeMetricFamily
        yield family(f"{PREFIX}_{name}", doc, value=cache[key])


class Metrics:
    """All collectors of one app. Thread-safe (prometheus_client metrics are)."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_http_requests", "Completion requests by endpoint and outcome "
            "(stop, length, abort = the client disconnected, error, rejected_queue_full, invalid, unauthorized, "
            "shutdown = ended or refused by the server's drain, rejected_too_many_errors, internal_error).",
            ["endpoint", "outcome"], registry=r)
        self.inflight = Gauge(f"{PREFIX}_http_requests_inflight",
                              "Requests admitted by the HTTP layer and not finished (bounded by --max-queue).",
                              registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens",
                                     "Prompt tokens of finished requests (each prompt once).", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "Generated tokens of finished requests (every sequence).", registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Arrival to first generated token, per sequence.", buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "(finish - first token) / (generated tokens - 1), per sequence.",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to finish, per sequence.",
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(stats))

    def observe_finished(self, endpoint: str, outcome: str, outputs: Sequence[Any], per_prompt: int = 1) -> None:
        """Record one request that the engine finished (`outcome`: its finish reason), with the
        final outputs of its sequences, `per_prompt` of each prompt (n > 1, a batch of prompts):
        each prompt's tokens count once, every sequence's generated tokens and latencies count."""
        self.requests.labels(endpoint, outcome or "unknown").inc()
        self.prompt_tokens.inc(sum(len(out.prompt_token_ids) for out in outputs[::per_prompt]))
        for out in outputs:
            n_out = len(out.token_ids)
            self.generation_tokens.inc(n_out)
            arrival, first, finish = out.arrival_time, out.first_token_time, out.finish_time
            if arrival is not None and first is not None:
                self.ttft.observe(max(0.0, first - arrival))
            if first is not None and finish is not None and n_out > 1:
                self.tpot.observe(max(0.0, (finish - first) / (n_out - 1)))
            if arrival is not None and finish is not None:
                self.e2e.observe(max(0.0, finish - arrival))

    def observe_rejected(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
