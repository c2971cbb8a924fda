"""What fair admission costs benign traffic: fcfs against fair (with its default KV cap), same
model, workload and batch limit, rounds interleaved (the order alternates every round).

  engine     the default model's engine stepped in this process (loaded once): --requests
             requests (the throughput benchmark's workload: prompt and output lengths uniform in
             [16, 128], EOS ignored), all added before the first step, spread round-robin over
             --clients client keys. Reports wall time, output tokens/s, iterations, median time
             to first token, and output tokens per CPU second of this process.
  scheduler  the scheduler alone (no model: every request advances one token per iteration),
             the same workload over --clients clients: microseconds of CPU per iteration
             (schedule + complete), and whether the batches equal fcfs's.

  python bench/admission_cost.py engine --rounds 3 --clients 1
  python bench/admission_cost.py engine --rounds 3 --clients 4 --n-slots 2048
  python bench/admission_cost.py scheduler --clients 1,4,16
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install

from orca_ext.config import EngineConfig  # noqa: E402
from orca_ext.request import Request  # noqa: E402
from orca_ext.sampling import SamplingParams  # noqa: E402
from orca_ext.scheduler import make_scheduler  # noqa: E402

POLICIES = ("fcfs", "fair")


def workload(n: int, seed: int, vocab: int = 49152) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(16, 128))], rng.randint(16, 128))
            for _ in range(n)]


def load_executor(max_batch_size: int, n_slots):
    """The default model's executor, loaded once, and the KV slots a Server would give it."""
    from orca_ext.default_model import default_model_path
    from orca_ext.executor_factory import make_executor
    from orca_ext.server import Server

    model = str(default_model_path())
    config = EngineConfig(max_batch_size=max_batch_size, n_slots=n_slots)
    with Server(model, config=config) as server:  # only for its KV sizing
        n_slots = server.n_slots
    config = config.resolve()
    return make_executor(model, config).executor, config, n_slots


def engine_run(admission: str, jobs, n_clients: int, executor, config, n_slots: int) -> dict:
    """The engine stepped in this thread over requests all added first, so a run's schedule
    depends only on the policy (a Server's loop would start on the first arrivals)."""
    from orca_ext.engine import Engine

    engine = Engine(executor, make_scheduler(dataclasses.replace(config, admission=admission), n_slots))
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=True), client=f"c{i % n_clients}")
            for i, (p, o) in enumerate(jobs)]
    for r in reqs:
        engine.add_request(r)
    t0, c0 = time.perf_counter(), time.process_time()
    steps = 0
    first = {}
    while engine.has_work():
        engine.step()
        steps += 1
        for r in reqs:
            if r.output_token_ids and r.request_id not in first:
                first[r.request_id] = time.perf_counter() - t0
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(r.output_token_ids) for r in reqs)
    assert tokens == sum(o for _, o in jobs)
    ttft = sorted(first.values())
    return {"admission": admission, "wall_s": wall, "cpu_s": cpu, "tok_s": tokens / wall, "tok_per_cpu_s": tokens / cpu,
            "iterations": steps, "n_slots": n_slots, "ttft_p50_s": ttft[len(ttft) // 2]}


def scheduler_run(admission: str, jobs, n_clients: int, max_batch_size: int, n_slots: int, budget: int):
    config = EngineConfig(admission=admission, max_batch_size=max_batch_size, max_num_batched_tokens=budget)
    s = make_scheduler(config, n_slots)
    for i, (p, o) in enumerate(jobs):
        s.add(Request(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=True), client=f"c{i % n_clients}"))
    batches, spent = [], 0.0
    while s.has_unfinished():
        c0 = time.process_time()
        batch = s.schedule()
        spent += time.process_time() - c0
        batches.append([(r.request_id, r.num_scheduled) for r in batch])
        for r in batch:  # the engine's part: the chunk is cached, a finished prompt yields a token
            r.num_cached += r.num_scheduled
            if not r.prompt_remaining:
                r.output_token_ids.append(0)
                if len(r.output_token_ids) >= r.params.max_tokens:
                    r.mark_finished("length")
        c0 = time.process_time()
        s.complete(batch)
        spent += time.process_time() - c0
    return batches, spent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["engine", "scheduler"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--clients", default="1", help="client keys the requests are spread over (scheduler: a list)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--n-slots", type=int, default=None, help="KV slots (default: from the KV budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append the results as JSON lines here")
    args = p.parse_args(argv)
    rows = []
    if args.mode == "engine":
        jobs = workload(args.requests, args.seed)
        n_clients = int(args.clients)
        executor, config, n_slots = load_executor(args.max_batch_size, args.n_slots)
        engine_run("fcfs", jobs[:2], 1, executor, config, n_slots)  # warm-up, not timed
        for rnd in range(args.rounds):
            for admission in (POLICIES if rnd % 2 == 0 else POLICIES[::-1]):
                r = engine_run(admission, jobs, n_clients, executor, config, n_slots)
                r.update(round=rnd + 1, clients=n_clients, mode="engine")
                rows.append(r)
                print(f"round {rnd + 1} {admission:>4}: {r['tok_s']:6.1f} tok/s, {r['tok_per_cpu_s']:6.1f} tok/CPU-s, "
                      f"{r['iterations']} iterations, TTFT p50 {r['ttft_p50_s']:.2f} s, {r['n_slots']} slots", flush=True)
        for admission in POLICIES:
            mine = [r for r in rows if r["admission"] == admission]
            for key in ("tok_s", "tok_per_cpu_s"):
                v = [r[key] for r in mine]
                print(f"{admission:>4} {key}: median {sorted(v)[len(v) // 2]:.1f}, range {min(v):.1f}-{max(v):.1f}")
    else:
        jobs = workload(max(args.requests, 256), args.seed)
        n_slots = args.n_slots or 16384
        for n_clients in (int(c) for c in args.clients.split(",")):
            runs = {a: [] for a in POLICIES}
            for rnd in range(args.rounds):
                for admission in (POLICIES if rnd % 2 == 0 else POLICIES[::-1]):
                    runs[admission].append(scheduler_run(admission, jobs, n_clients, args.max_batch_size, n_slots, 128))
            same = runs["fcfs"][0][0] == runs["fair"][0][0]
            us = {a: min(spent for _, spent in v) / len(v[0][0]) * 1e6 for a, v in runs.items()}
            row = {"mode": "scheduler", "clients": n_clients, "iterations": {a: len(v[0][0]) for a, v in runs.items()},
                   "us_per_iteration": us, "same_batches": same}
            rows.append(row)
            print(f"{n_clients} clients: fcfs {us['fcfs']:.0f} us/iteration ({row['iterations']['fcfs']} iterations), "
                  f"fair {us['fair']:.0f} us/iteration ({row['iterations']['fair']}); same batches: {same}")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
