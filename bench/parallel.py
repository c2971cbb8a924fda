"""Tensor and pipeline parallelism on this CPU: throughput, per-stage busy time, communication.

Configurations, all on one workload (N requests with random prompts, all arriving at t=0, EOS
ignored), one thread per process, the same max_batch_size:

  pp1          single process (LocalExecutor), 1 thread
  pp2/1        2 pipeline stages, n_workers = 1: one batch in flight (a stage idles while the
               other works: what Orca's scheduling removes)
  pp2/2        2 pipeline stages, n_workers = 2: Orca's scheduling, two batches in flight
  tp2          2 tensor-parallel ranks (two all-reduces per layer)

Runs are interleaved (every configuration once per round, --rounds rounds); the median round is
reported. For every parallel run the workers' own clocks (orca_ext.distributed WorkerTimes) split
each worker's wall time into compute, control-plane receive, activation send/receive (the
receive includes waiting for the previous stage), all-reduce and gather, sampling and idle
(waiting for the driver). A gloo microbenchmark measures the pure transfer cost of the
messages involved (point-to-point [T, H] activations, all-reduce of [T, H]) on this machine.

The model is a random Llama-shaped checkpoint (built once under bench/out/parallel_model):
hidden 512, 8 heads / 4 KV heads, intermediate 1536, 16 layers, vocabulary 8192, float32.
(SmolLM2-135M's 9 heads cannot be split over 2 ranks.)

    flock /tmp/orca_bench.lock .venv/bin/python bench/parallel.py [--requests 16] [--rounds 3]
Writes bench/out/parallel.json and bench/parallel.png.

Pipeline balance (--burst N): N requests arriving together, max_batch_size N, on pp2 with two
batches in flight. Their prompts run in one batch; then each batch takes at most an even share of
the admitted requests as decodes (the scheduler's cap), so the other pipeline slot gets the rest.
The run is repeated with that cap lifted (patched in this benchmark only: one batch may take every
decode), so the burst rides in one batch and the other slot stays empty: the reference.
Reported per variant: tokens/s; the fraction of launches posted while another batch was in flight
(from the driver's clocks: posted, and its result back); the fraction of the wall time with two
batches in flight; the decodes per batch; and the workers' busy fractions.

    .venv/bin/python bench/parallel.py --burst 8 [--rounds 3]   # writes bench/out/parallel_burst.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench.parallel")

# A small vocabulary keeps the two pipeline stages balanced: the last stage also runs the lm_head,
# which with SmolLM2's 49152 x 576 would cost more than all its layers and cap what pp=2 can gain.
MODEL_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=2048, vocab_size=8192,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)


def bench_model(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL_SHAPE)
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(100, 8000) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
            for _ in range(n)]


def run_engine(engine, jobs, tag: str) -> dict:
    """All jobs at t=0 through Engine.step until done; timing of the engine's own iterations."""
    from orca_ext.request import Request
    from orca_ext.sampling import SamplingParams

    reqs = [Request(f"{tag}{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)) for i, (p, n) in enumerate(jobs)]
    executor = engine.executor
    launch, spent = executor.execute, [0.0]

    def timed(batch, **kw):  # the driver's side of the control plane: pack + post
        t0 = time.perf_counter()
        future = launch(batch, **kw)
        spent[0] += time.perf_counter() - t0
        return future

    executor.execute = timed
    first = engine.num_iterations
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - t0
    executor.execute = launch
    tokens = sum(len(r.output_token_ids) for r in reqs)
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs if r.error][:1]
    iterations = engine.num_iterations - first
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "iterations": iterations,
            "driver_launch_us_per_iter": 1e6 * spent[0] / max(iterations, 1),
            "outputs": [r.output_token_ids for r in reqs]}


