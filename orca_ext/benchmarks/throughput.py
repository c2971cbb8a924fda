"""Throughput benchmark: Orca iteration-level scheduling vs request-level batching, in one run.

Systems, all on the same workload (N requests, prompt and output lengths drawn uniformly from the
given ranges, random token ids or random text, EOS ignored so every request produces exactly its
output length):

  orca    our engine, iteration-level scheduling (--max-batch-size, default 32)
  static  our engine, request-level batching: a batch runs until all its members finish
          (--static-batch-size, default 16)
  hf      transformers' own `generate` with static batches of --static-batch-size in arrival
          order: left padding, greedy, max_new_tokens = the batch's longest output; only each
          request's own output tokens count as useful

All requests arrive at t=0; throughput = useful output tokens / wall time from the first submit
to the last result. Model loading and a short warm-up are not timed.

    orca-ext bench [--requests 32] [--prompt-len 16 128] [--output-len 16 128] [--out r.json]
    python -m orca_ext bench ...        (the same; so is `python bench/throughput.py ...`)
    orca-ext bench --profile            (cProfile of one orca run, time split by operation)
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import logging
import platform
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..config import EngineConfig
from ..options import add_engine_arguments
from ..resources import resolve_device, resolve_dtype

log = logging.getLogger(__name__)

WORDS = ("the of and to in is was for on that with as by at from his her an which you were all "
         "time river light stone garden music window number people water city market story "
         "bright quiet ancient simple heavy golden rapid distant gentle").split()


# -- workload ---------------------------------------------------------------------------------------
def make_workload(n: int, prompt_len: Sequence[int], output_len: Sequence[int], seed: int,
                  vocab_size: int, special_ids: set[int], kind: str = "ids",
                  tokenizer=None) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)] with lengths ~ U[lo, hi] (inclusive)."""
    rng = random.Random(seed)
    normal = [t for t in range(vocab_size) if t not in special_ids]
    jobs = []
    for _ in range(n):
        p = rng.randint(prompt_len[0], prompt_len[1])
        o = rng.randint(output_len[0], output_len[1])
        if kind == "ids":
            prompt = [rng.choice(normal) for _ in range(p)]
        else:
            ids: list[int] = []
            while len(ids) < p:
                text = " ".join(rng.choice(WORDS) for _ in range(p))
                ids = tokenizer.encode(text, add_special_tokens=False)
            prompt = ids[:p]
        jobs.append((prompt, o))
    return jobs


# -- systems --------------------------------------------------------------------------------------
def run_orca_engine(model: str, config: EngineConfig, jobs, policy: str, batch_size: int, progress: bool) -> dict:
    from tqdm import tqdm

    from ..sampling import SamplingParams
    from ..server import Server

    with Server(model, config=dataclasses.replace(config, scheduler=policy, max_batch_size=batch_size)) as server:
        # Warm-up (not timed): first-call overheads of the kernels and allocator.
        server.generate([jobs[0][0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))
        base = server.stats()
        t0 = time.perf_counter()
        ids = [server.submit(p, SamplingParams(max_tokens=o, ignore_eos=True)) for p, o in jobs]
        outs = []
        for rid in tqdm(ids, desc=f"{policy:>6}", unit="req", disable=not progress, leave=False):
            outs.append(server.result(rid))
        elapsed = time.perf_counter() - t0
        st = server.stats()
    bad = [o for o, (_, n) in zip(outs, jobs) if o.finish_reason != "length" or len(o.token_ids) != n]
    if bad:
        raise RuntimeError(f"{policy}: {len(bad)} requests did not produce their full output: {bad[0]}")
    useful = sum(len(o.token_ids) for o in outs)
    ttft = [o.first_token_time - o.arrival_time for o in outs]
    return dict(system=policy, elapsed_s=elapsed, output_tokens=useful,
                output_tokens_per_s=useful / elapsed,
                prompt_tokens=sum(len(p) for p, _ in jobs),
                iterations=st["iterations"] - base["iterations"],
                mean_batch_size=useful / max(1, st["iterations"] - base["iterations"]),
                max_batch_size=batch_size, n_slots=st["n_slots"], device=st["device"], dtype=st["dtype"],
                mean_ttft_s=sum(ttft) / len(ttft))


def run_hf(model_dir: str, jobs, batch_size: int, device: str, dtype: torch.dtype, progress: bool) -> dict:
    import transformers
    from tqdm import tqdm

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    cfg = model.generation_config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_id or 0)
    if isinstance(pad, (list, tuple)):
        pad = pad[0]

    def generate(batch):
        longest = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding
            ids[i, longest - len(p):] = torch.tensor(p)
            mask[i, longest - len(p):] = 1
        new = max(o for _, o in batch)
        # min_new_tokens = max_new_tokens: EOS can never end a row early (EOS is ignored).
        gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                            pad_token_id=pad, eos_token_id=cfg.eos_token_id)
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=gen)
        assert out.shape[1] == longest + new
        return out

    generate([(jobs[0][0][:8], 4)])  # warm-up
    batches = [jobs[i:i + batch_size] for i in range(0, len(jobs), batch_size)]
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="    hf", unit="batch", disable=not progress, leave=False):
        generate(batch)
    elapsed = time.perf_counter() - t0
    useful = sum(o for _, o in jobs)
    computed = sum(len(b) * max(o for _, o in b) for b in batches)
    del model
    gc.collect()
    return dict(system="hf", elapsed_s=elapsed, output_tokens=useful, output_tokens_per_s=useful / elapsed,
                prompt_tokens=sum(len(p) for p, _ in jobs), generated_incl_padding=computed,
                max_batch_size=batch_size, device=str(device), dtype=str(dtype).replace("torch.", ""))


