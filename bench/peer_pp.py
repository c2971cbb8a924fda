"""Prompt processing in llama-bench's `pp512` shape: our engine against llama.cpp on the same GGUF.

llama.cpp: `llama-bench -m FILE -p 512 -n 0 -t THREADS -r REPS -o json` (a 512-token prompt, batch
2048, micro-batch 512; its tok/s is 512 over the prompt's time). Ours: a fresh 512-token prompt of
random ids (no prefix reuse), one output token, in orca_ext.Server on the file's blocks with
float32 activations; tok/s is 512 over arrival -> first token (the prompt's forward, the last
row's lm_head and one greedy sample). Ours runs twice per round: with the engine's default
chunked-prefill budget (the prompt runs as several chunks) and with a budget of 512 (one forward
of the whole prompt, llama-bench's micro-batch). Systems alternate inside each round; the report
keeps min and median over rounds.

    python bench/peer_pp.py --llama-dir /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --ggufs FILE.gguf ... [--rounds 2] [--reps 3] [--threads 2] [--out bench/out/peer_pp.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

log = logging.getLogger("bench.peer_pp")


def ours_pp(gguf: Path, n_prompt: int, reps: int, seed: int, budget) -> list[float]:
    """tok/s of `reps` fresh prompts of `n_prompt` random ids, one after another, after a warm-up."""
    from orca_ext import SamplingParams, Server

    rng = random.Random(seed)
    with Server(str(gguf), device="cpu", dtype="float32", max_batch_size=1,
                max_num_batched_tokens=budget) as server:
        special = set(server.tokenizer.all_special_ids)
        normal = [t for t in range(len(server.tokenizer)) if t not in special]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        server.generate([[rng.choice(normal) for _ in range(n_prompt)]], params)  # warm-up
        rates = []
        for _ in range(reps):
            prompt = [rng.choice(normal) for _ in range(n_prompt)]
            out = server.result(server.submit(prompt, params))
            rates.append(n_prompt / (out.first_token_time - out.arrival_time))
    return rates


def llama_pp(binary: Path, gguf: Path, n_prompt: int, reps: int, threads: int) -> list[float]:
    cmd = [str(binary), "-m", str(gguf), "-p", str(n_prompt), "-n", "0", "-t", str(threads), "-r", str(reps),
           "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    rows = json.loads(out.stdout)
    return [float(x) for x in rows[0]["samples_ts"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--llama-dir", type=Path, default=None, help="llama.cpp tree with build/bin/llama-bench")
    p.add_argument("--ggufs", nargs="+", type=Path, required=True)
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="prompts per system per round")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    binary = args.llama_dir / "build" / "bin" / "llama-bench" if args.llama_dir else None

    runs: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for gguf in args.ggufs:
            systems = [("ours (default chunks)", lambda: ours_pp(gguf, args.n_prompt, args.reps, rnd, "auto")),
                       ("ours (one 512 chunk)", lambda: ours_pp(gguf, args.n_prompt, args.reps, rnd, args.n_prompt))]
            if binary is not None:
                systems.append(("llama.cpp", lambda: llama_pp(binary, gguf, args.n_prompt, args.reps, args.threads)))
            if rnd % 2:
                systems.reverse()
            for name, fn in systems:
                rates = fn()
                runs.setdefault(f"{gguf.name}|{name}", []).extend(rates)
                log.info("round %d %s %-22s pp%d %s tok/s", rnd + 1, gguf.name, name, args.n_prompt,
                         " ".join(f"{r:.1f}" for r in rates))

    report = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.processor() or platform.machine(),
                  cpu_count=os.cpu_count(), threads=args.threads, n_prompt=args.n_prompt, rounds=args.rounds,
                  reps=args.reps, results={})
    print(f"\n| file | system | pp{args.n_prompt} tok/s (min-median-max) | ours / llama.cpp (medians) |")
    print("|---|---|---|---|")
    for key, rates in runs.items():
        name, system = key.split("|")
        med = statistics.median(rates)
        report["results"][key] = dict(min=min(rates), median=med, max=max(rates), runs=rates)
        peer = runs.get(f"{name}|llama.cpp")
        ratio = f"{med / statistics.median(peer):.2f}x" if peer and system != "llama.cpp" else ""
        print(f"| {name} | {system} | {min(rates):.1f}-{med:.1f}-{max(rates):.1f} | {ratio} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
