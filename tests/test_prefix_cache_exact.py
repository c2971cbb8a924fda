"""Prefix caching is exact: with batch-invariant kernels, every request's logits and tokens,
greedy and seeded, are the same bits with the prefix cache as without it, in float32 and
bfloat16, with whole prompts and under chunked prefill.

The traffic comes in waves, each built from the previous waves' outputs, so it holds prompts
that hit fully (all but the last prompt token), partly, exactly at and across block edges, the
next turns of finished chats (their cached rows come from decode steps), and, after a large
request has evicted most entries, prompts whose entries are gone and prompts whose entries
survived. The cache run must actually hit and evict, or the comparison proves nothing.
"""
from __future__ import annotations

import random

import pytest
import torch

from invariance_cases import RecordingSampler
from orca_ext import modes
from orca_ext.config import EngineConfig
from orca_ext.engine import Engine
from orca_ext.executor import LocalExecutor
from orca_ext.models import load_model
from orca_ext.prefix_cache import PrefixCache
from orca_ext.request import Request
from orca_ext.sampling import SamplingParams
from orca_ext.scheduler import make_scheduler

N_SLOTS = 400
BLOCK = 8


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def seeded(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.9, top_k=40, top_p=0.95, seed=seed, ignore_eos=True)


def waves(rng: random.Random):
    """Generator of waves [(id, prompt, params)]; receives the finished requests of each wave."""
    def toks(n):
        return [rng.randrange(1000) for _ in range(n)]

    system, other = toks(37), toks(29)
    done = yield [("a", system + toks(5), greedy(6)), ("s", other + toks(4), seeded(6, 11)),
                  ("x", toks(20), greedy(4))]
    a, s = done["a"], done["s"]
    done = yield [("a-again", list(a.prompt_token_ids), greedy(5)),                        # full hit
                  ("sys-37", system + toks(6), greedy(5)),                                  # across an edge
                  ("sys-16", system[:16] + toks(9), seeded(5, 3)),                          # at an edge
                  ("sys-3", system[:3] + toks(12), greedy(3)),                              # under a block
                  ("a-turn2", a.prompt_token_ids + a.output_token_ids + toks(4), greedy(6)),
                  ("s-turn2", s.prompt_token_ids + s.output_token_ids + toks(3), seeded(6, 12))]
    turn2 = done["a-turn2"]
    done = yield [("filler", toks(250), greedy(3))]                                         # evicts
    yield [("filler-again", list(done["filler"].prompt_token_ids[:100]) + toks(3), greedy(3))]
    yield [("a-turn3", turn2.prompt_token_ids + turn2.output_token_ids + toks(5), greedy(4)),
           ("sys-again", system + toks(7), seeded(4, 5))]
    fresh = toks(40)  # arrive together: under a token budget the later ones copy the first's rows
    yield [("live-1", fresh + toks(5), greedy(4)), ("live-2", fresh + toks(6), seeded(4, 9)),
           ("live-3", fresh + toks(3), greedy(4))]


def run(model, cache: bool, budget, seed: int):
    sampler = RecordingSampler()
    sched = make_scheduler(EngineConfig(max_batch_size=8, max_num_batched_tokens=budget), N_SLOTS)
    engine = Engine(LocalExecutor(model, sampler), sched,
                    prefix_cache=PrefixCache(N_SLOTS, BLOCK) if cache else None)
    gen = waves(random.Random(seed))
    wave, done = next(gen), {}
    while True:
        reqs = [Request(rid, prompt, params) for rid, prompt, params in wave]
        for r in reqs:
            engine.add_request(r)
        while engine.has_work():
            engine.step()
        assert all(r.finish_reason == "length" for r in reqs), reqs
        done.update((r.request_id, r) for r in reqs)
        try:
            wave = gen.send(done)
        except StopIteration:
            break
    out = {rid: (r.output_token_ids, torch.stack(sampler.rows[rid])) for rid, r in done.items()}
    return out, {rid: r.num_prefix_hit for rid, r in done.items()}, sched.prefix_cache


@pytest.mark.parametrize("dtype,budget", [(torch.float32, None), (torch.float32, 16), (torch.bfloat16, 16)])
def test_tokens_and_logits_with_the_cache_equal_those_without(tiny_model_dir, dtype, budget):
    model = load_model(tiny_model_dir("qwen2"), device="cpu", dtype=dtype)
    seed = hash((str(dtype), budget)) % 1000
    with modes.using(batch_invariant=True):
        plain, _, _ = run(model, cache=False, budget=budget, seed=seed)
        cached, hits, cache = run(model, cache=True, budget=budget, seed=seed)
    assert plain.keys() == cached.keys()
    for rid in plain:
        assert cached[rid][0] == plain[rid][0], (rid, "tokens differ")
        assert torch.equal(cached[rid][1], plain[rid][1]), (rid, "logits differ")
    # The cases the traffic is built to cover did happen.
    assert hits["a-again"] == 41  # the whole prompt but its last token
    assert hits["sys-37"] == 37 and hits["sys-16"] == 16 and hits["sys-3"] == 0
    assert hits["a-turn2"] == 42 + 5 and hits["s-turn2"] == 33 + 5  # rows written by decode steps
    assert cache.stats.evictions > 0 and hits["filler-again"] == 100  # the filler evicted the rest
    assert hits["a-turn3"] == 0  # its chat's entry was evicted (sys-again may copy a-turn3's rows)
    if budget is not None:
        assert cache.stats.live_hits >= 2 and hits["live-2"] >= 32 and hits["live-3"] >= 32
