"""Prefix caching side by side with llama.cpp's prompt cache, on the same multi-turn trace and file.

The trace is bench/prefix_cache.py's `multi_turn` (same seed and sizes): --conversations chats
of --turns turns, each turn's prompt = the previous turn's prompt + its answer + a new message,
dealt to --concurrency clients that run their chats' turns round robin. Both engines serve the
embedded SmolLM2-135M-Instruct.Q4_1.gguf as it is, greedy, --max-tokens tokens per turn with EOS
ignored, with --threads threads:
  ours       an in-process Server, prefix caching on (and off, for reference)
  llama.cpp  llama-server --parallel <concurrency> with `cache_prompt: true` (each slot keeps its
             last prompt's KV and reuses the longest common prefix; the slot is chosen by prompt
             similarity), and with `cache_prompt: false` for reference
Reported per setting: wall time, generated tokens per second, requests per second and time to
first token p50/p99. TTFT is the engine's own (ours: arrival to first token; llama.cpp: the
request's round trip minus its predicted tokens' time, i.e. queueing + prompt processing), so
neither side counts HTTP streaming. Runs alternate between the engines.

    python bench/prefix_cache_llama.py --llama-bin /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))          # prefix_cache, peer_cpu
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # a checkout without an install

from peer_cpu import LlamaServer  # noqa: E402
from prefix_cache import multi_turn, pct, run_scripts, run_workload  # noqa: E402

log = logging.getLogger("bench.prefix_cache_llama")


def llama_complete(port: int, prompt: list[int], n: int, cache_prompt: bool) -> dict:
    body = json.dumps(dict(prompt=prompt, n_predict=n, ignore_eos=True, cache_prompt=cache_prompt, temperature=0.0,
                           top_k=1, stream=False, return_tokens=True)).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def run_llama(server: LlamaServer, scripts, max_tokens: int, cache_prompt: bool) -> dict:
    ttft, gen, prompt_tokens, cached = [], [0], [0], [0]
    lock = threading.Lock()

    def send(prompt: list[int]) -> list[int]:
        t0 = time.perf_counter()
        out = llama_complete(server.port, prompt, max_tokens, cache_prompt)
        total = time.perf_counter() - t0
        t = out["timings"]
        with lock:
            ttft.append(total - t["predicted_ms"] / 1e3)
            gen[0] += out["tokens_predicted"]
            prompt_tokens[0] += len(prompt)
            cached[0] += t.get("cache_n", len(prompt) - t["prompt_n"])
        return out["tokens"]

    wall = run_scripts(scripts, send)
    return {"requests": len(ttft), "wall_s": wall, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "output_tok_s": gen[0] / wall, "req_s": len(ttft) / wall, "prompt_tokens": prompt_tokens[0],
            "cached_tokens": cached[0], "hit_rate": cached[0] / prompt_tokens[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-server")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--first-turn-tokens", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    from orca_ext import Server
    from orca_ext.default_model import default_gguf_path

    torch.set_num_threads(args.threads)
    gguf = default_gguf_path()
    # The answers must be the engine's own, so each setting rebuilds the trace from the same seed.
    trace = lambda: multi_turn(args, random.Random(args.seed))  # noqa: E731
    results = {}
    for name in ("ours, cache on", "llama.cpp, cache_prompt", "ours, cache off", "llama.cpp, no cache_prompt"):
        if name.startswith("ours"):
            with Server(str(gguf), device="cpu", dtype="float32", max_batch_size=args.concurrency,
                        prefix_caching=name.endswith("on")) as server:
                r = run_workload(server, trace(), args.max_tokens)
        else:
            ctx = 2 * (args.first_turn_tokens + args.turns * (40 + args.max_tokens))
            with LlamaServer(args.llama_bin / "llama-server", gguf, args.concurrency, args.threads, ctx) as server:
                r = run_llama(server, trace(), args.max_tokens, cache_prompt=name.endswith("cache_prompt"))
        results[name] = r
        log.info("%s: %s", name, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    print("\n| setting | wall s | output tok/s | req/s | TTFT p50 s | TTFT p99 s | prompt tokens cached |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['req_s']:.2f} | {r['ttft_p50_s']:.3f} | "
              f"{r['ttft_p99_s']:.3f} | {100 * r['hit_rate']:.0f}% |")
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args) | {
            "llama_bin": str(args.llama_bin), "out": str(args.out)}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
