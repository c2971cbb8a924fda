"""The Orca paper's key experiment on this machine: median normalized latency vs throughput.

For each scheduling policy (`orca`: iteration-level scheduling; `static`: request-level
batching, the baseline) one `python -m orca_ext serve --scheduler POLICY` subprocess is
started, then the serving benchmark (orca_ext/benchmarks/serving.py) offers Poisson load at
a sweep of arrival rates, the policies taking turns at each rate. Every rate uses the same
seeded workload for both policies: prompts of U[8, 128] tokens (the paper's U[32, 512] scaled
by 1/4) and outputs of U[1, 128] tokens (forced with ignore_eos).

Outputs (default prefix bench/latency_throughput): .json (all summaries), .md (table and the
throughput ratio at equal latency) and .png (the plot). `--replot` redraws from the JSON.

  python bench/plot_latency_throughput.py                      # full sweep, ~15 min on 2 cores
  python bench/plot_latency_throughput.py --rates 0.5 1 --seconds-per-rate 20   # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a checkout without an install

from orca_ext.benchmarks.serving import parse_goodput, run_benchmark  # noqa: E402

logger = logging.getLogger("bench.latency_throughput")


# -- server subprocess ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`python -m orca_ext serve` with the given extra arguments, until stop()."""

    def __init__(self, extra: list[str], env: dict[str, str]) -> None:
        self.port = _free_port()
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="orca_bench_", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "orca_ext", "serve", "--port", str(self.port), "--log-level", "warning",
               "--max-queue", "4096", *extra]
        logger.info("starting %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server failed to start:\n" + Path(self.log.name).read_text()[-3000:])
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


# -- analysis --------------------------------------------------------------------------------------

def curve(points: list[dict]) -> list[tuple[float, float]]:
    """(throughput req/s, median normalized latency ms/token), in order of offered rate."""
    pts = sorted(points, key=lambda p: p["request_rate"])
    return [(p["request_throughput"], p["normalized_latency_ms_per_token"]["median"]) for p in pts]


def throughput_at(points: list[tuple[float, float]], latency: float) -> tuple[float | None, bool]:
    """Highest throughput on the piecewise-linear curve with latency <= `latency`.

    Returns (throughput, exact): exact is False when even the curve's last point stays below
    `latency` (the true value at that latency is then at least the returned one).
    """
    best = None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y0 <= latency:
            best = max(best or 0.0, x0)
        if y0 <= latency < y1:
            best = max(best or 0.0, x0 + (latency - y0) * (x1 - x0) / (y1 - y0))
    x_last, y_last = points[-1]
    if y_last <= latency:
        return max(best or 0.0, x_last), False
    return best, True


def equal_latency_ratios(results: dict[str, list[dict]], fast: str = "orca", slow: str = "static") -> list[dict]:
    """Throughput ratio fast/slow at the latencies the slow policy reached."""
    if fast not in results or slow not in results:
        return []
    fast_c, slow_c = curve(results[fast]), curve(results[slow])
    rows = []
    for _, latency in slow_c:
        if math.isnan(latency):
            continue
        tf, exact_f = throughput_at(fast_c, latency)
        ts, _ = throughput_at(slow_c, latency)
        if tf is None or not ts:
            continue
        rows.append({"latency_ms_per_token": latency, f"{fast}_throughput": tf, f"{slow}_throughput": ts,
                     "ratio": tf / ts, "ratio_is_lower_bound": not exact_f})
    return rows


def write_markdown(results: dict[str, list[dict]], ratios: list[dict], meta: dict, path: Path) -> None:
    lines = ["# Median normalized latency vs throughput (SmolLM2-135M, CPU)", "",
             f"Workload: prompts U{meta['input_range']} tokens, outputs U{meta['output_range']} tokens "
             f"(ignore_eos), Poisson arrivals; engine options `{' '.join(meta['server_args']) or '(defaults)'}`; "
             f"{meta['cpus']} CPU cores shared by server and client.", "",
             "| policy | offered rate (req/s) | requests | throughput (req/s) | output tok/s | "
             "median norm. latency (ms/token) | p99 norm. latency | median TTFT (ms) | median TPOT (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for policy, points in results.items():
        for p in sorted(points, key=lambda p: p["request_rate"]):
            lines.append(f"| {policy} | {p['request_rate']:g} | {p['completed']} | {p['request_throughput']:.3f} | "
                         f"{p['output_throughput']:.1f} | {p['normalized_latency_ms_per_token']['median']:.1f} | "
                         f"{p['normalized_latency_ms_per_token']['p99']:.1f} | {p['ttft_ms']['median']:.0f} | "
                         f"{p['tpot_ms']['median']:.1f} |")
    if ratios:
        lines += ["", "Throughput ratio orca / static at equal median normalized latency "
                      "(at each latency the static policy reached; '>=' where orca's curve never got that slow):", "",
                  "| latency (ms/token) | orca req/s | static req/s | ratio |", "|---|---|---|---|"]
        for r in ratios:
            bound = ">=" if r["ratio_is_lower_bound"] else ""
            lines.append(f"| {r['latency_ms_per_token']:.1f} | {bound}{r['orca_throughput']:.3f} | "
                         f"{r['static_throughput']:.3f} | {bound}{r['ratio']:.2f}x |")
    path.write_text("\n".join(lines) + "\n")


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for policy, marker in zip(results, ("o", "s", "^", "D")):
        pts = curve(results[policy])
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, label=policy)
        for (x, y), p in zip(pts, sorted(results[policy], key=lambda p: p["request_rate"])):
            ax.annotate(f"{p['request_rate']:g}/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("median normalized latency (ms/token)")
    ys = [y for pts in map(curve, results.values()) for _, y in pts if y > 0]
    if ys and max(ys) / min(ys) > 8:  # the knee of an overloaded policy spans decades
        ax.set_yscale("log")
    ax.set_title("SmolLM2-135M on CPU: iteration-level (orca) vs request-level (static)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- sweep -----------------------------------------------------------------------------------------

def n_prompts(rate: float, seconds: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rate * seconds)))


