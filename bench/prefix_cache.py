"""Prefix caching on CPU: time to first token and throughput with the prefix cache off and on.

Workloads (token-id prompts, greedy, ignore_eos; one in-process Server per setting):
  shared_system  a shared system prompt of --system-tokens tokens, then a short question each
  multi_turn     --conversations chats of --turns turns; each turn's prompt is the previous
                 turn's prompt + its answer + a new message (as a chat client resends it), all
                 chats interleaved over --concurrency clients
  few_shot       8 shared examples of --example-tokens tokens each, then a query
  no_prefix      unique random prompts (the cost of caching when nothing is shared)
Each workload runs with the cache off and on, alternating which goes first per repetition, on
the same seeded requests. `--concurrency` client threads send requests back to back.
Reported per workload and setting: TTFT p50/p99 (arrival to first token, from the engine's
timestamps), throughput (generated tokens per wall-clock second, and requests per second), and
the hit rate (prompt tokens served from the cache / prompt tokens).

    python bench/prefix_cache.py [--quick] [--out-prefix bench/prefix_cache]

Writes <out-prefix>.json, .md and .png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a checkout without an install

log = logging.getLogger("bench.prefix_cache")
TOKEN_RANGE = (1000, 30000)  # ordinary token ids of the default model's vocabulary


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


# -- workloads: lists of client scripts; a script is a list of steps, a step builds its prompt from
# -- the outputs of the script's earlier steps ---------------------------------------------------
def shared_system(args, rng):
    system = toks(rng, args.system_tokens)
    steps = [lambda _, q=toks(rng, rng.randint(8, 24)): system + q for _ in range(args.requests)]
    return [steps[i::args.concurrency] for i in range(args.concurrency)]


def few_shot(args, rng):
    shots = [toks(rng, args.example_tokens) for _ in range(8)]
    prefix = [t for shot in shots for t in shot]
    steps = [lambda _, q=toks(rng, rng.randint(8, 24)): prefix + q for _ in range(args.requests)]
    return [steps[i::args.concurrency] for i in range(args.concurrency)]


def no_prefix(args, rng):
    n = args.system_tokens // 2
    steps = [lambda _, p=toks(rng, rng.randint(n, 2 * n)): p for _ in range(args.requests)]
    return [steps[i::args.concurrency] for i in range(args.concurrency)]


def multi_turn(args, rng):
    def chat():
        first = toks(rng, args.first_turn_tokens)
        messages = [toks(rng, rng.randint(10, 40)) for _ in range(args.turns - 1)]
        steps = [lambda history: first]
        for msg in messages:
            steps.append(lambda history, m=msg: history[-1][0] + history[-1][1] + m)
        return steps

    chats = [chat() for _ in range(args.conversations)]
    # Chats are dealt to the clients; a client runs its chats' turns round robin (interleaved).
    scripts = []
    for c in range(args.concurrency):
        mine = chats[c::args.concurrency]
        scripts.append([(k, step) for turn in range(args.turns) for k, ch in enumerate(mine) for step in [ch[turn]]])
    return scripts


WORKLOADS = {"shared_system": shared_system, "multi_turn": multi_turn, "few_shot": few_shot,
             "no_prefix": no_prefix}


def run_scripts(scripts, send: Callable[[list[int]], list[int]]) -> float:
    """Run each client script on a thread of its own, its steps back to back: `send(prompt)`
    serves one prompt and returns the generated token ids, which the script's later steps build
    on. Returns the wall time; raises when any client failed (reported, not hidden)."""
    errors = []

    def client(script):
        history: dict = {}
        try:
            for item in script:
                key, step = item if isinstance(item, tuple) else (None, item)
                prompt = step(history.get(key, []))
                history.setdefault(key, []).append((list(prompt), list(send(prompt))))
        except Exception as exc:
            errors.append(repr(exc))

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(s,)) for s in scripts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} clients failed: {errors[:3]}")
    return wall


def run_workload(server, scripts, max_tokens: int) -> dict:
    from orca_ext import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs = []

    def send(prompt: list[int]) -> list[int]:
        out = server.generate(prompt, params)[0]
        outs.append(out)
        return out.token_ids

    before = server.stats()["prefix_cache"]
    wall = run_scripts(scripts, send)
    after = server.stats()["prefix_cache"]
    ttft = [o.first_token_time - o.arrival_time for o in outs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    gen = sum(len(o.token_ids) for o in outs)
    result = {"requests": len(outs), "wall_s": wall, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
              "ttft_mean_s": statistics.fmean(ttft), "output_tok_s": gen / wall, "req_s": len(outs) / wall,
              "prompt_tokens": prompt_tokens, "cached_tokens": cached,
              "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0}
    if after is not None:
        result["evictions"] = after["evictions"] - before["evictions"]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--requests", type=int, default=32, help="requests per shared/few-shot/no-prefix run")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--example-tokens", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--first-turn-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs per workload")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--quick", action="store_true", help="a small version to validate the script")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-prefix", default=str(REPO / "bench" / "prefix_cache"))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.concurrency, args.conversations, args.max_tokens, args.repeats = 8, 2, 4, 8, 1
        args.system_tokens, args.first_turn_tokens = 512, 120
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from orca_ext import Server

    servers = {on: Server(prefix_caching=on, kv_cache_memory=args.kv_cache_memory) for on in (False, True)}
    results: dict = {}
    try:
        for name in args.workloads.split(","):
            for rep in range(args.repeats):
                order = (False, True) if rep % 2 == 0 else (True, False)
                for on in order:
                    server = servers[on]
                    # Fresh tokens per repetition: nothing from an earlier run can hit.
                    scripts = WORKLOADS[name](args, random.Random(f"{args.seed}-{name}-{rep}"))
                    r = run_workload(server, scripts, args.max_tokens)
                    results.setdefault(name, {}).setdefault("on" if on else "off", []).append(r)
                    log.info("%s rep %d cache %s: %s", name, rep, "on" if on else "off",
                             {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    finally:
        for s in servers.values():
            s.shutdown()
    report(args, results)
    return 0


def summary(runs: list[dict]) -> dict:
    keys = ("ttft_p50_s", "ttft_p99_s", "output_tok_s", "req_s", "hit_rate")
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def report(args, results: dict) -> None:
    import torch

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
            "args": vars(args)}
    Path(args.out_prefix + ".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = ["| workload | cache | TTFT p50 (s) | TTFT p99 (s) | output tok/s | req/s | hit rate |",
             "|---|---|---|---|---|---|---|"]
    ratios = []
    for name, by in results.items():
        s = {k: summary(v) for k, v in by.items()}
        for setting in ("off", "on"):
            x = s[setting]
            lines.append(f"| {name} | {setting} | {x['ttft_p50_s']:.3f} | {x['ttft_p99_s']:.3f} | "
                         f"{x['output_tok_s']:.1f} | {x['req_s']:.2f} | {x['hit_rate']:.0%} |")
        ratios.append(f"- {name}: TTFT p50 {s['off']['ttft_p50_s'] / s['on']['ttft_p50_s']:.2f}x lower, "
                      f"throughput x{s['on']['output_tok_s'] / s['off']['output_tok_s']:.2f} with the cache")
    Path(args.out_prefix + ".md").write_text("\n".join(lines + [""] + ratios) + "\n")
    print("\n".join(lines + [""] + ratios))
    plot(args, results)


def plot(args, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for ax, key, label in ((axes[0], "ttft_p50_s", "TTFT p50 (s)"), (axes[1], "output_tok_s", "output tokens / s")):
        for i, setting in enumerate(("off", "on")):
            vals = [summary(results[n][setting])[key] for n in names]
            ax.bar([j + (i - 0.5) * width for j in range(len(names))], vals, width, label=f"prefix cache {setting}")
        ax.set_xticks(range(len(names)), names, rotation=15)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("Prefix caching on CPU (default model, float32)")
    fig.tight_layout()
    fig.savefig(args.out_prefix + ".png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
