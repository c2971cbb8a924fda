"""Throughput cost of the logits-side API features, on and off, through the Python API.

    python bench/api_cost.py                    # the default model, a short run
    python bench/api_cost.py --model DIR --requests 32 --max-tokens 64 --prompt-len 512

Each case submits the same batch of requests at once and measures generated tokens per second
of wall time (best of --repeats runs):
    base          sampled requests (temperature 1, seeded)
    logprobs5     the same with logprobs=5 (the processed distribution's top 5 per token)
    penalties     the same with presence, frequency and repetition penalties and a logit_bias
    n4_separate   requests/4 prompts, each submitted 4 times as unrelated requests
    n4_shared     the same 4 sequences per prompt as n=4 siblings (one prefill, copied KV rows)
The first two pairs give the cost of a feature (1 - on/off); the last pair the gain of sharing
the prefill, which grows with the prompt length.

    python bench/api_cost.py --sampler          # the sampler alone: ms per call, on and off
    python bench/api_cost.py --sampler --sampler-mix --requests 5   # one such row beside 4 greedy ones

times one Sampler call over [requests, vocab] random logits per feature (median of 50), the part
of an iteration the features add to; it resolves costs that a loaded machine's end-to-end noise
hides.
"""
from __future__ import annotations

import argparse
import json
import random
import time

from orca_ext import SamplingParams, Server


def run_case(server: Server, prompts: list[list[int]], params: list[SamplingParams], share: list) -> float:
    """Submit every request at once; generated tokens per second until the last one finishes.
    share[i]: index of the request whose prefill request i shares, or None."""
    start = time.perf_counter()
    rids: list[str] = []
    for prompt, p, s in zip(prompts, params, share):
        rids.append(server.submit(prompt, p, share_prefill_with=None if s is None else rids[s]))
    outs = [server.result(r, timeout=3600) for r in rids]
    elapsed = time.perf_counter() - start
    assert all(o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
    return sum(len(o.token_ids) for o in outs) / elapsed


def sampler_cost(batch: int, vocab: int, history: int, mix: bool = False) -> dict:
    """Median ms of one Sampler call (of 200) per feature over random [batch, vocab] logits, each request
    with `history` generated tokens. mix: one request with the feature beside batch - 1 greedy
    requests without any (a single client's cost to an iteration of others), instead of every
    row with it."""
    import statistics

    import torch

    from orca_ext.request import Request
    from orca_ext.sampling import Sampler

    rng = random.Random(0)
    base = dict(max_tokens=history + 16, temperature=1.0, seed=1)
    bias_max = {i * 47 % vocab: (i % 201) - 100.0 for i in range(1024)}  # the most entries allowed
    penalties_max = dict(presence_penalty=2.0, frequency_penalty=-2.0, repetition_penalty=1.3, min_tokens=16)
    variants = {
        "base": SamplingParams(**base),
        "logprobs5": SamplingParams(**base, logprobs=5),
        "penalties": SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                                    logit_bias={i: 1.0 for i in range(0, 1000, 10)}),
        "bias_max": SamplingParams(**base, logit_bias=bias_max),
        "penalties_max": SamplingParams(**base, **penalties_max),
        "controls_max": SamplingParams(**base, logprobs=5, logit_bias=bias_max, **penalties_max),
        "top_k40": SamplingParams(**base, top_k=40),
        "top_p0.95": SamplingParams(**base, top_p=0.95),
        "top_k40_top_p0.95": SamplingParams(**base, top_k=40, top_p=0.95),
        "top_k_2^63": SamplingParams(**base, top_k=2 ** 63),
    }
    greedy = SamplingParams(max_tokens=history + 16)
    logits = torch.randn(batch, vocab)
    sampler = Sampler()
    out = {}
    for name, params in variants.items():
        reqs = []
        for i in range(batch):
            own = params if not mix or i == batch - 1 else greedy
            r = Request(f"{name}{i}", [rng.randrange(vocab) for _ in range(256)], own)
            r.output_token_ids = [rng.randrange(vocab) for _ in range(history)]
            reqs.append(r)
        times = []
        for _ in range(200):
            x = logits.clone()  # the sampler consumes its logits
            t = time.perf_counter()
            sampler(x, reqs)
            times.append(time.perf_counter() - t)
        out[name] = round(1000 * statistics.median(times), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded default model)")
    ap.add_argument("--requests", type=int, default=16, help="sequences per case (a multiple of 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--sampler", action="store_true", help="time the sampler alone (see above)")
    ap.add_argument("--sampler-mix", action="store_true",
                    help="with --sampler: one row with the feature beside greedy rows (the others' iteration)")
    args = ap.parse_args()
    if args.sampler:
        print(json.dumps({"batch": args.requests, "mix": args.sampler_mix,
                          "sampler_ms": sampler_cost(args.requests, 49152, args.max_tokens, args.sampler_mix)},
                         indent=2))
        return
    rng = random.Random(0)
    n = args.requests
    with Server(args.model, device=args.device, max_batch_size=n,
                n_slots=n * (args.prompt_len + args.max_tokens) + 64) as server:
        vocab = server.vocab_size
        distinct = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(n)]
        base = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1, ignore_eos=True)
        groups = [distinct[i // 4 * 4] for i in range(n)]  # 4 sequences per prompt
        cases = {
            "base": (distinct, [base] * n, [None] * n),
            "logprobs5": (distinct, [SamplingParams(**{**_fields(base), "logprobs": 5})] * n, [None] * n),
            "penalties": (distinct, [SamplingParams(**{**_fields(base), "presence_penalty": 0.5,
                                                       "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                                                       "logit_bias": {i: 1.0 for i in range(0, 1000, 10)}})] * n,
                          [None] * n),
            "n4_separate": (groups, [base.for_sequence(i % 4) for i in range(n)], [None] * n),
            "n4_shared": (groups, [base.for_sequence(i % 4) for i in range(n)],
                          [None if i % 4 == 0 else i // 4 * 4 for i in range(n)]),
        }
        run_case(server, distinct[:2], [base] * 2, [None] * 2)  # warm-up
        rates = {}
        for name, (prompts, params, share) in cases.items():
            rates[name] = max(run_case(server, prompts, params, share) for _ in range(args.repeats))
    report = {
        "config": vars(args),
        "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
        "logprobs5_cost": round(1 - rates["logprobs5"] / rates["base"], 3),
        "penalties_cost": round(1 - rates["penalties"] / rates["base"], 3),
        "n4_shared_speedup": round(rates["n4_shared"] / rates["n4_separate"], 2),
    }
    print(json.dumps(report, indent=2))


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in ("max_tokens", "temperature", "seed", "ignore_eos")}


if __name__ == "__main__":
    main()
