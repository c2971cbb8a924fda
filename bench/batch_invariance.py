"""Throughput cost of batch-invariant outputs on the CPU benchmark, in one run.

The workload of bench/throughput.py (N requests, prompts and outputs U[lo, hi] tokens of random
ids, EOS ignored, all arriving at t=0) runs through the orca engine with `batch_invariant=False`
and `True`, the two modes taking turns within each repetition; each mode keeps its best run (on a
shared machine interference only slows a run down). The same is repeated per dtype. The cost is
1 - invariant / default output tokens per second.

    python bench/batch_invariance.py [--dtypes float32 bfloat16] [--repeat 3] [--out r.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install

from orca_ext.benchmarks.throughput import make_workload, run_orca_engine  # noqa: E402
from orca_ext.config import EngineConfig  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    from orca_ext.default_model import default_model_path
    from orca_ext.models import ModelSpec, load_tokenizer

    model = str(default_model_path())
    spec, tok = ModelSpec.from_pretrained(model), load_tokenizer(model)
    jobs = make_workload(args.requests, args.prompt_len, args.output_len, 0, spec.vocab_size,
                         set(tok.all_special_ids))
    print(f"{len(jobs)} requests, prompts U{args.prompt_len}, outputs U{args.output_len}, "
          f"torch threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}")
    results = {}
    for dtype in args.dtypes:
        runs: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(args.repeat):
            for invariant in (False, True):
                config = EngineConfig(device="cpu", dtype=dtype, n_slots=8192, batch_invariant=invariant,
                                      max_num_batched_tokens=None)
                r = run_orca_engine(model, config, jobs, "orca", args.max_batch_size, progress=False)
                runs[invariant].append(r["output_tokens_per_s"])
                print(f"  [{rep + 1}/{args.repeat}] {dtype} batch_invariant={invariant}: "
                      f"{r['output_tokens_per_s']:.1f} output tok/s")
        best = {k: max(v) for k, v in runs.items()}
        cost = 1.0 - best[True] / best[False]
        results[dtype] = {"default_tok_s": best[False], "invariant_tok_s": best[True], "cost": cost,
                          "runs_default": runs[False], "runs_invariant": runs[True]}
        print(f"{dtype}: default {best[False]:.1f} tok/s, batch-invariant {best[True]:.1f} tok/s, "
              f"cost {100 * cost:.1f}%")
    if args.out:
        out = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
               "threads": torch.get_num_threads(), "requests": args.requests, "prompt_len": args.prompt_len,
               "output_len": args.output_len, "results": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
