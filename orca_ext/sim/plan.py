"""Capacity planning: the cheapest deployment (replicas x TP x PP x max_batch_size) whose
simulated service of a trace meets a latency SLO.

Assumptions: replicas are identical and a load balancer deals requests round-robin, so a replica
of r serves every r-th request of the trace (arrival times unchanged) and the fleet meets the SLO
when that replica does; each replica's KV cache is what its GPUs' memory holds after the weights
(cost.kv_slots). Cost is the number of GPUs; among equals, the lower median normalised latency.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import EngineConfig
from .cost import Hardware, ModelShape, Roofline, kv_slots
from .loop import simulate
from .trace import TraceRequest

MAX_SIM_SLOTS = 1 << 22  # KV slots simulated per replica: more than any trace here can hold at once


@dataclass(frozen=True)
class SLO:
    median_normalized_latency_s: Optional[float] = None   # E2E latency / output tokens, median
    p99_ttft_s: Optional[float] = None

    def met(self, summary: dict) -> bool:
        return ((self.median_normalized_latency_s is None
                 or summary["median_normalized_latency_s"] <= self.median_normalized_latency_s)
                and (self.p99_ttft_s is None or summary["p99_ttft_s"] <= self.p99_ttft_s))


@dataclass(frozen=True)
class Candidate:
    replicas: int
    tp: int
    pp: int
    max_batch_size: int
    summary: dict
    meets_slo: bool

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp * self.pp


def layouts(shape: ModelShape, hw: Hardware, tps: Sequence[int], pps: Sequence[int], longest: int) -> list:
    """(tp, pp, n_slots) that divide the model evenly and hold its weights and the longest request."""
    out = []
    for tp in tps:
        for pp in pps:
            if shape.n_heads % tp or shape.n_kv_heads % tp or shape.n_layers % pp:
                continue
            slots = kv_slots(shape, hw, tp, pp, cap=MAX_SIM_SLOTS)
            if slots >= longest:
                out.append((tp, pp, slots))
    return out


def plan(trace: Sequence[TraceRequest], shape: ModelShape, hw: Hardware, slo: SLO, *,
         tps: Sequence[int] = (1, 2, 4, 8), pps: Sequence[int] = (1, 2, 4),
         batch_sizes: Sequence[int] = (8, 16, 32, 64, 128), max_replicas: int = 16,
         config: EngineConfig = EngineConfig()) -> tuple[Optional[Candidate], list[Candidate]]:
    """(the cheapest candidate meeting `slo` or None, every candidate simulated). For each layout
    and batch size, replicas grow from 1 until the SLO is met (or max_replicas)."""
    longest = max(r.prompt_len + r.output_len for r in trace)
    tried = []
    for tp, pp, slots in layouts(shape, hw, tps, pps, longest):
        cost = Roofline(shape, hw, tp=tp, pp=pp)
        for mbs in batch_sizes:
            cfg = dataclasses.replace(config, max_batch_size=mbs, tensor_parallel_size=tp, pipeline_parallel_size=pp)
            for replicas in range(1, max_replicas + 1):
                share = list(trace[::replicas])
                summary = simulate(share, cfg, cost, slots, shape.kv_bytes_per_token, hw.device_type).summary()
                tried.append(Candidate(replicas, tp, pp, mbs, summary, slo.met(summary)))
                if tried[-1].meets_slo:
                    break
    ok = [c for c in tried if c.meets_slo]
    best = min(ok, key=lambda c: (c.gpus, c.summary["median_normalized_latency_s"])) if ok else None
    return best, tried


def table(candidates: Sequence[Candidate], best: Optional[Candidate]) -> str:
    """Markdown: the fewest replicas of each layout and batch size that met the SLO (or the most tried)."""
    last = {}
    for c in candidates:
        last[(c.tp, c.pp, c.max_batch_size)] = c
    rows = sorted(last.values(), key=lambda c: (not c.meets_slo, c.gpus, c.summary["median_normalized_latency_s"]))
    out = ["| GPUs | replicas | TP | PP | max_batch_size | tokens/s per replica | median norm. latency (s/token) "
           "| p99 TTFT (s) | meets SLO |", "|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        s = c.summary
        mark = "**best**" if c == best else ("yes" if c.meets_slo else "no")
        out.append(f"| {c.gpus} | {c.replicas} | {c.tp} | {c.pp} | {c.max_batch_size} | {s['output_tokens_per_s']:.1f} "
                   f"| {s['median_normalized_latency_s']:.4f} | {s['p99_ttft_s']:.3f} | {mark} |")
    return "\n".join(out)


def plot(candidates: Sequence[Candidate], slo: SLO, path: str) -> None:
    """Median normalised latency against GPUs, one line per (TP, PP, max_batch_size); filled
    markers meet the SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict = {}
    for c in candidates:
        lines.setdefault((c.tp, c.pp, c.max_batch_size), []).append(c)
    for (tp, pp, mbs), cs in sorted(lines.items()):
        line, = ax.plot([c.gpus for c in cs], [c.summary["median_normalized_latency_s"] for c in cs], lw=1,
                        label=f"TP{tp} PP{pp} b{mbs}")
        for c in cs:  # filled: meets the whole SLO (TTFT included); hollow: misses it
            ax.plot(c.gpus, c.summary["median_normalized_latency_s"], "o", ms=4, color=line.get_color(),
                    mfc=line.get_color() if c.meets_slo else "none")
    if slo.median_normalized_latency_s is not None:
        ax.axhline(slo.median_normalized_latency_s, color="k", ls="--", lw=1, label="SLO")
    ax.set_xlabel("GPUs (replicas x TP x PP)")
    ax.set_ylabel("median normalised latency (s/token)")
    ax.set_yscale("log")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
