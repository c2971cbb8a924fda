"""What fair admission costs benign traffic: fcfs against fair (with its default KV cap), same
model, workload and batch limit, rounds interleaved (the order alternates every round).

  engine     the default model's engine stepped in this process (loaded once): --requests
             requests (the throughput benchmark's workload: prompt and output lengths uniform in
             [16, 128], EOS ignored), all added before the first step, spread round-robin over
             --clients client keys. Reports wall time, output tokens/s, iterations, median time
             to first token, and output tokens per CPU second of this process.
  scheduler  the scheduler alone (no model: every request advances one token per iteration),
             the same workload over --clients clients: iterations, the batches' time under this
             machine's fitted cost model (bench/sim_cpu_*.json, as the simulator prices them),
             microseconds of scheduler CPU per iteration (schedule + complete), and whether the
             batches equal fcfs's.

  python bench/admission_cost.py engine --rounds 3 --clients 1
  python bench/admission_cost.py engine --rounds 3 --clients 4 --n-slots 2048
  python bench/admission_cost.py scheduler --clients 1,2,4,8 --requests 128 --seeds 4
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
from orca_ext.sim.cost import Roofline  # noqa: E402
from orca_ext.sim.presets import load_hardware, load_shape  # noqa: E402
from orca_ext.sim.work import Work  # noqa: E402

HERE = Path(__file__).resolve().parent

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


def engine_run(admission: str, jobs, n_clients: int, executor, config, n_slots: int, share_rows=None) -> dict:
    """The engine stepped in this thread over requests all added first, so a run's schedule
    depends only on the policy (a Server's loop would start on the first arrivals)."""
    from orca_ext.engine import Engine

    policy = dataclasses.replace(config, admission=admission, share_decode_rows=share_rows if admission == "fair" else None)
    policy = policy.scheduling_for(config.device.type)
    engine = Engine(executor, make_scheduler(policy, n_slots))
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


def scheduler_run(admission: str, jobs, n_clients: int, max_batch_size: int, n_slots: int, budget: int,
                  cost=None, share_rows=None):
    """Returns the batches [(request id, tokens)], the scheduler's CPU seconds, and the batches'
    time under `cost` (a sim cost model; 0 without one)."""
    config = EngineConfig(admission=admission, max_batch_size=max_batch_size, max_num_batched_tokens=budget,
                          share_decode_rows=share_rows if admission == "fair" else None).scheduling_for("cpu")
    s = make_scheduler(config, n_slots)
    for i, (p, o) in enumerate(jobs):
        s.add(Request(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=True), client=f"c{i % n_clients}"))
    batches, spent, modelled = [], 0.0, 0.0
    while s.has_unfinished():
        c0 = time.process_time()
        batch = s.schedule()
        spent += time.process_time() - c0
        batches.append([(r.request_id, r.num_scheduled) for r in batch])
        if cost is not None:  # (new tokens, first position, emits a token), as the simulator prices them
            work = Work.of([(r.num_scheduled, r.num_cached, r.num_scheduled >= r.prompt_remaining) for r in batch])
            modelled += cost.stage_time(work) + cost.host_time(work)
        for r in batch:  # the engine's part: the chunk is cached, a finished prompt yields a token
            r.num_cached += r.num_scheduled
            if not r.prompt_remaining:
                r.output_token_ids.append(0)
                if len(r.output_token_ids) >= r.params.max_tokens:
                    r.mark_finished("length")
        c0 = time.process_time()
        s.complete(batch)
        spent += time.process_time() - c0
    return batches, spent, modelled


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["engine", "scheduler"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--clients", default="1", help="client keys the requests are spread over (scheduler: a list)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--n-slots", type=int, default=None, help="KV slots (default: from the KV budget)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (scheduler: the first of --seeds)")
    p.add_argument("--seeds", type=int, default=1, help="scheduler: workloads with consecutive seeds")
    p.add_argument("--weight-bytes-per-param", type=float, default=None,
                   help="scheduler: price the weights at this many bytes per parameter (default: Q4_1's; 4: float32)")
    p.add_argument("--share-decode-rows", action=argparse.BooleanOptionalAction, default=None,
                   help="fair admission's decode-row sharing (default: the CPU's, on)")
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
                r = engine_run(admission, jobs, n_clients, executor, config, n_slots, args.share_decode_rows)
                r.update(round=rnd + 1, clients=n_clients, mode="engine", share_decode_rows=args.share_decode_rows)
                rows.append(r)
                print(f"round {rnd + 1} {admission:>4}: {r['tok_s']:6.1f} tok/s, {r['tok_per_cpu_s']:6.1f} tok/CPU-s, "
                      f"{r['iterations']} iterations, TTFT p50 {r['ttft_p50_s']:.2f} s, {r['n_slots']} slots", flush=True)
        for admission in POLICIES:
            mine = [r for r in rows if r["admission"] == admission]
            for key in ("tok_s", "tok_per_cpu_s"):
                v = [r[key] for r in mine]
                print(f"{admission:>4} {key}: median {sorted(v)[len(v) // 2]:.1f}, range {min(v):.1f}-{max(v):.1f}")
    else:
        # This machine's fitted cost model (bench/sim_calibrate.py): what each schedule's batches take.
        shape = load_shape(HERE / "sim_cpu_shape.json")  # the default model as its Q4_1 file
        if args.weight_bytes_per_param is not None:  # 4: its float32 weights
            shape = dataclasses.replace(shape, weight_bytes_per_param=args.weight_bytes_per_param)
        cost = Roofline(shape, load_hardware(HERE / "sim_cpu_hardware.json"))
        n_slots = args.n_slots or 16384
        for n_clients in (int(c) for c in args.clients.split(",")):
            for seed in range(args.seed, args.seed + args.seeds):
                jobs = workload(args.requests, seed)
                runs = {a: [] for a in POLICIES}
                for rnd in range(args.rounds):
                    for admission in (POLICIES if rnd % 2 == 0 else POLICIES[::-1]):
                        runs[admission].append(scheduler_run(admission, jobs, n_clients, args.max_batch_size,
                                                             n_slots, 128, cost, args.share_decode_rows))
                first = {a: v[0] for a, v in runs.items()}
                row = {"mode": "scheduler", "clients": n_clients, "requests": args.requests, "seed": seed,
                       "share_decode_rows": args.share_decode_rows,
                       "weight_bytes_per_param": shape.weight_bytes_per_param,
                       "iterations": {a: len(b) for a, (b, _, _) in first.items()},
                       "us_per_iteration": {a: min(sp for _, sp, _ in v) / len(v[0][0]) * 1e6 for a, v in runs.items()},
                       "modelled_s": {a: m for a, (_, _, m) in first.items()},
                       "same_batches": first["fcfs"][0] == first["fair"][0]}
                rows.append(row)
                it, us, ms = row["iterations"], row["us_per_iteration"], row["modelled_s"]
                print(f"{args.requests} requests, {n_clients} clients, seed {seed}: iterations fcfs {it['fcfs']} "
                      f"fair {it['fair']} ({it['fair'] / it['fcfs'] - 1:+.1%}); modelled time fcfs {ms['fcfs']:.1f} s "
                      f"fair {ms['fair']:.1f} s ({ms['fair'] / ms['fcfs'] - 1:+.1%}); scheduler CPU fcfs "
                      f"{us['fcfs']:.0f} us fair {us['fair']:.0f} us per iteration; same batches: {row['same_batches']}",
                      flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
