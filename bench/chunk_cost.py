"""What a prompt chunk at a long context adds to an iteration of decodes, on CPU.

One iteration's forward, as the engine's LocalExecutor runs it (ForwardBatch.build + forward +
greedy pick of the next tokens), on the default model as a server loads it (`--weights served`:
the embedded GGUF's Q4_1 blocks with float32 activations; `--weights float32`: the converted
float32 folder): 4 decodes over ~100-token contexts alone, then with one more request's prompt
chunk of c tokens whose first token sits at position L (L tokens of its prompt already in the KV
cache). Median of `--repeat` runs after a warm-up. The extra cost of the chunk over its token
count is what a long prompt's chunks take from the decodes that share its iterations beyond what
their tokens say. A chunk of one token at position L is one more decode row at context L
(`--chunks 1`): what a stream deep into a long context adds to every iteration it takes part in.

`--decode-rows` measures decode rows instead (of `--model`, if given): 4 more rows whose tokens
sit at position L beside the 4 decodes, per row, the cases interleaved round by round (one extra
row alone lands on the kernels' register-block edges, so it says more about T = 5 than about a
row): what a stream deep into a long context adds to every iteration it takes part in
(fairness.DECODE_CONTEXT_COST_TOKENS).

`--attention` times the attention kernel alone instead (ops.ragged_attention for the chunk's one
request, the model's head shape, times its layers), on one thread so that nothing but the
kernel's own work is timed: it shows which chunk sizes take a slow path.

    python bench/chunk_cost.py [--chunks 1 8 32 128] [--contexts 0 300 600 1200] [--repeat 7] [--attention]
                               [--decode-rows] [--weights served|float32] [--model PATH]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a checkout without an install

N_DECODES = 4
DECODE_CONTEXT = 100
SLAB = 8192  # slots per request in the KV cache (the chunk's request needs up to L + c)


def iteration_s(model, inputs) -> float:
    """Seconds of one iteration's forward and greedy pick, as the engine's LocalExecutor runs it
    (inside inference_mode and the modes being measured)."""
    from orca_ext.models import ForwardBatch

    t0 = time.perf_counter()
    model.forward(ForwardBatch.build(inputs)).argmax(dim=-1).tolist()
    return time.perf_counter() - t0


def decode_inputs(rng: random.Random, context: int, first_slab: int) -> list:
    """N_DECODES decode rows (one random token each) at position `context`, in consecutive slabs."""
    return [([rng.randrange(1000, 40000)], context, SLAB * (first_slab + i)) for i in range(N_DECODES)]


def iteration_ms(model, inputs, batch_invariant: bool, repeat: int) -> float:
    from orca_ext import modes

    with torch.inference_mode(), modes.using(batch_invariant=batch_invariant):
        iteration_s(model, inputs)  # a warm-up
        times = [iteration_s(model, inputs) for _ in range(repeat)]
    return 1e3 * statistics.median(times)


def measure(model, chunks, contexts, batch_invariant: bool, repeat: int) -> list[dict]:
    rng = random.Random(0)
    decodes = decode_inputs(rng, DECODE_CONTEXT, 0)
    # Warm-up: the first forwards after loading (page faults, thread start-up) are far slower.
    widest = ([rng.randrange(1000, 40000) for _ in range(max(chunks))], max(contexts), SLAB * N_DECODES)
    iteration_ms(model, decodes + [widest], batch_invariant, 3)
    base = iteration_ms(model, decodes, batch_invariant, repeat)
    rows = []
    for c in chunks:
        for ctx in contexts:
            chunk = ([rng.randrange(1000, 40000) for _ in range(c)], ctx, SLAB * N_DECODES)
            ms = iteration_ms(model, decodes + [chunk], batch_invariant, repeat)
            rows.append({"chunk": c, "context": ctx, "iteration_ms": ms, "decodes_ms": base,
                         "extra_ms": ms - base, "extra_ms_per_token": (ms - base) / c})
    after = iteration_ms(model, decodes, batch_invariant, repeat)  # the load may have changed
    for r in rows:
        r["decodes_ms_after"] = after
    return rows


def decode_rows_ms(model, contexts, batch_invariant: bool, repeat: int) -> None:
    """Per-row cost of N_DECODES more decode rows at each context, over the N_DECODES decodes alone."""
    from orca_ext import modes

    rng = random.Random(0)
    decodes = decode_inputs(rng, DECODE_CONTEXT, 0)
    cases = {"alone": decodes}
    for ctx in [DECODE_CONTEXT] + [c for c in contexts if c != DECODE_CONTEXT]:
        cases[ctx] = decodes + decode_inputs(rng, ctx, N_DECODES)
    times: dict = {name: [] for name in cases}
    with torch.inference_mode(), modes.using(batch_invariant=batch_invariant):
        for round_ in range(repeat + 2):  # two warm-up rounds
            for name, inputs in cases.items():  # interleaved: the host's drift falls on every case
                seconds = iteration_s(model, inputs)
                if round_ >= 2:
                    times[name].append(seconds)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    short = (ms[DECODE_CONTEXT] - ms["alone"]) / N_DECODES
    print(f"\nbatch_invariant={batch_invariant}: {N_DECODES} decodes (context {DECODE_CONTEXT}) alone: {ms['alone']:.1f} ms")
    print(f"| {N_DECODES} more rows at context L | iteration ms | ms per added row | against a row at {DECODE_CONTEXT} |")
    print("|---|---|---|---|")
    for ctx in sorted(c for c in cases if c != "alone"):
        per_row = (ms[ctx] - ms["alone"]) / N_DECODES
        print(f"| {ctx} | {ms[ctx]:.1f} | {per_row:.2f} | {per_row / short:.2f}x |")


def attention_ms(spec, chunks, contexts, repeat: int) -> None:
    """The chunk's attention alone, one thread, all layers (same shape and modes as the model)."""
    from orca_ext import modes, ops

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    n_keys = max(contexts) + max(chunks)
    k = torch.randn(n_keys, spec.num_kv_heads, spec.head_dim, generator=gen)
    v = torch.randn(n_keys, spec.num_kv_heads, spec.head_dim, generator=gen)
    r = spec.num_heads // spec.num_kv_heads
    print(f"\nattention alone, 1 thread, x{spec.num_layers} layers ({spec.num_heads} query heads, "
          f"{spec.num_kv_heads} KV heads, head_dim {spec.head_dim}): ms (ms per chunk token)")
    print("| chunk c | query vectors per KV head (c x " + str(r) + ") | " + " | ".join(f"L={L}" for L in contexts) + " |")
    print("|---|---|" + "---|" * len(contexts))
    for c in chunks:
        q = torch.randn(c, spec.num_heads, spec.head_dim, generator=gen)
        cells = []
        for ctx in contexts:
            index = [torch.tensor([x], dtype=torch.int32) for x in (0, c, 0, ctx + c)]
            with torch.inference_mode(), modes.using(batch_invariant=True):
                times = []
                for i in range(repeat + 1):
                    t0 = time.perf_counter()
                    ops.ragged_attention(q, k, v, *index, spec.head_dim ** -0.5)
                    if i:
                        times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times) * spec.num_layers
            cells.append(f"{ms:.1f} ({ms / c:.2f})")
        print(f"| {c} | {c * r} | " + " | ".join(cells) + " |")