# -- profile --------------------------------------------------------------------------------------
# cProfile does not see tensor operators (x + y, a * b, t[i]): their time lands in the
# calling Python frame, so this bucket is Python glue plus that inline tensor arithmetic.
PY_LABEL = "Python frames (incl. inline tensor + * [] operators)"
_CATEGORIES = [  # (label, substrings of a built-in function's name), first match wins
    ("matmul: fused rmsnorm+QKV (_C.rmsnorm_qkv)", ("rmsnorm_qkv",)),
    ("matmul: F.linear (o_proj, gate_up, down, lm_head)", ("linear",)),
    ("attention (_C.ragged_attention)", ("ragged_attention",)),
    ("KV write (_C.slab_write)", ("slab_write",)),
    ("rmsnorm (_C.rms_norm)", ("rms_norm",)),
]


def profile_orca(model: str, config: EngineConfig, jobs, batch_size: int, top: int = 25) -> dict:
    """cProfile of the orca engine driven in this thread (the Server's loop thread would be
    invisible to cProfile); returns and prints the time split by operation."""
    from ..detokenizer import IncrementalDetokenizer
    from ..engine import Engine
    from ..request import Request
    from ..sampling import SamplingParams
    from ..scheduler import make_scheduler
    from ..server import Server
    from ..executor_factory import make_executor

    config = dataclasses.replace(config, scheduler="orca", max_batch_size=batch_size)
    with Server(model, config=config) as server:  # only for its KV sizing
        n_slots = server.n_slots
    config = config.resolve()
    started = make_executor(model, config)
    tok = started.tokenizer

    def run(profiler: Optional[cProfile.Profile]) -> float:
        engine = Engine(started.executor, make_scheduler(config, n_slots))
        for i, (p, o) in enumerate(jobs):
            engine.add_request(Request(f"p{i}", p, SamplingParams(max_tokens=o, ignore_eos=True),
                                       IncrementalDetokenizer(tok, p) if tok else None))
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        while engine.has_work():
            engine.step()
        if profiler:
            profiler.disable()
        return time.perf_counter() - t0

    plain = run(None)
    prof = cProfile.Profile()
    profiled = run(prof)
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # sum of self times = profiled wall time
    split: dict[str, float] = {label: 0.0 for label, _ in _CATEGORIES}
    split["other torch ops (embedding, silu, mul, add, index, sort, ...)"] = 0.0
    split[PY_LABEL] = 0.0
    for (filename, _, name), (_, _, tottime, _, _) in stats.stats.items():
        if filename == "~":  # a built-in (C) function
            for label, keys in _CATEGORIES:
                if any(k in name for k in keys):
                    split[label] += tottime
                    break
            else:
                if "torch" in name or "method" in name and ("Tensor" in name or "_C" in name):
                    split["other torch ops (embedding, silu, mul, add, index, sort, ...)"] += tottime
                else:
                    split[PY_LABEL] += tottime
        else:
            split[PY_LABEL] += tottime
    stages = {("sampling.py", "__call__"): "sampling (Sampler.__call__)",
              ("detokenizer.py", "add"): "detokenization (IncrementalDetokenizer.add)",
              ("batch.py", "build"): "ForwardBatch.build",
              ("engine.py", "_schedule"): "scheduling (select)",
              ("engine.py", "_postprocess"): "postprocess (append, stops, complete)",
              ("causal_lm.py", "forward"): "model forward (all of it)"}
    cumulative: dict[str, float] = {}
    for (filename, _, name), (_, _, _, cumtime, _) in stats.stats.items():
        label = stages.get((Path(filename).name, name))
        if label:
            cumulative[label] = cumulative.get(label, 0.0) + cumtime
    print(f"\nprofile of one orca run ({len(jobs)} requests): {plain:.2f}s unprofiled, "
          f"{profiled:.2f}s under cProfile")
    print("self time by operation:")
    for label, t in sorted(split.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<58} {t:7.2f}s {100 * t / total:5.1f}%")
    print("cumulative time of engine stages:")
    for label, t in sorted(cumulative.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<58} {t:7.2f}s {100 * t / total:5.1f}%")
    print(f"top {top} functions by self time:")
    stats.sort_stats("tottime").print_stats(top)
    return dict(unprofiled_s=plain, profiled_s=profiled,
                self_time_fraction={k: v / total for k, v in split.items()},
                stage_fraction={k: v / total for k, v in cumulative.items()})


