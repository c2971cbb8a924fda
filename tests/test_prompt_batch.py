"""A completions batch: `prompt` as a list of texts or token-id lists, through the openai client.

Each prompt of a batch gets exactly the choices it gets when sent alone with the same body
(texts and logprobs, n and best_of included), at choice index prompt * n + j; the usage is the sum
over the prompts. A batch is checked whole before any of it reaches the engine, and its prompts
count one each against --max-queue.
"""
from __future__ import annotations

import random

import pytest
from http_utils import with_openai_client

from orca_ext import SamplingParams, Server

N = 2


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with Server(str(tiny_model_dir("llama")), device="cpu", dtype="float32", n_slots=2048, max_batch_size=8,
                max_num_batched_tokens=16) as s:
        yield s


def _call(server, fn, max_queue=64):
    return with_openai_client(server, fn, max_queue=max_queue)


def _prompts(seed: int) -> list:
    """A text and token-id prompts of awkward, different lengths."""
    rng = random.Random(seed)
    ids = [[rng.randrange(3, 2000) for _ in range(length)] for length in (1, 7, 23)]
    return ["The river ran past the old mill and", *ids]


def _choice_fields(choice) -> tuple:
    lp = choice.logprobs
    return choice.text, choice.finish_reason, (lp.tokens, lp.text_offset) if lp else None


@pytest.mark.parametrize("echo", [False, True])
def test_each_prompt_gets_the_choices_it_gets_alone(server, echo):
    prompts = _prompts(seed=3 + echo)
    kw = dict(model="m", max_tokens=5, temperature=0.8, seed=41, logprobs=2, echo=echo, n=N,
              extra_body={"ignore_eos": True})

    async def fn(client, _):
        batch = await client.completions.create(prompt=prompts, **kw)
        stream = [c async for c in await client.completions.create(
            prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw)]
        alone = [await client.completions.create(prompt=p, **kw) for p in prompts]
        return batch, stream, alone

    batch, stream, alone = _call(server, fn)
    assert [c.index for c in batch.choices] == list(range(len(prompts) * N))
    for p, single in enumerate(alone):
        for j, want in enumerate(single.choices):
            got = batch.choices[p * N + j]
            assert _choice_fields(got) == _choice_fields(want), (p, j)
            assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-5,
                                                                nan_ok=True)
            streamed = [c.choices[0] for c in stream if c.choices and c.choices[0].index == p * N + j]
            assert "".join(c.text for c in streamed) == got.text
            assert streamed[-1].finish_reason == got.finish_reason
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        want = sum(getattr(single.usage, field) for single in alone)
        assert getattr(batch.usage, field) == want == getattr(stream[-1].usage, field), field
    assert len({c.text for c in batch.choices}) > len(prompts)   # the n sequences of a prompt differ


def test_best_of_ranks_within_each_prompt(server):
    prompts = _prompts(seed=9)[1:]
    kw = dict(model="m", max_tokens=4, temperature=1.0, seed=5, n=1, best_of=3, extra_body={"ignore_eos": True})

    async def fn(client, _):
        batch = await client.completions.create(prompt=prompts, **kw)
        alone = [await client.completions.create(prompt=p, **kw) for p in prompts]
        return batch, alone

    batch, alone = _call(server, fn)
    assert [c.text for c in batch.choices] == [single.choices[0].text for single in alone]
    assert batch.usage.completion_tokens == 3 * 4 * len(prompts)   # best_of's extra sequences bill too


def test_a_refused_prompt_refuses_the_batch_before_the_engine(server):
    import openai

    before = server.stats()
    good = _prompts(seed=1)
    fits_alone = list(range(3, server.max_model_len - 5))   # but not with 9 tokens to generate

    async def fn(client, _):
        errors = []
        for bad, kw in ((good + [[5, 10 ** 6]], {}), (good + [""], {}), (good[:2] + [fits_alone], {})):
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="m", prompt=bad, max_tokens=9, **kw)
            errors.append(info.value)
        return errors

    out_of_vocab, empty, too_long = _call(server, fn)
    assert out_of_vocab.body["param"] == "prompt.4" and out_of_vocab.body["message"].startswith("prompt.4: ")
    assert empty.body["param"] == "prompt.4"
    assert too_long.body["param"] == "max_tokens" and too_long.body["message"].startswith("prompt.2: ")
    after = server.stats()
    # Nothing of a refused batch was queued: the engine finished no request, read no prompt token
    # and holds no slot.
    assert (after["finished"], after["prompt_tokens"]) == (before["finished"], before["prompt_tokens"])
    assert after["running"] == after["waiting"] == after["slots_reserved"] == 0


