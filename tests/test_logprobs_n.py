"""Several sequences of one prompt (n > 1): one prefill, per-sequence seeds.

Siblings submitted with share_prefill_with wait until the first sequence's prompt is cached and
copy its KV rows instead of prefilling them; each then runs only the prompt's last token, so its
first token is drawn from its own logits with its own generator. Sequence i of a seeded request
(params.for_sequence(i): seed + i) must equal a single-sequence run with that seed, tokens and
logprobs, and the iteration records must show one prefill of the prompt.
"""
from __future__ import annotations

import pytest

from orca_ext import SamplingParams, Server

N = 4


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with Server(str(tiny_model_dir("llama")), device="cpu", dtype="float32", n_slots=1024, max_batch_size=6,
                max_num_batched_tokens=16, record_iterations=True) as s:
        yield s


def submit_n(server, prompt, params, n=N):
    first = server.submit(prompt, params.for_sequence(0))
    return [first] + [server.submit(prompt, params.for_sequence(i), share_prefill_with=first) for i in range(1, n)]


@pytest.mark.parametrize("prompt_len", [2, 23, 40])
def test_siblings_equal_single_runs_of_their_seeds(server, prompt_len):
    prompt = list(range(1000, 1000 + prompt_len))
    params = SamplingParams(max_tokens=6, temperature=0.9, top_k=50, seed=2**64 - 2, logprobs=3, ignore_eos=True)
    forked_before = server._engine.num_forked_tokens
    records_before = len(server.iterations())
    rids = submit_n(server, prompt, params)
    outs = [server.result(r, timeout=300) for r in rids]
    assert server._engine.num_forked_tokens - forked_before == (N - 1) * (prompt_len - 1)
    prefilled = sum(r.num_prefill_tokens for r in server.iterations()[records_before:])
    # One prefill: each sibling's run of the prompt's last token over the copied rows is a decode.
    assert prefilled == prompt_len
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the seeds differ
    for i, out in enumerate(outs):
        alone = server.generate(prompt, SamplingParams(max_tokens=6, temperature=0.9, top_k=50,
                                                       seed=(2**64 - 2 + i) % 2**64, logprobs=3,
                                                       ignore_eos=True))[0]
        assert out.token_ids == alone.token_ids, i
        assert [e.logprob for e in out.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-5)


def test_aborts_leave_the_siblings_correct(server):
    prompt = list(range(2000, 2050))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ref = server.generate(prompt, params)[0].token_ids
    rids = submit_n(server, prompt, params)
    server.abort(rids[1])          # a held sibling: never enters the pool
    server.abort(rids[0])          # the parent, before its prompt is cached: the rest prefill alone
    outs = [server.result(r, timeout=300) for r in rids]
    assert [o.finish_reason for o in outs[:2]] == ["abort", "abort"]
    assert [o.token_ids for o in outs[2:]] == [ref, ref]
    assert server.stats()["running"] == 0
