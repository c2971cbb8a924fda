"""Shared pieces of the A/B benchmarks of one CPU decode forward (bench/rope_fusion.py,
bench/huge_pages.py, bench/bf16_paths.py): interleaved timing of two callables, the summary line,
the bytes of the projections' weights, the decode step of a model with a prompt already cached,
and the common command line."""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from orca_ext.models import ForwardBatch


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def ab(run_a, run_b, steps: int, warmup: int = 5) -> tuple[list[float], list[float]]:
    """Interleaved timings (ms) of two callables; the first of each pair alternates."""
    for _ in range(warmup):
        run_a(), run_b()
    a, b = [], []
    for i in range(steps):
        if i % 2 == 0:
            a.append(timed(run_a)), b.append(timed(run_b))
        else:
            b.append(timed(run_b)), a.append(timed(run_a))
    return a, b


def summary(name: str, ms: list[float]) -> str:
    return f"{name:>10}: best {min(ms):7.3f} ms  median {statistics.median(ms):7.3f} ms"


def weight_bytes(model) -> int:
    """Bytes one decode step reads from the weight matrices (the tied lm_head once)."""
    seen, total = set(), 0
    tensors = [model.lm_head] + [getattr(layer, f) for layer in model.layers
                                 for f in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def decode_batch(model, context: int) -> ForwardBatch:
    """Caches a random `context`-token prompt in the model's KV cache (allocated by the caller)
    and returns the batch of its next decode step, which rewrites slot `context` each time."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.spec.vocab_size, (context,), generator=gen).tolist()
    model.forward(ForwardBatch.build([(prompt, 0, 0)], "cpu"))
    return ForwardBatch.build([([prompt[-1]], context, 0)], "cpu")


def parse_args(description: str, default_context: int, argv=None):
    """--dtypes, --steps, --context; prints the run's header line. Returns (args, model path)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=60, help="timed steps per mode (>= 30)")
    p.add_argument("--context", type=int, default=default_context,
                   help="tokens already in the cache at the decode step")
    args = p.parse_args(argv)
    if args.steps < 30:
        p.error("--steps must be >= 30")

    from orca_ext.default_model import default_model_path

    path = default_model_path()
    print(f"{datetime.date.today()}  {platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, model {path.name}, T=1 decode at context {args.context}, "
          f"{args.steps} interleaved steps per mode")
    return args, path
