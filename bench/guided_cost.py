"""Throughput cost of guided decoding: a json_schema on half of the batch, against none.

N requests of the default model (random-id prompts of `--prompt-len` tokens, `--max-tokens`
tokens each, EOS ignored, all arriving at t=0) run through one in-process Server twice per
repetition, taking turns: all unconstrained, then every other request constrained by a JSON
schema whose output cannot end before max_tokens (a string of at least 4 * max_tokens
characters), so both runs generate the same number of tokens. Each mode keeps its best run (on a
shared machine interference only slows a run down). The cost is 1 - guided / plain output tokens
per second, over the whole batch. It also times `apply_token_masks` alone on one [B, V] batch.

    python bench/guided_cost.py [--requests 16] [--max-tokens 64] [--repeat 3]
"""
from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install

from orca_ext import SamplingParams, Server  # noqa: E402
from orca_ext.guided import GrammarCompiler, apply_token_masks, json_schema_spec, llg_tokenizer  # noqa: E402


def run(server: Server, prompts, params) -> float:
    start = time.perf_counter()
    rids = [server.submit(p, sp) for p, sp in zip(prompts, params)]
    tokens = sum(len(server.result(r, timeout=3600).token_ids) for r in rids)
    return tokens / (time.perf_counter() - start)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    with Server(max_batch_size=args.requests) as server:
        compiler = GrammarCompiler(llg_tokenizer(server.tokenizer, server.eos_token_ids, server.vocab_size))
        schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4 * args.max_tokens}},
                  "required": ["story"], "additionalProperties": False}
        t = time.perf_counter()
        grammar = compiler.compile(json_schema_spec(schema, "response_format"))
        compile_ms = (time.perf_counter() - t) * 1e3
        rng = random.Random(0)
        prompts = [[rng.randrange(100, server.vocab_size) for _ in range(args.prompt_len)]
                   for _ in range(args.requests)]
        plain = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, seed=i)
                 for i in range(args.requests)]
        guided = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, seed=i,
                                 guided=grammar if i % 2 else None) for i in range(args.requests)]
        run(server, prompts[:2], plain[:2])  # warm-up
        best = {"plain": 0.0, "guided": 0.0}
        for _ in range(args.repeat):
            best["plain"] = max(best["plain"], run(server, prompts, plain))
            best["guided"] = max(best["guided"], run(server, prompts, guided))

        # apply_token_masks alone: half of a [B, V] batch guided, each matcher a few tokens in.
        rows = []
        for i in range(1, args.requests, 2):
            m = grammar.matcher()
            for tok in server.tokenizer.encode('{"story": "Once', add_special_tokens=False):
                assert m.accept(tok) is None
            rows.append((i, m))
        logits = torch.randn(args.requests, server.vocab_size)
        n = 50
        t = time.perf_counter()
        for _ in range(n):
            apply_token_masks(logits, rows)
        mask_ms = (time.perf_counter() - t) / n * 1e3

    cost = 1 - best["guided"] / best["plain"]
    print(f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
          f"{args.requests} requests x {args.max_tokens} tokens, best of {args.repeat}")
    print(f"schema compile: {compile_ms:.1f} ms (first, uncached)")
    print(f"plain:  {best['plain']:.1f} tok/s")
    print(f"guided: {best['guided']:.1f} tok/s (json_schema on {args.requests // 2} of {args.requests})")
    print(f"cost:   {cost * 100:.1f}%")
    print(f"apply_token_masks, {len(rows)} of {args.requests} rows guided, V={server.vocab_size}: "
          f"{mask_ms:.2f} ms per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
