"""Where the CPU projections should leave our weight-streaming kernels for ATen's GEMM (oneDNN).

For each dtype and each T, times the linear layers of SmolLM2-135M's decoder layers (fused norm +
QKV, o_proj + residual, gate_up + SiLU * up, down + residual) both ways, interleaved, in one
process:

  ours   `_C.rmsnorm_qkv`, `_C.linear`, `_C.linear_silu_mul` with the crossover out of reach
  aten   what the same ops do above the crossover: our norm then `F.linear`, `F.linear` + residual,
         `F.linear` then silu * mul

Weights rotate over several layer copies (30 for small T, where the read of the weights is the
cost, so that they come from memory as in a forward; 4 for large T, which is compute-bound).
Prints a table of per-layer times and writes JSON; the suggested crossover is the largest T up to
which ours is never slower, and "none" when ours stays within --invariance-margin of ATen at every
T measured (then keeping every T on our kernels makes outputs batch-invariant at that small cost).

    python bench/skinny_crossover.py [--tokens 1 2 4 ...] [--out bench/out/crossover.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

from orca_ext import _C  # noqa: E402

log = logging.getLogger("bench.skinny_crossover")

HIDDEN, INTER, QKV, EPS = 576, 1536, (9 + 2 * 3) * 64, 1e-5
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def make_layers(n: int, dtype: torch.dtype, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)
    return [dict(norm=(1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype), qkv=w(QKV, HIDDEN),
                 o=w(HIDDEN, HIDDEN), gate_up=w(2 * INTER, HIDDEN), down=w(HIDDEN, INTER)) for _ in range(n)]


def layer_ours(layer, x, attn, h, act):
    _C.rmsnorm_qkv(x, layer["norm"], layer["qkv"], None, EPS)
    _C.linear(attn, layer["o"], None, x)
    _C.linear_silu_mul(h, layer["gate_up"], None)
    _C.linear(act, layer["down"], None, x)


def layer_aten(layer, x, attn, h, act):
    F.linear(_C.rms_norm(x, layer["norm"], EPS), layer["qkv"])
    F.linear(attn, layer["o"]).add_(x)
    gate_up = F.linear(h, layer["gate_up"])
    F.silu(gate_up[:, :INTER]).mul_(gate_up[:, INTER:])
    F.linear(act, layer["down"]).add_(x)


def measure(dtype: torch.dtype, tokens: list[int], reps: int, gen: torch.Generator) -> list[dict]:
    name = DTYPE_NAMES[dtype]
    many, few = make_layers(30, dtype, gen), None
    rows = []
    before = _C.cpu_stream_max_tokens(name)
    _C.set_cpu_stream_max_tokens(name, 1 << 30)
    try:
        for t in tokens:
            if t > 16 and few is None:
                few = many[:4]
            layers = many if t <= 16 else few
            x = torch.randn(t, HIDDEN, generator=gen).to(dtype)
            attn = torch.randn(t, HIDDEN, generator=gen).to(dtype)
            h = torch.randn(t, HIDDEN, generator=gen).to(dtype)
            act = torch.randn(t, INTER, generator=gen).to(dtype)
            times = {"ours": [], "aten": []}
            for rep in range(reps + 1):  # the first round warms up
                order = ("ours", "aten") if rep % 2 == 0 else ("aten", "ours")
                for path in order:
                    fn = layer_ours if path == "ours" else layer_aten
                    t0 = time.perf_counter()
                    for layer in layers:
                        fn(layer, x, attn, h, act)
                    if rep:
                        times[path].append((time.perf_counter() - t0) / len(layers))
            row = dict(dtype=name, tokens=t, layers_rotated=len(layers))
            for path, ts in times.items():
                row[f"{path}_median_ms"] = statistics.median(ts) * 1e3
                row[f"{path}_min_ms"] = min(ts) * 1e3
            row["aten_over_ours"] = row["aten_median_ms"] / row["ours_median_ms"]
            rows.append(row)
            log.info("%s T=%4d  ours %8.3f ms  aten %8.3f ms  aten/ours %.2f", name, t, row["ours_median_ms"],
                     row["aten_median_ms"], row["aten_over_ours"])
    finally:
        _C.set_cpu_stream_max_tokens(name, before)
    return rows


def suggest(rows: list[dict], margin: float) -> str | int:
    """The largest T up to which ours is never slower; "none" when ours is within `margin` of ATen
    everywhere (no crossover: every T stays on the batch-invariant kernels)."""
    if all(r["aten_over_ours"] >= 1.0 - margin for r in rows):
        return "none"
    best = 0
    for r in sorted(rows, key=lambda r: r["tokens"]):
        if r["aten_over_ours"] < 1.0:
            break
        best = r["tokens"]
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--invariance-margin", type=float, default=0.10,
                   help="no crossover if ours is at most this much slower than ATen at every T")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gen = torch.Generator().manual_seed(0)
    result = dict(machine=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                  torch=torch.__version__, bf16_path=_C.cpu_bf16_path(), date=time.strftime("%Y-%m-%d %H:%M"),
                  rows=[], suggested={})
    for name in args.dtypes:
        dtype = torch.float32 if name == "float32" else torch.bfloat16
        rows = measure(dtype, args.tokens, args.reps, gen)
        result["rows"] += rows
        result["suggested"][name] = suggest(rows, args.invariance_margin)
    print("\n| dtype | T | ours ms/layer (median, min) | ATen ms/layer (median, min) | ATen / ours |")
    print("|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['dtype']} | {r['tokens']} | {r['ours_median_ms']:.3f}, {r['ours_min_ms']:.3f} | "
              f"{r['aten_median_ms']:.3f}, {r['aten_min_ms']:.3f} | {r['aten_over_ours']:.2f} |")
    print(f"\nsuggested crossover (largest T on our kernels): {result['suggested']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