# -- main -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orca-ext bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32, help="number of requests (default 32)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("LO", "HI"),
                   help="prompt length range, inclusive (default 16 128)")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("LO", "HI"),
                   help="output length range, inclusive (default 16 128)")
    p.add_argument("--workload", choices=["ids", "text"], default="ids",
                   help="prompts of random token ids (default) or random words")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--static-batch-size", type=int, default=16,
                   help="batch size of the static and hf baselines (default 16)")
    p.add_argument("--systems", default="orca,static,hf",
                   help="comma list of orca, static, hf (default all three)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every system this many times, interleaved, and keep each one's best (default 1)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--profile", action="store_true",
                   help="also profile one orca run with cProfile and print the time split")
    p.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the transformers baseline (default: the same as --dtype)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    add_engine_arguments(p)  # --max-batch-size applies to orca; --scheduler is ignored
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - {"orca", "static", "hf"}
    if unknown:
        print(f"error: --systems: unknown {sorted(unknown)}; choose from orca, static, hf", file=sys.stderr)
        return 2
    for name, (lo, hi) in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)):
        if not 1 <= lo <= hi:
            print(f"error: {name} needs 1 <= LO <= HI, got {lo} {hi}", file=sys.stderr)
            return 2
    if args.requests < 1 or args.static_batch_size < 1 or args.repeat < 1:
        print("error: --requests, --static-batch-size and --repeat must be >= 1", file=sys.stderr)
        return 2

    from ..models import ModelSpec, load_tokenizer

    if args.model is None:
        from ..default_model import default_model_path

        args.model = str(default_model_path())
    config = EngineConfig.from_args(args)
    spec = ModelSpec.from_pretrained(args.model)
    tok = load_tokenizer(args.model)
    jobs = make_workload(args.requests, args.prompt_len, args.output_len, args.seed, spec.vocab_size,
                         set(tok.all_special_ids), args.workload, tok)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    hf_dtype = resolve_dtype(args.hf_dtype, device) if args.hf_dtype else dtype
    progress = not args.no_progress
    print(f"model {args.model} on {device} ({dtype}; transformers {hf_dtype}), "
          f"torch threads {torch.get_num_threads()}; "
          f"{len(jobs)} requests, prompts U{args.prompt_len}, outputs U{args.output_len}, "
          f"{sum(o for _, o in jobs)} output tokens")

    results: dict[str, dict] = {}
    runs: dict[str, list[float]] = {s: [] for s in systems}
    # Systems are interleaved within each repetition, and each keeps its best run: on a shared
    # machine, interference only ever slows a run down.
    for rep in range(args.repeat):
        for system in systems:
            if system == "hf":
                r = run_hf(args.model, jobs, args.static_batch_size, device, hf_dtype, progress)
            else:
                size = args.max_batch_size if system == "orca" else args.static_batch_size
                r = run_orca_engine(args.model, config, jobs, system, size, progress)
            runs[system].append(r["output_tokens_per_s"])
            if system not in results or r["output_tokens_per_s"] > results[system]["output_tokens_per_s"]:
                results[system] = r
            print(f"  [{rep + 1}/{args.repeat}] {system:>6}: {r['output_tokens']} tokens in {r['elapsed_s']:.2f}s = "
                  f"{r['output_tokens_per_s']:.1f} output tokens/s")
            gc.collect()
    for system in systems:
        results[system]["runs_output_tokens_per_s"] = runs[system]

    ratios = {}
    names = [s for s in ("orca", "static", "hf") if s in results]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ratios[f"{a}/{b}"] = results[a]["output_tokens_per_s"] / results[b]["output_tokens_per_s"]
    print()
    print(f"{'system':>8} {'dtype':>9} {'batch':>6} {'time (s)':>9} {'out tok/s':>10} {'iterations':>11}")
    for name in names:
        r = results[name]
        print(f"{name:>8} {r['dtype']:>9} {r['max_batch_size']:>6} {r['elapsed_s']:>9.2f} "
              f"{r['output_tokens_per_s']:>10.1f} {r.get('iterations', '-'):>11}")
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")

    report = dict(config=dict(model=args.model, device=str(device), dtype=str(dtype).replace("torch.", ""),
                              hf_dtype=str(hf_dtype).replace("torch.", ""),
                              requests=args.requests, prompt_len=args.prompt_len, output_len=args.output_len,
                              workload=args.workload, seed=args.seed, max_batch_size=args.max_batch_size,
                              static_batch_size=args.static_batch_size, repeat=args.repeat,
                              torch_threads=torch.get_num_threads(),
                              torch=torch.__version__, python=platform.python_version()),
                  results=results, ratios=ratios)
    if args.profile:
        report["profile"] = profile_orca(args.model, config, jobs, args.max_batch_size)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 0

