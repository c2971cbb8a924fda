"""Host time per decode iteration with and without CUDA graphs (target: under 100 us at batch 256).

    python bench/cuda_graphs.py --out cuda_graphs.json [--png cuda_graphs.png] [--preset smollm2-135m]
    python bench/cuda_graphs.py --dry-run     # on the CPU: the whole flow with EagerReplayBackend

A random-weight model of the preset's shapes (the number of layers sets the launches per
iteration; the weights do not matter) runs decode iterations of ragged contexts at each batch
size, eager and graph-replayed in turns (eager, graph, eager, graph, ...), from one set of
ForwardBatch inputs. For each iteration it records:
  host_us   time until forward() returns, the GPU idle at the start (synchronised before): the
            host's cost of enqueueing the iteration (eager: every kernel launch; graphs: the
            input copies and one replay)
  gpu_us    CUDA events around the forward: the GPU time of the iteration
  build_us  ForwardBatch.build of the same batch (the same for both; shown for scale)
It also checks, on every measured pair, that the graph's logits match the eager ones (argmax
agreement and the largest difference), so the timed path is the correct one. Prints a table,
writes JSON, and draws host time against batch size when --png is given (matplotlib).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orca_ext.models.batch import ForwardBatch  # noqa: E402
from orca_ext.models.causal_lm import CausalLM  # noqa: E402
from orca_ext.models.config import RopeConfig  # noqa: E402
from orca_ext.cuda_graphs import DecodeGraphRunner, EagerReplayBackend  # noqa: E402
from orca_ext.random_weights import random_causal_lm, random_spec  # noqa: E402

log = logging.getLogger("cuda_graphs")

PRESETS = {
    # The project's default model (SmolLM2-135M-Instruct): 30 layers, the most launches per token.
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                         rope=RopeConfig(theta=100000.0)),
    # Llama-3.2-1B shapes: 16 layers, GQA 4, head dim 64, a 128k vocabulary.
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                     num_kv_heads=8, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                     rope=RopeConfig(theta=500000.0)),
    # For --dry-run on the CPU.
    "tiny": dict(num_layers=4),
}
TARGET_HOST_US_AT_256 = 100.0


def preset_spec(preset: str, context: int):
    """The ModelSpec of `preset` with room for `context` positions: the preset's own
    max_position_embeddings (8192 where it names none), raised to context + 1 if that is larger."""
    fields = dict(PRESETS[preset])
    fields["max_position_embeddings"] = max(fields.get("max_position_embeddings", 8192), context + 1)
    return random_spec(**fields)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def decode_inputs(batch: int, contexts: list[int], vocab: int, rng: random.Random) -> list[tuple]:
    """One decode input per request: a random token at the end of its context, slab i after slab i-1."""
    inputs, slab = [], 0
    for i in range(batch):
        ctx = contexts[i]
        inputs.append(([rng.randrange(vocab)], ctx - 1, slab))
        slab += ctx
    return inputs


class Timer:
    """Host and GPU time of one forward, the GPU idle at the start."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def run(self, fn, batch) -> tuple[torch.Tensor, float, float]:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn(batch)
        host = time.perf_counter() - t0
        if self.cuda:
            end.record()
            end.synchronize()
            gpu = start.elapsed_time(end) * 1e3
        else:
            gpu = float("nan")
        return out, host * 1e6, gpu


def summary(values: list[float]) -> dict:
    values = sorted(values)
    return {"median": statistics.median(values), "p10": values[int(0.1 * (len(values) - 1))],
            "p90": values[int(0.9 * (len(values) - 1))], "n": len(values)}


