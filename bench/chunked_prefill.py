"""Chunked prefill on CPU: time per output token with and without a token budget, in one run.

Two measurements:

1. Iteration cost vs tokens per iteration (`--cost`): one forward of 16 decodes plus a prompt
   chunk of C tokens, for a sweep of C. The per-token cost falls while the GEMMs get more rows to
   amortise each weight read over, then flattens; a budget past the knee buys no throughput, only
   longer iterations (= longer stalls for every running decode). This picks the default.
2. Serving (`--serve`): the latency-throughput workload (Poisson arrivals, prompts U[8,128],
   outputs U[1,128]) plus long prompts U[256,1024] for a fraction of the requests, through the
   in-process Server with asyncio clients, at a few arrival rates; budgets take turns at each rate
   (same seeded workload). Reported: output tok/s, TPOT (per request: (finish - first token) /
   (tokens - 1)) p50/p99, inter-token gap p99 and max (the stalls a long prompt causes), TTFT p50.

Outputs under --out-prefix: .json, .md and .png (TPOT p99 vs throughput per budget, and the
iteration cost curve).

    python bench/chunked_prefill.py --cost --serve [--rates 0.15 0.3 0.6 1.0] [--budgets none 128 256]

A run with --serve keeps the rates of an earlier run that it does not measure again.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a checkout without an install

log = logging.getLogger("bench.chunked_prefill")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


# -- 1. iteration cost vs tokens ----------------------------------------------------------------------
def iteration_cost(chunks: list[int], batch_invariant: bool, n_decodes: int = 16, repeat: int = 5) -> list[dict]:
    from orca_ext import modes
    from orca_ext.default_model import default_model_path
    from orca_ext.models import ForwardBatch, load_model

    model = load_model(default_model_path(), device="cpu", dtype=torch.float32)
    model.allocate_kv_cache(8192)
    rng = random.Random(0)
    rows = []
    for c in chunks:
        # 16 decodes over 256-token contexts, then a chunk of c prompt tokens over a 256-token prefix.
        inputs = [([rng.randrange(1000, 40000)], 256, 300 * i) for i in range(n_decodes)]
        inputs.append(([rng.randrange(1000, 40000) for _ in range(c)], 256, 300 * n_decodes))
        batch = ForwardBatch.build(inputs)
        with modes.using(batch_invariant=batch_invariant):  # True: the CPU default of Server
            model.forward(batch)  # warm-up
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                model.forward(batch)
                times.append(time.perf_counter() - t0)
        best = min(times)
        rows.append({"chunk": c, "tokens": c + n_decodes, "iteration_ms": 1e3 * best,
                     "ms_per_token": 1e3 * best / (c + n_decodes)})
        print(f"  chunk {c:5d}: iteration {1e3 * best:8.1f} ms, {1e3 * best / (c + n_decodes):6.2f} ms/token")
    return rows


# -- 2. serving ----------------------------------------------------------------------------------------
def make_jobs(n: int, rate: float, long_fraction: float, seed: int) -> list[tuple[float, list[int], int]]:
    """[(arrival s, prompt ids, output tokens)]: Poisson arrivals, a fraction with long prompts."""
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        lo, hi = (256, 1024) if rng.random() < long_fraction else (8, 128)
        jobs.append((t, [rng.randrange(1000, 40000) for _ in range(rng.randint(lo, hi))], rng.randint(1, 128)))
    return jobs


async def drive(server, jobs) -> tuple[list[dict], float]:
    from orca_ext.sampling import SamplingParams

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    records: list[dict] = []

    async def one(arrival: float, prompt: list[int], n: int) -> None:
        await asyncio.sleep(max(0.0, t0 + arrival - loop.time()))
        stamps, seen, out = [], 0, None
        async for out in server.generate_async(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
            now = time.perf_counter()
            stamps += [now] * (len(out.token_ids) - seen)
            seen = len(out.token_ids)
        records.append({"prompt": len(prompt), "output": len(out.token_ids), "ttft": out.first_token_time - out.arrival_time,
                        "tpot": (out.finish_time - out.first_token_time) / (len(out.token_ids) - 1)
                        if len(out.token_ids) > 1 else None,
                        "gaps": [b - a for a, b in zip(stamps, stamps[1:])]})

    start = time.perf_counter()
    await asyncio.gather(*(one(*job) for job in jobs))
    return records, time.perf_counter() - start


def summarize(records: list[dict], elapsed: float, budget, rate: float) -> dict:
    tpot = [r["tpot"] * 1e3 for r in records if r["tpot"] is not None]
    gaps = [g * 1e3 for r in records for g in r["gaps"]]
    return {"budget": budget, "rate": rate, "requests": len(records), "elapsed_s": elapsed,
            "output_tok_s": sum(r["output"] for r in records) / elapsed,
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
            "gap_ms_p99": pct(gaps, 99), "gap_ms_max": max(gaps, default=float("nan")),
            "ttft_ms_p50": pct([r["ttft"] * 1e3 for r in records], 50),
            "long_prompts": sum(r["prompt"] >= 256 for r in records)}


def serve_sweep(args) -> list[dict]:
    from orca_ext.server import Server

    servers = {b: Server(device="cpu", dtype="float32", n_slots=16384, max_batch_size=32,
                         max_num_batched_tokens=b) for b in args.budgets}
    rows = []
    try:
        for i, rate in enumerate(args.rates):
            jobs = make_jobs(args.requests, rate, args.long_fraction, seed=100 + i)
            for budget, server in servers.items():
                server.generate([[1000, 1001, 1002]], None)  # warm-up, not measured
                records, elapsed = asyncio.run(drive(server, jobs))
                row = summarize(records, elapsed, budget, rate)
                rows.append(row)
                print(f"  rate {rate:g}/s budget {budget}: {row['output_tok_s']:.1f} tok/s, TPOT p50 "
                      f"{row['tpot_ms_p50']:.0f} p99 {row['tpot_ms_p99']:.0f} ms, gap p99 {row['gap_ms_p99']:.0f} "
                      f"max {row['gap_ms_max']:.0f} ms, TTFT p50 {row['ttft_ms_p50']:.0f} ms")
    finally:
        for server in servers.values():
            server.shutdown()
    return rows


# -- report --------------------------------------------------------------------------------------------
def write_markdown(data: dict, path: Path) -> None:
    lines = [f"# Chunked prefill on CPU ({data['date']}, {data['machine']}, {data['threads']} threads)", ""]
    if data.get("cost"):
        lines += ["Iteration cost: 16 decodes + one prompt chunk of C tokens (SmolLM2-135M, float32, "
                  "batch-invariant kernels as on CPU by default).", "",
                  "| chunk C | tokens | iteration (ms) | ms per token |", "|---|---|---|---|"]
        lines += [f"| {r['chunk']} | {r['tokens']} | {r['iteration_ms']:.1f} | {r['ms_per_token']:.2f} |"
                  for r in data["cost"]]
        lines.append("")
    if data.get("serve"):
        m = data["serve_meta"]
        lines += [f"Serving: {m['requests']} requests per rate, Poisson arrivals, prompts U[8,128] and "
                  f"{100 * m['long_fraction']:.0f}% long prompts U[256,1024], outputs U[1,128].", "",
                  "| rate (req/s) | budget | output tok/s | TPOT p50 (ms) | TPOT p99 (ms) | gap p99 (ms) | "
                  "gap max (ms) | TTFT p50 (ms) |", "|---|---|---|---|---|---|---|---|"]
        for r in data["serve"]:
            lines.append(f"| {r['rate']:g} | {r['budget'] or 'none'} | {r['output_tok_s']:.1f} | "
                         f"{r['tpot_ms_p50']:.0f} | {r['tpot_ms_p99']:.0f} | {r['gap_ms_p99']:.0f} | "
                         f"{r['gap_ms_max']:.0f} | {r['ttft_ms_p50']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if data.get("serve"):
        ax = axes[0]
        for budget in dict.fromkeys(r["budget"] for r in data["serve"]):
            pts = sorted((r for r in data["serve"] if r["budget"] == budget), key=lambda r: r["rate"])
            label = f"budget {budget}" if budget else "no budget (whole prompts)"
            ax.plot([r["output_tok_s"] for r in pts], [r["tpot_ms_p99"] for r in pts], marker="o", label=label)
            ax.plot([r["output_tok_s"] for r in pts], [r["tpot_ms_p50"] for r in pts], marker=".", ls=":",
                    color=ax.lines[-1].get_color())
        ax.set_xlabel("throughput (output tokens/s)")
        ax.set_ylabel("TPOT (ms): p99 solid, p50 dotted")
        ax.set_title("latency-throughput workload + 25% prompts U[256,1024]", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if data.get("cost"):
        ax = axes[1]
        ax.plot([r["chunk"] for r in data["cost"]], [r["ms_per_token"] for r in data["cost"]], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt chunk C (tokens) beside 16 decodes")
        ax.set_ylabel("ms per token")
        ax2 = ax.twinx()
        ax2.plot([r["chunk"] for r in data["cost"]], [r["iteration_ms"] for r in data["cost"]], marker="s",
                 color="tab:red", ls="--")
        ax2.set_ylabel("iteration (ms)", color="tab:red")
        ax.set_title("iteration cost vs chunk size (SmolLM2-135M, float32)", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost", action="store_true", help="measure iteration cost vs chunk size")
    p.add_argument("--serve", action="store_true", help="run the serving comparison")
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--rates", type=float, nargs="+", default=[0.15, 0.3, 0.6, 1.0])
    p.add_argument("--budgets", nargs="+", default=["none", "128", "256"],
                   help="token budgets to compare ('none' = whole prompts)")
    p.add_argument("--requests", type=int, default=24, help="requests per rate")
    p.add_argument("--long-fraction", type=float, default=0.25)
    p.add_argument("--out-prefix", default=str(REPO / "bench" / "chunked_prefill"))
    p.add_argument("--replot", action="store_true", help="only redraw .md/.png from the existing .json")
    args = p.parse_args(argv)
    args.budgets = [None if b.lower() == "none" else int(b) for b in args.budgets]
    logging.basicConfig(level=logging.WARNING)
    prefix = Path(args.out_prefix)
    if args.replot:
        data = json.loads(prefix.with_suffix(".json").read_text())
    else:
        data = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {platform.processor()}",
                "threads": torch.get_num_threads()}
        if prefix.with_suffix(".json").exists():  # keep the other half of an earlier run
            old = json.loads(prefix.with_suffix(".json").read_text())
            data.update({k: old[k] for k in ("cost", "serve", "serve_meta") if k in old})
        if args.cost:
            data["cost"] = iteration_cost(args.chunks, batch_invariant=True)
        if args.serve:  # new rates join the earlier ones; a rate measured again replaces its rows
            old_rows = [r for r in data.get("serve", []) if r["rate"] not in args.rates]
            data["serve"] = sorted(old_rows + serve_sweep(args), key=lambda r: r["rate"])
            data["serve_meta"] = {"requests": args.requests, "long_fraction": args.long_fraction,
                                  "rates": sorted({r["rate"] for r in data["serve"]})}
        prefix.with_suffix(".json").write_text(json.dumps(data, indent=2))
    write_markdown(data, prefix.with_suffix(".md"))
    plot(data, prefix.with_suffix(".png"))
    print(prefix.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
