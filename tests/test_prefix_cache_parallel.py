"""Prefix cache hits on tensor and pipeline parallel workers (CPU, gloo): the copies of cached
rows reach every worker's KV pools through the executor, before the request's first batch,
also while other batches are in flight (two pipeline stages), so the greedy tokens equal the
single process's without a cache, request by request.
"""
from __future__ import annotations

import random
import threading

import pytest

from orca_ext.sampling import SamplingParams
from orca_ext.server import Server
from test_distributed import assert_idle, start_server


def traffic(seed: int):
    """Two waves: prompts with shared prefixes, then their repeats, longer turns and newcomers,
    submitted together so that hits are admitted next to running requests."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(1000) for _ in range(n)]

    system = toks(40)
    first = [system + toks(5), system[:21] + toks(9), toks(30)]
    second = lambda outs: [first[0], system + toks(3), first[1] + outs[1] + toks(4), first[2][:25] + toks(6),
                           toks(12), system[:33] + toks(2)]
    return first, second


def run(server: Server, seed: int) -> list[list[int]]:
    first, second = traffic(seed)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = [o.token_ids for o in server.generate(first, params)]
    wave = second(outs)
    results: list = [None] * len(wave)

    def one(i):  # separate submissions: they arrive while earlier batches run
        results[i] = server.generate(wave[i], params)[0].token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(wave))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return outs + results


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_hits_on_parallel_workers_match_the_single_process(tiny_model_dir, tp, pp):
    model_dir = tiny_model_dir("llama")
    single = Server(str(model_dir), device="cpu", dtype="float32", n_slots=800, max_batch_size=4,
                    prefix_caching=False)
    try:
        expect = run(single, seed=tp * 10 + pp)
    finally:
        single.shutdown()
    server = start_server(model_dir, tp, pp, prefix_cache_block_size=8)
    try:
        got = run(server, seed=tp * 10 + pp)
        st = server.stats()
        assert_idle(server)
    finally:
        server.shutdown()
    assert got == expect
    pc = st["prefix_cache"]
    assert pc["hits"] >= 4 and pc["hit_tokens"] >= 100 and pc["copied_bytes"] > 0, pc
