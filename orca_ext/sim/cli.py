"""`python -m orca_ext simulate`: serve a trace on simulated hardware, or plan a deployment.

    simulate --model-shape gpt3-175b --hardware a100-40gb -tp 8 -pp 2 --requests 500 --rate 2
    simulate --trace t.jsonl --model-shape gpt3-13b --hardware h200 --plan --slo-latency 0.05

The trace is a JSONL file (--trace; {"arrival", "prompt_len", "output_len"} per line, optionally
"prefix_id" and "prefix_len" for shared prompt prefixes) or a synthetic one (--requests, --rate,
--burstiness, --prompt-len, --output-len, --seed, --shared-prefix). Model
shapes and hardware are presets (orca_ext/sim/presets.py) or JSON files (a fit on this machine:
bench/sim_calibrate.py). The engine options (--scheduler, --max-batch-size,
--max-num-batched-tokens, -tp, -pp, --n-slots, ...) are the engine's own.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from ..config import EngineConfig
from ..options import add_engine_arguments
from .cost import Roofline, kv_slots
from .loop import simulate
from .plan import SLO, plan, plot, table
from .presets import HARDWARE, MODELS, load_hardware, load_shape
from .trace import load_jsonl, synthetic


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orca-ext simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default="gpt3-13b", help=f"{' | '.join(MODELS)} | a ModelShape JSON")
    p.add_argument("--hardware", default="a100-40gb", help=f"{' | '.join(HARDWARE)} | a Hardware JSON")
    t = p.add_argument_group("trace")
    t.add_argument("--trace", default=None, help="JSONL trace (default: synthetic)")
    t.add_argument("--requests", type=int, default=200)
    t.add_argument("--rate", type=float, default=1.0, help="requests/s (inf: all at t=0)")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    t.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("LO", "HI"))
    t.add_argument("--output-len", type=int, nargs=2, default=[1, 512], metavar=("LO", "HI"))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens of one system prompt every synthetic prompt starts with (the prefix cache's case)")
    g = p.add_argument_group("plan")
    g.add_argument("--plan", action="store_true", help="search replicas x TP x PP x max_batch_size")
    g.add_argument("--slo-latency", type=float, default=None, help="median normalised latency, s/token")
    g.add_argument("--slo-ttft", type=float, default=None, help="p99 time to first token, s")
    g.add_argument("--plan-tp", type=int, nargs="+", default=[1, 2, 4, 8])
    g.add_argument("--plan-pp", type=int, nargs="+", default=[1, 2, 4])
    g.add_argument("--plan-batch", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    g.add_argument("--max-replicas", type=int, default=16)
    g.add_argument("--png", default=None, help="plan: write the latency-vs-GPUs curve here")
    p.add_argument("--json", default=None, help="write the summary (or the plan) as JSON here")
    add_engine_arguments(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shape, hw = load_shape(args.model_shape), load_hardware(args.hardware)
        trace = (load_jsonl(args.trace) if args.trace else
                 synthetic(args.requests, args.rate, args.prompt_len, args.output_len, args.seed, args.burstiness,
                           args.shared_prefix))
        config = EngineConfig.from_args(args)
    except (OSError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = _plan_arguments_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(f"# {shape.name} on {hw.name} ({hw.source}); {len(trace)} requests")
    if args.plan:
        slo = SLO(args.slo_latency, args.slo_ttft)
        if slo == SLO():
            print("error: --plan needs --slo-latency and/or --slo-ttft", file=sys.stderr)
            return 2
        best, tried = plan(trace, shape, hw, slo, tps=args.plan_tp, pps=args.plan_pp,
                           batch_sizes=args.plan_batch, max_replicas=args.max_replicas, config=config)
        print(table(tried, best))
        print("cheapest:", "none meets the SLO" if best is None else
              f"{best.gpus} GPUs = {best.replicas} replicas x TP{best.tp} x PP{best.pp}, "
              f"max_batch_size {best.max_batch_size}")
        if args.png:
            plot(tried, slo, args.png)
        result = {"best": None if best is None else vars(best), "tried": [vars(c) for c in tried]}
    else:
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        n_slots = config.n_slots or kv_slots(shape, hw, tp, pp, cap=1 << 22)
        try:
            sim = simulate(trace, config, Roofline(shape, hw, tp, pp), n_slots, shape.kv_bytes_per_token,
                           hw.device_type)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        result = sim.summary() | {"n_slots": n_slots, "tp": tp, "pp": pp, "scheduler": config.scheduler,
                                  "max_batch_size": config.max_batch_size}
        for k, v in result.items():
            print(f"{k:>30}: {v:.4g}" if isinstance(v, float) else f"{k:>30}: {v}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


MAX_PLAN_VALUE = 1024  # largest TP, PP, batch size or replica count the search accepts


def _plan_arguments_problem(args) -> Optional[str]:
    """Why the search options cannot be used, or None."""
    for name in ("plan_tp", "plan_pp", "plan_batch"):
        values = getattr(args, name)
        if len(values) > 16 or not all(1 <= v <= MAX_PLAN_VALUE for v in values):
            return f"--{name.replace('_', '-')} takes 1 to 16 values in [1, {MAX_PLAN_VALUE}], got {values!r}"
    if not 1 <= args.max_replicas <= MAX_PLAN_VALUE:
        return f"--max-replicas must be in [1, {MAX_PLAN_VALUE}], got {args.max_replicas!r}"
    for name in ("slo_latency", "slo_ttft"):
        value = getattr(args, name)
        if value is not None and not 0 < value < float("inf"):
            return f"--{name.replace('_', '-')} must be a positive number of seconds, got {value!r}"
    return None
