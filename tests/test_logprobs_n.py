"""Several sequences of one prompt (n > 1): one prefill, per-sequence seeds.

Siblings submitted with share_prefill_with wait until the first sequence's prompt is cached and
copy its KV rows instead of prefilling them; each then runs only the prompt's last token, so its
first token is drawn from its own logits with its own generator. Sequence i of a seeded request
(params.for_sequence(i): seed + i) must equal a single-sequence run with that seed, tokens and
logprobs, and the iteration records must show one prefill of the prompt.
"""
from __future__ import annotations

import pytest
from http_utils import with_openai_client

from orca_ext import SamplingParams, Server

N = 4


@pytest.fixture(scope="module", params=[False, True], ids=["fork", "prefix_cache"])
def server(request, tiny_model_dir):
    """Siblings share the prefill by the engine's fork (prefix caching off) or by prefix cache
    hits on the first sequence's computed rows (on)."""
    with Server(str(tiny_model_dir("llama")), device="cpu", dtype="float32", n_slots=1024, max_batch_size=6,
                max_num_batched_tokens=16, prefill_only_tokens=None, record_iterations=True,
                prefix_caching=request.param) as s:
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
    shared = server._engine.num_forked_tokens - forked_before + sum(o.num_cached_tokens for o in outs[1:])
    assert shared == (N - 1) * (prompt_len - 1)
    prefilled = sum(r.num_prefill_tokens for r in server.iterations()[records_before:])
    # At most one prefill: each sibling's run of the prompt's last token over the copied rows is
    # a decode (and the first sequence may itself start from cached rows).
    assert prefilled <= prompt_len
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the seeds differ
    for i, out in enumerate(outs):
        alone = server.generate(prompt, SamplingParams(max_tokens=6, temperature=0.9, top_k=50,
                                                       seed=(2**64 - 2 + i) % 2**64, logprobs=3,
                                                       ignore_eos=True))[0]
        assert out.token_ids == alone.token_ids, i
        assert [e.logprob for e in out.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-5)


@pytest.mark.parametrize("prompt_len", [2, 37])
def test_siblings_asking_for_prompt_logprobs_get_every_entry(server, prompt_len):
    """A sibling that skips the prompt's prefill still reports the logprob of every prompt token
    (echo with logprobs), the same as a single run's; the prefill is still done once."""
    prompt = list(range(4000, 4000 + prompt_len))
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=12, logprobs=1, prompt_logprobs=2, ignore_eos=True)
    records_before = len(server.iterations())
    outs = [server.result(r, timeout=300) for r in submit_n(server, prompt, params)]
    prefilled = sum(r.num_prefill_tokens for r in server.iterations()[records_before:])
    assert prefilled <= prompt_len
    alone = server.generate(prompt, SamplingParams(max_tokens=3, prompt_logprobs=2))[0].prompt_logprobs
    assert len(alone) == prompt_len and alone[0] is None
    for out in outs:
        assert len(out.prompt_logprobs) == prompt_len and out.prompt_logprobs[0] is None
        for got, want in zip(out.prompt_logprobs[1:], alone[1:]):
            assert (got.token_id, [t for t, _ in got.top]) == (want.token_id, [t for t, _ in want.top])
            assert [got.logprob, *(v for _, v in got.top)] == \
                pytest.approx([want.logprob, *(v for _, v in want.top)], abs=1e-5)


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_a_request_sharing_a_context_copies_it_and_equals_its_single_run(server, prompt_logprobs):
    """share_prefill_with a request whose prompt starts the same way (a batch's prompts with one
    context): it waits for that prompt, copies the shared rows (by the fork, or as a prefix cache
    hit), prefills only its own rest, and gets exactly its single run's tokens and logprobs."""
    context = list(range(5000, 5037))
    first_prompt, prompt = context + [11, 12, 13], context + [21, 22]
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=3, logprobs=1, prompt_logprobs=prompt_logprobs,
                            ignore_eos=True)
    alone = server.generate(prompt, params)[0]
    records_before = len(server.iterations())
    first = server.submit(first_prompt, params)
    rid = server.submit(prompt, params, share_prefill_with=first)
    out = server.result(rid, timeout=300)
    server.result(first, timeout=300)
    prefilled = sum(n for r in server.iterations()[records_before:] for n, i in zip(r.chunk_sizes, r.request_ids)
                    if i == rid and n > 1)
    # Only its own tokens (and with prompt logprobs the last shared one, which scores its own next).
    assert prefilled <= len(prompt) - len(context) + (prompt_logprobs is not None)
    assert (out.token_ids, out.logprobs) == (alone.token_ids, alone.logprobs)
    assert out.prompt_logprobs == alone.prompt_logprobs


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


