"""Load test: hundreds of concurrent streaming clients over HTTP on 127.0.0.1.

For each configuration (without an admission limit, and with `--max-queue`), one
`python -m orca_ext serve` is started; at each level of `--clients` (default 200, 500, 1000) that
many clients connect at once, each streaming one greedy completion of `--max-tokens` tokens
(EOS ignored). Per level it reports: completed (200, every token streamed, [DONE]), errors
(transport failures, in-band error events, statuses other than 200/429), 429s (turned away by
--max-queue, with Retry-After), and TTFT / end-to-end latency p50 and p99 over the completed
requests, measured on the client. The server must be idle again after each level (no request
running, no KV slot reserved) before the next starts.

The client runs in this process on the same machine as the server, so on a small machine its
own work (1,000 asyncio streams) adds to the latencies; the counts are what this checks.

Usage:
  python bench/load.py --out bench/load.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback import ServeProcess, metric, percentile, stream_completion  # noqa: E402

log = logging.getLogger("bench.load")

PROMPT = "Explain in one sentence why the sky is blue."


async def wait_idle(base_url: str, limit_s: float = 300.0) -> dict:
    """Poll /metrics until no request runs or waits and no KV slot is reserved (bounded)."""
    end = time.monotonic() + limit_s
    async with httpx.AsyncClient(timeout=30) as c:
        while True:
            text = (await c.get(base_url + "/metrics")).text
            state = {k: metric(text, k) for k in ("orca_requests_running", "orca_requests_waiting",
                                                  "orca_kv_slots_reserved", "orca_http_requests_inflight")}
            if not any(state.values()) or time.monotonic() > end:
                return state
            await asyncio.sleep(0.2)


async def level(server: ServeProcess, model: str, clients: int, max_tokens: int) -> dict:
    url = server.base_url + "/v1/completions"
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_completion(client, url, body) for _ in range(clients)))
        wall = time.perf_counter() - start
    done = [r for r in results if r.status == 200 and not r.error and r.tokens == max_tokens]
    rejected = [r for r in results if r.status == 429]
    errors = [r for r in results if r not in done and r.status != 429]
    idle = await wait_idle(server.base_url)
    row = {
        "clients": clients, "completed": len(done), "errors": len(errors), "http_429": len(rejected),
        "wall_s": wall, "tokens_per_s": sum(r.tokens for r in done) / wall,
        "ttft_p50_ms": 1e3 * percentile([r.ttft for r in done], 50),
        "ttft_p99_ms": 1e3 * percentile([r.ttft for r in done], 99),
        "e2e_p50_ms": 1e3 * percentile([r.e2e for r in done], 50),
        "e2e_p99_ms": 1e3 * percentile([r.e2e for r in done], 99),
        "idle_after": not any(idle.values()),
        "error_samples": sorted({f"{r.status} {r.error[:80]}" for r in errors})[:5],
    }
    log.info("%s", row)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="200,500,1000", help="comma-separated concurrency levels")
    p.add_argument("--max-queue", type=int, default=128, help="the limited configuration's --max-queue (default 128)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    levels = [int(x) for x in args.clients.split(",")]
    configs = [("no limit", max(levels) * 100), (f"--max-queue {args.max_queue}", args.max_queue)]
    rows = []
    for name, max_queue in configs:
        # Every client of this test connects from 127.0.0.1, one address: the per-client share is
        # the whole queue, so that --max-queue is what turns them away.
        serve_args = ["--max-queue", str(max_queue), "--max-queue-per-client", str(max_queue),
                      "--max-batch-size", str(args.max_batch_size), "--log-level", "warning"]
        if args.model:
            serve_args += ["--model", args.model]
        with ServeProcess(*serve_args, env={"ORCA_EXT_KV_CACHE_MEMORY": "512MiB"}) as server:
            model = server.model_card()["id"]
            for clients in levels:
                rows.append({"config": name, **asyncio.run(level(server, model, clients, args.max_tokens))})
    print(f"\n{'config':<16} {'clients':>7} {'completed':>9} {'errors':>6} {'429s':>5} {'tok/s':>6} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>8} {'e2e p99':>8}  idle after")
    for r in rows:
        print(f"{r['config']:<16} {r['clients']:>7} {r['completed']:>9} {r['errors']:>6} {r['http_429']:>5} "
              f"{r['tokens_per_s']:>6.0f} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms "
              f"{r['e2e_p50_ms'] / 1e3:>7.1f}s {r['e2e_p99_ms'] / 1e3:>7.1f}s  {r['idle_after']}")
    ok = all(r["errors"] == 0 and r["idle_after"] and r["completed"] + r["http_429"] == r["clients"] for r in rows)
    print(("PASS" if ok else "FAIL") + ": every client completed or got 429, no errors, idle after each level")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
                                              "max_tokens": args.max_tokens, "rows": rows}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