def measure(runner: DecodeGraphRunner, eager: CausalLM, batch_size: int, context: int, iters: int,
            seed: int, timer: Timer) -> dict:
    rng = random.Random(seed + batch_size)
    vocab = runner.spec.vocab_size
    contexts = [rng.randint(max(2, context // 2), context) for _ in range(batch_size)]
    host = {"eager": [], "graph": []}
    gpu = {"eager": [], "graph": []}
    build, agree, max_diff = [], 0, 0.0
    replayed_before = runner.replayed_iterations
    for it in range(iters + 2):  # the first two pairs are warm-up
        t0 = time.perf_counter()
        batch = ForwardBatch.build(decode_inputs(batch_size, contexts, vocab, rng), runner.device)
        build_us = (time.perf_counter() - t0) * 1e6
        ref, h_e, g_e = timer.run(eager.forward, batch)
        out, h_g, g_g = timer.run(runner.forward, batch)
        if it < 2:
            continue
        build.append(build_us)
        host["eager"].append(h_e)
        host["graph"].append(h_g)
        gpu["eager"].append(g_e)
        gpu["graph"].append(g_g)
        ref, out = ref.float(), out.float()
        agree += int((ref.argmax(-1) == out.argmax(-1)).sum())
        max_diff = max(max_diff, float((ref - out).abs().max()))
    replays = runner.replayed_iterations - replayed_before
    if replays != iters + 2:
        raise RuntimeError(f"batch {batch_size}: {replays} of {iters + 2} graph-mode iterations replayed a graph")
    row = {"batch": batch_size, "iters": iters, "build_us": summary(build),
           "host_us": {k: summary(v) for k, v in host.items()},
           "gpu_us": {k: summary(v) for k, v in gpu.items()} if timer.cuda else None,
           "argmax_agreement": agree / (iters * batch_size), "max_logit_diff": max_diff}
    row["host_speedup"] = row["host_us"]["eager"]["median"] / row["host_us"]["graph"]["median"]
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no plot")
        return
    xs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, style in (("eager", "o-"), ("graph", "s-")):
        ax.plot(xs, [r["host_us"][mode]["median"] for r in rows], style, label=f"{mode}: host")
        if rows[0]["gpu_us"]:
            ax.plot(xs, [r["gpu_us"][mode]["median"] for r in rows], style, alpha=0.4, label=f"{mode}: GPU")
    ax.axhline(TARGET_HOST_US_AT_256, color="gray", ls=":", label="target: 100 us host at 256")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("microseconds per iteration (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm2-135m")
    ap.add_argument("--batches", default="1,8,32,64,128,256", help="comma-separated decode batch sizes")
    ap.add_argument("--context", type=int, default=1024, help="largest context; contexts are U[context/2, context]")
    ap.add_argument("--iters", type=int, default=30, help="measured iterations per mode and batch size")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--png", type=Path, help="plot of host and GPU time against batch size")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny preset, EagerReplayBackend: checks the flow, times nothing meaningful")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    batches = sorted({int(b) for b in args.batches.split(",")})
    if not batches or batches[0] < 1 or args.iters < 1 or args.context < 2:
        ap.error("--batches must be positive integers, --iters >= 1, --context >= 2")
    if args.dry_run:
        preset_spec(args.preset, args.context)  # the spec a real run would build: its errors show here too
        device, dtype, preset, backend = torch.device("cpu"), torch.float32, "tiny", EagerReplayBackend()
    else:
        if not torch.cuda.is_available():
            log.error("no CUDA device (use --dry-run to check the flow on the CPU)")
            return 2
        device, dtype, preset, backend = torch.device("cuda"), getattr(torch, args.dtype), args.preset, None
    spec = preset_spec(preset, args.context)
    model = random_causal_lm(spec, device, dtype, seed=args.seed)
    eager = CausalLM(model.spec, model.embed, model.layers, model.final_norm, model.lm_head, device, dtype)
    max_batch = max(batches)
    n_slots = max_batch * args.context
    runner = DecodeGraphRunner(model, max_batch, backend=backend)
    t0 = time.perf_counter()
    runner.allocate_kv_cache(n_slots)
    capture_s = time.perf_counter() - t0
    eager.allocate_kv_cache(n_slots)
    if not runner.graphs:
        log.error("no decode graph was captured (see the log above)")
        return 1
    log.info("%s (%s, %s): captured %s in %.2f s; %d KV slots", preset, device, dtype, sorted(runner.graphs),
             capture_s, n_slots)

    timer = Timer(device.type == "cuda")
    rows = []
    for b in batches:
        rows.append(measure(runner, eager, b, args.context, args.iters, args.seed, timer))
        r = rows[-1]
        log.info("batch %d: host eager %.0f us, graph %.0f us (x%.1f); argmax agreement %.4f",
                 b, r["host_us"]["eager"]["median"], r["host_us"]["graph"]["median"], r["host_speedup"],
                 r["argmax_agreement"])

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {
        "bench": "cuda_graphs", "preset": preset, "dtype": str(dtype).replace("torch.", ""),
        "layers": spec.num_layers, "context": args.context, "device": device_name, "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "dry_run": args.dry_run, "capture_s": capture_s,
        "target_host_us_at_256": TARGET_HOST_US_AT_256, "rows": rows,
    }
    at_256 = next((r for r in rows if r["batch"] == 256), None)
    if at_256 is not None:
        result["host_us_at_256_graph"] = at_256["host_us"]["graph"]["median"]
        result["meets_target"] = result["host_us_at_256_graph"] < TARGET_HOST_US_AT_256

    print(f"\nhost / GPU microseconds per decode iteration, median ({preset}, {spec.num_layers} layers, "
          f"{result['dtype']}, {device_name}{', DRY RUN' if args.dry_run else ''})")
    print(f"{'batch':>6} {'build':>8} {'host eager':>11} {'host graph':>11} {'speedup':>8} "
          f"{'GPU eager':>10} {'GPU graph':>10} {'argmax agree':>13} {'max |dlogit|':>13}")
    for r in rows:
        g = r["gpu_us"] or {"eager": {"median": float("nan")}, "graph": {"median": float("nan")}}
        print(f"{r['batch']:>6} {r['build_us']['median']:>8.0f} {r['host_us']['eager']['median']:>11.0f} "
              f"{r['host_us']['graph']['median']:>11.0f} {r['host_speedup']:>7.1f}x "
              f"{g['eager']['median']:>10.0f} {g['graph']['median']:>10.0f} {r['argmax_agreement']:>13.4f} "
              f"{r['max_logit_diff']:>13.3g}")
    if at_256 is not None:
        verdict = "PASS" if result["meets_target"] else "MISS"
        print(f"host time with graphs at batch 256: {result['host_us_at_256_graph']:.0f} us "
              f"(target < {TARGET_HOST_US_AT_256:.0f} us): {verdict}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        log.info("wrote %s", args.out)
    if args.png:
        plot(rows, args.png, f"decode host time, {preset} ({spec.num_layers} layers, {result['dtype']}), "
                             f"{device_name}{' - DRY RUN, not a measurement' if args.dry_run else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