# -- over HTTP ------------------------------------------------------------------------------------

def _call(server, fn):
    return with_openai_client(server, lambda client, _: fn(client), max_queue=8)


def test_http_n_choices_match_single_runs_streamed_or_not(server):
    """n=4 with logprobs: 4 choices whose tokens and logprobs are the single-sequence runs of
    seeds seed + i, streamed or not."""
    prompt = list(range(3000, 3030))
    kw = dict(model="m", prompt=prompt, max_tokens=5, temperature=0.8, seed=77, logprobs=2,
              extra_body={"ignore_eos": True})

    async def fn(client):
        plain = await client.completions.create(n=N, **kw)
        chunks = [c async for c in await client.completions.create(n=N, stream=True, **kw)]
        singles = [await client.completions.create(**{**kw, "seed": 77 + i}) for i in range(N)]
        return plain, chunks, singles

    plain, chunks, singles = _call(server, fn)
    assert [c.index for c in plain.choices] == list(range(N))
    assert plain.usage.completion_tokens == 5 * N
    for choice, single in zip(plain.choices, singles):
        assert choice.text == single.choices[0].text
        assert choice.logprobs.token_logprobs == pytest.approx(single.choices[0].logprobs.token_logprobs, abs=1e-5)
        streamed = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in streamed) == choice.text
        assert [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs] == \
            pytest.approx(choice.logprobs.token_logprobs, abs=1e-6)


def test_http_chat_n_and_best_of(server):
    async def fn(client):
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4, temperature=1.0, seed=5,
            logprobs=True)
        best = await client.completions.create(model="m", prompt=list(range(10, 30)), n=2, best_of=5,
                                               max_tokens=4, temperature=1.0, seed=9,
                                               extra_body={"ignore_eos": True})
        every = await client.completions.create(model="m", prompt=list(range(10, 30)), n=5, max_tokens=4,
                                                temperature=1.0, seed=9, logprobs=0,
                                                extra_body={"ignore_eos": True})
        return chat, best, every

    chat, best, every = _call(server, fn)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content) == len(chat.choices[0].logprobs.content) for c in chat.choices)
    # best_of=5, n=2: the two of the five sequences (the same seeds as n=5) of highest total logprob.
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices]
    top2 = sorted(sorted(range(5), key=lambda i: -totals[i])[:2])
    assert [c.text for c in best.choices] == [every.choices[i].text for i in top2]
    assert best.choices[0].logprobs is None  # not asked for
    assert best.usage.completion_tokens == 4 * 5


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"best_of": 17}, "best_of"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
])
def test_http_n_bounds(server, body, param):
    async def fn(client):
        with pytest.raises(Exception) as info:
            await client.completions.create(model="m", prompt="hi", **body)
        return info.value

    err = _call(server, fn)
    assert err.status_code == 400 and err.body["param"] == param


def test_parallel_workers_share_prefill_and_serve_logprobs(tiny_model_dir):
    """Two pipeline stages: n siblings equal the single-process runs of their seeds (forked or, with
    a batch in flight, prefilled alone); a batch-mate asking for logprobs (sampled on the driver)
    gets the single process's tokens and logprobs."""
    model_dir = tiny_model_dir("llama")
    prompt = list(range(500, 530))
    params = SamplingParams(max_tokens=5, temperature=0.9, seed=41, ignore_eos=True)
    scored = SamplingParams(max_tokens=3, logprobs=1)
    with Server(str(model_dir), device="cpu", dtype="float32", n_slots=800, max_batch_size=4,
                pipeline_parallel_size=2) as server:
        rids = submit_n(server, prompt, params)
        with_logprobs = server.submit(prompt, scored)
        outs = [server.result(r, timeout=300) for r in rids]
        got = server.result(with_logprobs, timeout=300)
    with Server(str(model_dir), device="cpu", dtype="float32", n_slots=800, max_batch_size=4) as local:
        want = [local.generate(prompt, params.for_sequence(i))[0].token_ids for i in range(N)]
        alone = local.generate(prompt, scored)[0]
    assert got.finish_reason == "length" and (got.token_ids, got.logprobs) == (alone.token_ids, alone.logprobs)
    assert [o.token_ids for o in outs] == want
