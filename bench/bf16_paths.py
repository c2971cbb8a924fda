"""A/B of the CPU bf16 instruction paths (`_C.cpu_bf16_paths()`: avx512_bf16 against amx_bf16, or
whichever two --paths names) on one bfloat16 model, in one run.

One model is loaded once; the paths take turns step by step (the first of each pair alternates,
`_C.set_cpu_bf16_path` between steps), on
  * one T=1 decode forward of a request with a `--context`-token prompt already in the cache;
  * one prefill forward of a `--prompt`-token prompt (the whole prompt in one forward).
Printed per case: best and median per path, their ratio, and for prefill the projections'
GFLOP/s (2 x weight elements x tokens / median). The paths round differently, so the logits are
not compared; each path's own correctness is tests/test_skinny_gemm.py's.

    .venv/bin/python bench/bf16_paths.py [--model DIR] [--paths avx512_bf16 amx_bf16]
        [--steps 40] [--context 191] [--prompt 512]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install

from decode_ab import ab, decode_batch, summary, weight_bytes  # noqa: E402
from orca_ext import _C  # noqa: E402
from orca_ext.models import ForwardBatch, load_model  # noqa: E402


def on_path(path: str, fn):
    def run():
        _C.set_cpu_bf16_path(path)
        return fn()
    return run


def main(argv=None) -> int:
    from orca_ext.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--paths", nargs=2, default=["avx512_bf16", "amx_bf16"])
    p.add_argument("--steps", type=int, default=40, help="timed steps per path and case (>= 10)")
    p.add_argument("--context", type=int, default=191)
    p.add_argument("--prompt", type=int, default=512)
    args = p.parse_args(argv)
    if args.steps < 10:
        p.error("--steps must be >= 10")
    missing = [name for name in args.paths if name not in _C.cpu_bf16_paths()]
    if missing:
        p.error(f"this CPU cannot run {missing}; it has {_C.cpu_bf16_paths()}")
    path = args.model or default_model_path()
    model = load_model(path, dtype="bfloat16")
    model.allocate_kv_cache(max(args.context, args.prompt) + 8)
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, model {path.name} bfloat16, {args.steps} interleaved steps per path")
    before = _C.cpu_bf16_path()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.spec.vocab_size, (args.prompt,), generator=gen).tolist()
    prefill = ForwardBatch.build([(prompt, 0, 0)], "cpu")
    try:
        with torch.inference_mode():
            decode = decode_batch(model, args.context)
            cases = [(f"decode @{args.context}", lambda: model.forward(decode), 0),
                     (f"prefill {args.prompt}", lambda: model.forward(prefill), args.prompt)]
            for name, step, tokens in cases:
                a, b = ab(on_path(args.paths[0], step), on_path(args.paths[1], step),
                          args.steps if tokens == 0 else max(10, args.steps // 4), warmup=2)
                print(name)
                for label, ms in zip(args.paths, (a, b)):
                    line = summary(label, ms)
                    if tokens:
                        elems = weight_bytes(model) / model.lm_head.element_size()
                        line += f"  {2.0 * elems * tokens / statistics.median(ms) * 1e-6:7.0f} GFLOP/s"
                    print(line)
                print(f"{'':>10}  {args.paths[1]} / {args.paths[0]}: "
                      f"{statistics.median(a) / statistics.median(b):.3f}x (median time ratio)")
    finally:
        _C.set_cpu_bf16_path(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