def run_traced(engine, jobs, tag: str) -> dict:
    """run_engine, and when each batch was posted and when its result came back (driver clocks)."""
    executor = engine.executor
    launch, spans = executor.execute, []

    def traced(batch, **kw):
        future = launch(batch, **kw)
        spans.append((time.perf_counter(), future, len(batch.requests)))
        return future

    executor.execute = traced
    try:
        out = run_engine(engine, jobs, tag)
    finally:
        executor.execute = launch
    intervals = [(t, f.completed_at, n) for t, f, n in spans]
    # A launch overlaps when another batch was posted before it and its result was not back yet.
    overlapped = sum(any(t0 < t < t1 for t0, t1, _ in intervals if (t0, t1) != (t, end))
                     for t, end, _ in intervals)
    events = sorted([(t0, 1) for t0, _, _ in intervals] + [(t1, -1) for _, t1, _ in intervals])
    two, depth, last = 0.0, 0, events[0][0] if events else 0.0
    for when, step in events:
        if depth >= 2:
            two += when - last
        depth, last = depth + step, when
    out.update({"launches": len(intervals), "launch_overlap": overlapped / max(len(intervals), 1),
                "two_in_flight": two / out["wall_s"],
                "requests_per_batch": sum(n for _, _, n in intervals) / max(len(intervals), 1)})
    return out


def burst_balance(args, model_dir: Path) -> int:
    """--burst: pp2 with two batches in flight, the scheduler's even-share cap against none."""
    from tqdm import tqdm

    jobs = workload(args.burst, tuple(args.prompt_len), tuple(args.output_len), seed=1)
    n_slots = sum(len(p) + n for p, n in jobs) + 64
    pp2 = Parallel(model_dir, 1, 2, n_slots, args.burst)
    capped = pp2.sched._decode_limit

    def uncapped() -> int:
        return pp2.sched.max_batch_size

    variants = {"even share (scheduler)": capped, "no cap (one batch takes all)": uncapped}
    runs: dict[str, list] = {name: [] for name in variants}
    try:
        pp2.run(jobs[:2], 2, "warm")
        for r in tqdm(range(args.rounds), desc="rounds"):
            for i, (name, limit) in enumerate(variants.items()):
                pp2.sched._decode_limit = limit
                pp2.executor.worker_stats(reset=True)
                out = run_traced(pp2.engine, jobs, f"{i}-{r}-")
                out["workers"] = [breakdown(t, out["iterations"]) for t in pp2.executor.worker_stats()]
                runs[name].append(out)
    finally:
        pp2.sched._decode_limit = capped
        pp2.close()
    reference = runs[next(iter(runs))][0]["outputs"]
    configs = {}
    for name, rs in runs.items():
        same = all(run.pop("outputs") == reference for run in rs)
        median = sorted(rs, key=lambda x: x["tokens_per_s"])[len(rs) // 2]
        configs[name] = dict(median, rounds_tokens_per_s=[x["tokens_per_s"] for x in rs], same_tokens=same)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
              "load_average_at_end": os.getloadavg(),
              "workload": {"burst": args.burst, "prompt_len": args.prompt_len, "output_len": args.output_len,
                           "max_batch_size": args.burst, "pipeline": "pp2, 2 batches in flight",
                           "model": MODEL_SHAPE},
              "configs": configs}
    out = Path(args.out).with_name("parallel_burst.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{'pp2/2, burst of ' + str(args.burst):32} {'tok/s (rounds)':>26} {'iters':>6} {'req/batch':>9} "
          f"{'launch overlap':>14} {'2 in flight':>11}  stage busy")
    for name, c in configs.items():
        rounds = ", ".join(f"{x:.0f}" for x in c["rounds_tokens_per_s"])
        busy = " / ".join(f"{100 * w['fraction']['compute']:.0f}%" for w in c["workers"])
        print(f"{name:32} {c['tokens_per_s']:8.1f} ({rounds:>15}) {c['iterations']:6d} {c['requests_per_batch']:9.1f} "
              f"{c['launch_overlap']:14.0%} {c['two_in_flight']:11.0%}  {busy}  same tokens: {c['same_tokens']}")
    print(f"\nwrote {out}")
    return 0


def breakdown(times, iterations: int) -> dict:
    """One worker's WorkerTimes as fractions of its wall time and microseconds per iteration."""
    w = max(times.wall, 1e-9)
    parts = {
        "compute": times.compute + times.sample,
        "control": times.control_recv,
        "data_send": times.data_send,
        "data_recv_wait": times.data_recv,
        "all_reduce": times.all_reduce,
        "gather": times.gather,
        "idle": times.control_wait,
    }
    return {"fraction": {k: v / w for k, v in parts.items()},
            "us_per_iteration": {k: 1e6 * v / max(iterations, 1) for k, v in parts.items()}}