def print_table(rows: list[dict], batch_invariant: bool) -> None:
    base = rows[0]["decodes_ms"]
    print(f"\nbatch_invariant={batch_invariant}: {N_DECODES} decodes (context {DECODE_CONTEXT}) alone: {base:.1f} ms"
          f" (again after the table: {rows[0]['decodes_ms_after']:.1f} ms)")
    print("| chunk c | context L | iteration ms | extra ms | extra ms / chunk token | iteration / decodes alone |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk']} | {r['context']} | {r['iteration_ms']:.1f} | {r['extra_ms']:.1f} | "
              f"{r['extra_ms_per_token']:.2f} | {r['iteration_ms'] / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 300, 600, 1200])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--invariant", choices=["on", "off", "both"], default="both",
                        help="batch-invariant kernels (on: the CPU server's default)")
    parser.add_argument("--attention", action="store_true", help="time the attention kernel alone")
    parser.add_argument("--decode-rows", action="store_true", help="time added decode rows at each context")
    parser.add_argument("--weights", choices=["served", "float32"], default="served",
                        help="served: the embedded GGUF as a server loads it (default); float32: the converted folder")
    parser.add_argument("--model", default=None, help="another model folder or .gguf instead of the default model")
    args = parser.parse_args()
    if max(args.contexts) + max(args.chunks) > SLAB:
        parser.error(f"context + chunk must fit in {SLAB} slots")
    torch.set_num_threads(args.threads)

    from orca_ext.default_model import default_model_path, default_model_source
    from orca_ext.models import load_model

    if args.model:
        path = args.model
    else:
        path = default_model_source() if args.weights == "served" else default_model_path()
    model = load_model(path, device="cpu", dtype=torch.float32)
    from orca_ext import modes
    from orca_ext.quant.formats import resolve_quant_activations

    # Products of GGUF blocks as a server runs them (int8 activations for a Q8_0 or K-quant file).
    modes.update(quant_activations=resolve_quant_activations("auto", dict(model.spec.block_bytes)))
    if args.decode_rows:
        from orca_ext.fairness import DECODE_CONTEXT_COST_TOKENS

        print(f"{Path(path).name}: fair admission charges a decode row 2 x (1 + L / {DECODE_CONTEXT_COST_TOKENS})")
    if args.attention:
        attention_ms(model.spec, args.chunks, args.contexts, args.repeat)
        return
    if args.decode_rows:
        model.allocate_kv_cache(SLAB * 2 * N_DECODES)
        for invariant in {"on": [True], "off": [False], "both": [True, False]}[args.invariant]:
            decode_rows_ms(model, args.contexts, invariant, args.repeat)
        return
    model.allocate_kv_cache(SLAB * (N_DECODES + 1))
    for invariant in {"on": [True], "off": [False], "both": [True, False]}[args.invariant]:
        print_table(measure(model, args.chunks, args.contexts, invariant, args.repeat), invariant)


if __name__ == "__main__":
    main()
