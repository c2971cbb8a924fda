"""Slab compaction on CPU: a trace of mixed short and long reservations, with and without, in one run.

All requests arrive at t=0 into a deliberately small KV cache, so FCFS admission is limited by
slots: short requests (prompts U[8,48], outputs U[8,48]) and long reservations (prompts
U[128,384], outputs U[32,128]) mixed at random. Best-fit slabs of such different sizes fragment
the cache as requests finish out of order, and the head of the queue then waits although enough
slots are free. The engine is driven directly (deterministic order); the two settings take turns
per repetition and keep their best wall time.

Reported per setting: admission stalls (selections where the head fit in the free slots but not in
one run), compactions and moved bytes, iterations, output tok/s, and KV utilisation: the mean over
iterations of reserved slots / n_slots and of cached (used) slots / n_slots.

    python bench/compaction.py [--requests 48] [--n-slots 1536] [--repeat 2] [--out r.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install


def make_trace(n: int, long_fraction: float, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        if rng.random() < long_fraction:
            prompt, out = rng.randint(128, 384), rng.randint(32, 128)
        else:
            prompt, out = rng.randint(8, 48), rng.randint(8, 48)
        jobs.append(([rng.randrange(1000, 40000) for _ in range(prompt)], out))
    return jobs


def run(model, jobs, n_slots: int, compaction: bool, max_batch_size: int) -> dict:
    from orca_ext.engine import Engine
    from orca_ext.request import Request
    from orca_ext.sampling import SamplingParams
    from orca_ext.config import EngineConfig
    from orca_ext.executor import LocalExecutor
    from orca_ext.scheduler import make_scheduler

    sched = make_scheduler(EngineConfig(max_batch_size=max_batch_size, max_num_batched_tokens=None), n_slots)
    engine = Engine(LocalExecutor(model), sched, record_iterations=True, slab_compaction=compaction)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=True)) for i, (p, o) in enumerate(jobs)]
    for r in reqs:
        engine.add_request(r)
    used = []
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        used.append(engine.slots_used)
    elapsed = time.perf_counter() - t0
    assert sched.allocator.n_used == 0 and all(len(r.output_token_ids) == o for r, (_, o) in zip(reqs, jobs))
    reserved = [rec.slots_reserved for rec in engine.records]
    return {"compaction": compaction, "elapsed_s": elapsed, "iterations": engine.num_iterations,
            "output_tok_s": sum(o for _, o in jobs) / elapsed,
            "admission_stalls": sched.num_fragmentation_stalls, "compactions": engine.num_compactions,
            "moved_mib": engine.compaction_moved_bytes / 2**20,
            "kv_reserved_mean": sum(reserved) / len(reserved) / n_slots,
            "kv_used_mean": sum(used) / len(used) / n_slots,
            "mean_batch": sum(len(rec.request_ids) for rec in engine.records) / len(engine.records)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--n-slots", type=int, default=1536)
    p.add_argument("--long-fraction", type=float, default=0.3)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from orca_ext.default_model import default_model_path
    from orca_ext.models import load_model

    model = load_model(default_model_path(), device="cpu", dtype=torch.float32)
    jobs = make_trace(args.requests, args.long_fraction, seed=3)
    print(f"{len(jobs)} requests ({sum(len(p) for p, _ in jobs)} prompt, {sum(o for _, o in jobs)} output tokens), "
          f"n_slots {args.n_slots}, {torch.get_num_threads()} threads")
    best: dict[bool, dict] = {}
    for rep in range(args.repeat):
        for compaction in (False, True):
            r = run(model, jobs, args.n_slots, compaction, args.max_batch_size)
            print(f"  [{rep + 1}/{args.repeat}] compaction={compaction}: {r['iterations']} iterations, "
                  f"{r['output_tok_s']:.1f} tok/s, stalls {r['admission_stalls']}, compactions {r['compactions']}, "
                  f"KV reserved {100 * r['kv_reserved_mean']:.0f}% used {100 * r['kv_used_mean']:.0f}%")
            if compaction not in best or r["elapsed_s"] < best[compaction]["elapsed_s"]:
                best[compaction] = r
    print("| compaction | iterations | output tok/s | admission stalls | compactions | moved MiB | "
          "KV reserved | KV used | mean batch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in (False, True):
        r = best[c]
        print(f"| {'on' if c else 'off'} | {r['iterations']} | {r['output_tok_s']:.1f} | {r['admission_stalls']} | "
              f"{r['compactions']} | {r['moved_mib']:.1f} | {100 * r['kv_reserved_mean']:.0f}% | "
              f"{100 * r['kv_used_mean']:.0f}% | {r['mean_batch']:.1f} |")
    if args.out:
        out = {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "args": vars(args),
               "results": [best[False], best[True]]}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