class Parallel:
    """One worker group with an engine on top (kept across rounds)."""

    def __init__(self, model_dir: Path, tp: int, pp: int, n_slots: int, batch: int):
        from orca_ext.distributed import DistributedExecutor
        from orca_ext.engine import Engine
        from orca_ext.models import ModelSpec
        from orca_ext.config import EngineConfig
        from orca_ext.scheduler import make_scheduler

        spec = ModelSpec.from_pretrained(model_dir)
        self.executor = DistributedExecutor(str(model_dir), spec, tensor_parallel_size=tp,
                                            pipeline_parallel_size=pp, threads_per_worker=1)
        config = EngineConfig(max_batch_size=batch, max_num_batched_tokens=None)
        self.sched = make_scheduler(config, n_slots, n_workers=pp)
        self.engine = Engine(self.executor, self.sched)

    def run(self, jobs, n_workers: int, tag: str) -> dict:
        self.sched.n_workers = n_workers
        self.executor.worker_stats(reset=True)
        out = run_engine(self.engine, jobs, tag)
        stats = self.executor.worker_stats()
        out["workers"] = [breakdown(t, out["iterations"]) for t in stats]
        return out

    def close(self) -> None:
        self.executor.shutdown()


def transfer_microbench(sizes: list[int], hidden: int, repeats: int = 200) -> list[dict]:
    """Pure gloo costs on this machine: one-way [T, H] float32 send (half a ping-pong) and an
    all-reduce of [T, H] between 2 processes."""
    import torch.multiprocessing as mp

    store_port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_transfer_worker, args=(r, store_port, sizes, hidden, repeats, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_transfers(x: torch.Tensor, rank: int, repeats: int, sync=lambda: None) -> tuple[float, float]:
    """(one-way send, all-reduce) seconds for tensor `x` between ranks 0 and 1 of the default
    group: each the mean of `repeats`, timed from a barrier; `sync` waits for the device
    (torch.cuda.synchronize under NCCL) so queued work is inside the timing."""
    import torch.distributed as dist

    def timed(step) -> float:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(repeats):
            step()
        sync()
        return (time.perf_counter() - t0) / repeats

    def ping_pong() -> None:
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)

    return timed(ping_pong) / 2, timed(lambda: dist.all_reduce(x))