def test_prompts_count_one_each_against_the_queue_and_the_clients_share(server):
    """--max-queue 8: one client holds at most 6 places (3/4), so a client that fills its share
    leaves room for the others; a batch's prompts count one each."""
    import openai

    from orca_ext.http.errors import APIError

    async def fn(client, app):
        svc = app.state.service
        hog = svc.admit("held", "completions", "10.0.0.9", 6)   # another client, at its share
        with pytest.raises(APIError) as own_limit:
            svc.admit("more", "completions", "10.0.0.9", 1)
        two = await client.completions.create(model="m", prompt=["a", "b"], max_tokens=1)   # room left
        mine = svc.admit("mine", "completions", "127.0.0.1", 1)
        with pytest.raises(openai.RateLimitError) as full:   # 6 + 1 held: a batch of 2 does not fit
            await client.completions.create(model="m", prompt=["a", "b"], max_tokens=1)
        with pytest.raises(openai.BadRequestError) as over:
            await client.completions.create(model="m", prompt=["a"] * 7, max_tokens=1)
        hog.close()
        mine.close()
        return own_limit.value, two, full.value, over.value, svc.inflight, dict(svc.queued_by_client)

    own_limit, two, full, over, inflight, held = _call(server, fn, max_queue=8)
    assert own_limit.status == 429 and own_limit.code == "client_queue_full"
    assert len(two.choices) == 2
    assert full.body["code"] == "queue_full"
    assert over.body["param"] == "prompt" and "--max-queue-per-client" in over.body["message"]
    assert inflight == 0 and held == {}


@pytest.mark.parametrize("stream", [False, True])
def test_metrics_count_each_prompt_once_and_every_sequence(server, stream):
    from prometheus_client.parser import text_string_to_metric_families

    prompts = _prompts(seed=21)
    kw = dict(model="m", prompt=prompts, n=3, max_tokens=4, temperature=1.0, seed=2, stream=stream,
              extra_body={"ignore_eos": True})

    def counters(app) -> dict:
        text = app.state.service.metrics.render().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name in ("orca_prompt_tokens_total", "orca_generation_tokens_total")
                or (s.name == "orca_http_requests_total" and s.labels["outcome"] == "length")}

    async def fn(client, app):
        before = counters(app)
        response = await client.completions.create(**kw)
        if stream:
            response = [c async for c in response]
        return before, counters(app)

    before, after = _call(server, fn)
    prompt_tokens = sum(len(server.check(p, SamplingParams())) for p in prompts)
    assert after["orca_prompt_tokens_total"] - before.get("orca_prompt_tokens_total", 0) == prompt_tokens
    assert after["orca_generation_tokens_total"] - before.get("orca_generation_tokens_total", 0) \
        == len(prompts) * 3 * 4
    assert after["orca_http_requests_total"] - before.get("orca_http_requests_total", 0) == 1


def test_prompts_that_share_a_context_prefill_it_once(server):
    """lm-eval's multiple-choice shape: a batch of contexts, each with several continuations,
    scored with echo and logprobs. The continuations of a context start from one prefill of it
    (prefix cache hits that take the first prompt's prompt logprobs), and every choice is still
    exactly what its prompt gets alone."""
    rng = random.Random(8)
    contexts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (40, 57)]
    prompts = [context + [100 + j] + [rng.randrange(3, 2000) for _ in range(j)] for context in contexts
               for j in range(4)]
    kw = dict(model="m", max_tokens=1, temperature=0, echo=True, logprobs=1)

    async def fn(client, _):
        batch = await client.completions.create(prompt=prompts, **kw)
        alone = [await client.completions.create(prompt=p, **kw) for p in prompts]
        return batch, alone

    batch, alone = _call(server, fn)
    for got, single in zip(batch.choices, alone):
        want = single.choices[0]
        assert got.logprobs.tokens == want.logprobs.tokens
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-6, nan_ok=True)
        assert got.logprobs.top_logprobs == want.logprobs.top_logprobs
    # Three of each context's four prompts took its rows (all but the last shared one, which
    # scores their own next token) from the cache.
    assert batch.usage.prompt_tokens_details.cached_tokens >= 3 * (32 + 48)


@pytest.mark.parametrize("prompts, want", [
    ([], []),
    ([[1] * 40], [None]),
    ([[1] * 40 + [2], [1] * 40 + [3], [1] * 40 + [4, 5]], [None, 0, 0]),
    ([[9] * 30 + [2], [5] * 30, [9] * 30 + [3]], [None, None, 0]),     # neighbours once sorted
    ([[1] * 10 + [2], [1] * 10 + [3]], [None, None]),                  # under MIN_SHARED_CONTEXT
    ([[1] * 20 + [2] * 30, [1] * 20 + [3] * 30], [None, None]),        # under half of the prompt
    ([[1] * 40, [1] * 40], [None, 0]),                                 # the same prompt
    ([[1] * 20 + [2] * 5, [1] * 20 + [3] * 5, [1] * 20 + [2] * 5 + [7]], [None, 0, 0]),
])
def test_shared_contexts_points_each_prompt_at_its_runs_first(prompts, want):
    from orca_ext.http.service import shared_contexts

    assert shared_contexts(prompts) == want