def sweep(args: argparse.Namespace) -> dict:
    server_args = ["--max-batch-size", str(args.max_batch_size)]
    env = {"OMP_NUM_THREADS": str(args.threads), "ORCA_EXT_KV_CACHE_MEMORY": args.kv_cache_memory}
    results: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    # All servers start up front and the policies take turns at each rate: an idle server sleeps
    # on a condition variable, and interleaving spreads any drift of the machine's background
    # load evenly over the policies instead of over whichever ran last.
    servers: dict[str, Served] = {}
    try:
        for policy in args.policies:
            servers[policy] = Served([*server_args, "--scheduler", policy], env)
            # Warm-up (not measured): the first iterations pay for lazy initialisation.
            asyncio.run(run_benchmark(servers[policy].base_url, num_prompts=4, request_rate=math.inf,
                                      input_range=tuple(args.input_range), output_range=(4, 4), seed=999,
                                      progress=False))
        for i, rate in enumerate(args.rates):
            n = n_prompts(rate, args.seconds_per_rate, args.min_prompts, args.max_prompts)
            for policy, served in servers.items():
                t0 = time.monotonic()
                s = asyncio.run(run_benchmark(
                    served.base_url, num_prompts=n, request_rate=rate, input_range=tuple(args.input_range),
                    output_range=tuple(args.output_range), seed=1000 + i, goodput=args.goodput_limits))
                s["policy"] = policy
                results[policy].append(s)
                logger.info("%s rate %.2f: %d req in %.0f s, throughput %.3f req/s, median norm. latency "
                            "%.1f ms/token", policy, rate, s["completed"], time.monotonic() - t0,
                            s["request_throughput"], s["normalized_latency_ms_per_token"]["median"])
    finally:
        for served in servers.values():
            served.stop()
    meta = {"input_range": list(args.input_range), "output_range": list(args.output_range), "rates": args.rates,
            "server_args": server_args + [f"ORCA_EXT_KV_CACHE_MEMORY={args.kv_cache_memory}"],
            "cpus": os.cpu_count(), "seconds_per_rate": args.seconds_per_rate}
    return {"meta": meta, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=["orca", "static"], choices=["orca", "static"])
    p.add_argument("--rates", nargs="+", type=float, default=[0.25, 0.5, 1.0, 1.5], help="requests/s")
    p.add_argument("--seconds-per-rate", type=float, default=60.0, help="arrival window per rate")
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--max-prompts", type=int, default=40)
    p.add_argument("--input-range", type=int, nargs=2, default=(8, 128))
    p.add_argument("--output-range", type=int, nargs=2, default=(1, 128))
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    p.add_argument("--goodput", nargs="*", default=["e2el:60000"], metavar="NAME:MS")
    p.add_argument("--out-prefix", default=str(REPO / "bench" / "latency_throughput"))
    p.add_argument("--replot", action="store_true", help="only redraw .md/.png from the existing .json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.goodput_limits = parse_goodput(args.goodput)
    prefix = Path(args.out_prefix)
    if args.replot:
        data = json.loads(prefix.with_suffix(".json").read_text())
    else:
        t0 = time.monotonic()
        data = sweep(args)
        data["meta"]["wall_s"] = time.monotonic() - t0
    data["equal_latency_ratios"] = equal_latency_ratios(data["results"])
    prefix.with_suffix(".json").write_text(json.dumps(data, indent=2))
    write_markdown(data["results"], data["equal_latency_ratios"], data["meta"], prefix.with_suffix(".md"))
    plot(data["results"], prefix.with_suffix(".png"))
    print(prefix.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
