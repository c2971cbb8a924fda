"""A lone prompt under the prefill-only budget: prompt-processing tok/s of one request (the shape of
llama-bench's ppN) for several values of `prefill_only_tokens`, in one interleaved run.

While no request generates, an iteration stalls no stream, so the scheduler may take larger prompt
chunks than `max_num_batched_tokens` (docs/DESIGN.md, chunked prefill). This measures what that
buys on this machine: one Server per value ('none' = the chunk budget, 128 on CPU), all loaded at
once, each warmed up with a full-length prompt; then in every round each server processes a new
prompt of N random tokens with one output token (new, so the prefix cache never hits), the
servers' order alternating between rounds. Reports the median tok/s per value and its ratio to
'none' round by round.

    python bench/prefill_only.py [--dtypes float32 bfloat16] [--prompt-lengths 512 2048] \\
        [--budgets none 256 512] [--rounds 8] [--out bench/out/prefill_only.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a checkout without an install

log = logging.getLogger("prefill_only")


def budget_arg(value: str):
    return None if value.lower() == "none" else int(value)


def chunk_text(chunks: list[int]) -> str:
    """[128, 128, 128, 44] -> '3 x 128 + 44'."""
    runs = []
    for c in chunks:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return " + ".join(f"{k} x {c}" if k > 1 else f"{c}" for c, k in runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--budgets", type=budget_arg, nargs="+", default=[None, 256, 512],
                   help="prefill_only_tokens values; 'none': the chunk budget (first: the baseline)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)

    from orca_ext import SamplingParams, Server
    if args.model is None:
        from orca_ext.default_model import default_model_path
        args.model = str(default_model_path())

    one_token = SamplingParams(max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    report = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.processor() or platform.machine(),
                  threads=args.threads, torch=torch.__version__, model=args.model, rounds=args.rounds, results={})
    print("\n| dtype | prompt | prefill_only_tokens | tok/s median (min-max) | chunks | / none, per round |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(Server(args.model, device="cpu", dtype=dtype, max_batch_size=1,
                                                  record_iterations=True, prefill_only_tokens=b))
                       for b in args.budgets]
            vocab = servers[0].executor.spec.vocab_size
            for n in args.prompt_lengths:
                def prompt():
                    return [rng.randrange(1000, vocab) for _ in range(n)]

                for s in servers:
                    s.generate([prompt()], one_token)  # warm-up at full length
                rates = {b: [] for b in args.budgets}
                chunks = {}
                for rnd in tqdm(range(args.rounds), desc=f"{dtype} pp{n}"):
                    order = list(zip(args.budgets, servers))
                    for b, s in order if rnd % 2 == 0 else order[::-1]:
                        first = len(s.iterations())
                        t0 = time.perf_counter()
                        s.generate([prompt()], one_token)
                        rates[b].append(n / (time.perf_counter() - t0))
                        chunks[b] = [rec.chunk_sizes[0] for rec in s.iterations()[first:]]
                base = rates[args.budgets[0]]
                for b, s in zip(args.budgets, servers):
                    v = rates[b]
                    label = f"{s.prefill_only_tokens}" + (" (none)" if b is None else "")
                    per_round = " ".join(f"{x / y:.2f}" for x, y in zip(v, base))
                    print(f"| {dtype} | {n} | {label} | {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) | "
                          f"{chunk_text(chunks[b])} | {per_round} |")
                    report["results"][f"{dtype}/pp{n}/{b}"] = dict(tok_s=v, chunks=chunks[b],
                                                                   prefill_only_tokens=s.prefill_only_tokens)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