def _transfer_worker(rank, port, sizes, hidden, repeats, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for t in sizes:
        x = torch.randn(t, hidden)
        for _ in range(10):
            dist.all_reduce(x)
        p2p, ar = time_transfers(x, rank, repeats)
        rows.append({"tokens": t, "bytes": x.numel() * 4, "p2p_us": 1e6 * p2p, "all_reduce_us": 1e6 * ar,
                     "p2p_GBps": x.numel() * 4 / p2p / 1e9})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 2]})
    tps = [result["configs"][n]["tokens_per_s"] for n in names]
    ax1.bar(names, tps, color=["#888888", "#d98c3f", "#3f7fd9", "#3fa65a"][:len(names)])
    for i, v in enumerate(tps):
        ax1.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    ax1.set_ylabel("generated tokens / s")
    ax1.set_title("throughput (median round)")
    kinds = ["compute", "all_reduce", "gather", "control", "data_send", "data_recv_wait", "idle"]
    colors = {"compute": "#3f7fd9", "all_reduce": "#d93f3f", "gather": "#a63fd9", "control": "#d9c13f",
              "data_send": "#3fd9c1", "data_recv_wait": "#d98c3f", "idle": "#cccccc"}
    labels, bottoms = [], []
    for n in names:
        for w, stage in enumerate(result["configs"][n].get("workers", [])):
            labels.append(f"{n}\nw{w}")
            bottoms.append(stage["fraction"])
    x = range(len(labels))
    base = [0.0] * len(labels)
    for k in kinds:
        vals = [b.get(k, 0.0) for b in bottoms]
        ax2.bar(x, vals, bottom=base, color=colors[k], label=k)
        base = [a + b for a, b in zip(base, vals)]
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_ylabel("fraction of the worker's wall time")
    ax2.set_title("where each worker's time goes (pp2/1 vs pp2/2: the idle stage)")
    ax2.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.suptitle(f"orca_ext parallelism on CPU (gloo, 1 thread per process) - {result['machine']}, "
                 f"{result['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 96))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "parallel.json"))
    parser.add_argument("--png", default=str(ROOT / "bench" / "parallel.png"))
    parser.add_argument("--burst", type=int, default=0,
                        help="measure pipeline balance instead: a burst of N requests on pp2 with 2 batches in flight")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tqdm import tqdm

    from orca_ext.engine import Engine
    from orca_ext.models import load_model
    from orca_ext.config import EngineConfig
    from orca_ext.executor import LocalExecutor
    from orca_ext.scheduler import make_scheduler

    torch.set_num_threads(1)
    model_dir = bench_model(ROOT / "bench" / "out" / "parallel_model")
    if args.burst:
        return burst_balance(args, model_dir)
    jobs = workload(args.requests, tuple(args.prompt_len), tuple(args.output_len))
    n_slots = sum(len(p) + n for p, n in jobs) + 64
    config = EngineConfig(max_batch_size=args.max_batch_size, max_num_batched_tokens=None)
    local = Engine(LocalExecutor(load_model(model_dir)), make_scheduler(config, n_slots))
    pp2 = Parallel(model_dir, 1, 2, n_slots, args.max_batch_size)
    tp2 = Parallel(model_dir, 2, 1, n_slots, args.max_batch_size)
    runs: dict[str, list] = {"pp1": [], "pp2/1": [], "pp2/2": [], "tp2": []}
    try:
        run_engine(local, jobs[:2], "warm")
        pp2.run(jobs[:2], 2, "warm")
        tp2.run(jobs[:2], 1, "warm")
        for r in tqdm(range(args.rounds), desc="rounds"):
            runs["pp1"].append(run_engine(local, jobs, f"a{r}-"))
            runs["pp2/1"].append(pp2.run(jobs, 1, f"b{r}-"))
            runs["pp2/2"].append(pp2.run(jobs, 2, f"c{r}-"))
            runs["tp2"].append(tp2.run(jobs, 1, f"d{r}-"))
    finally:
        pp2.close()
        tp2.close()
    reference = runs["pp1"][0]["outputs"]
    same_tokens = {}  # pipeline stages compute exactly what one process does; tensor ranks sum in
    for name, rs in runs.items():  # another order, so a near-tie argmax of this random model may flip
        same_tokens[name] = all(run.pop("outputs") == reference for run in rs)
    configs = {}
    for name, rs in runs.items():
        median = sorted(rs, key=lambda x: x["tokens_per_s"])[len(rs) // 2]
        configs[name] = dict(median, rounds_tokens_per_s=[x["tokens_per_s"] for x in rs],
                             same_tokens_as_pp1=same_tokens[name])
    transfers = transfer_microbench([8, 64, 512], MODEL_SHAPE["hidden_size"])
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "load_average_at_end": os.getloadavg(),
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "max_batch_size": args.max_batch_size, "model": MODEL_SHAPE},
        "configs": configs,
        "gloo_transfers": transfers,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, Path(args.png))
    base = configs["pp1"]["tokens_per_s"]
    print(f"\n{'config':8} {'tok/s':>8} {'x pp1':>6} {'iters':>6} {'drv us/it':>9}   per worker: busy% / "
          f"ctl us/it / data us/it / idle%")
    for name, c in configs.items():
        launch = f"{c['driver_launch_us_per_iter']:9.0f}" if c.get("workers") else f"{'(sync)':>9}"
        line = f"{name:8} {c['tokens_per_s']:8.1f} {c['tokens_per_s'] / base:6.2f} {c['iterations']:6d} {launch}  "
        for w in c.get("workers", []):
            f, us = w["fraction"], w["us_per_iteration"]
            data = us["data_send"] + us["data_recv_wait"] + us["all_reduce"] + us["gather"]
            line += f" | {100 * f['compute']:4.1f}% / {us['control']:5.0f} / {data:6.0f} / {100 * f['idle']:4.1f}%"
        print(line)
    print("\ngloo on loopback, 2 processes:", *(f"\n  T={t['tokens']:4d} ({t['bytes'] / 1024:.0f} KiB): "
                                               f"send {t['p2p_us']:.0f} us ({t['p2p_GBps']:.2f} GB/s), "
                                               f"all-reduce {t['all_reduce_us']:.0f} us" for t in transfers))
    print(f"\nwrote {out} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
