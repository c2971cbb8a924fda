"""logprobs, echo, penalties and logit_bias over HTTP, read back with the openai client.

The app runs in-process over a tiny random llama (through ASGI, no socket). Each response's
logprobs must equal the Python API's for the same request (test_logprobs.py checks those against
transformers), in OpenAI's shapes, streamed or not; every bound is a 400 naming its field.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from orca_ext import SamplingParams, Server
from orca_ext.http import create_app

TOL = 1e-5


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with Server(str(tiny_model_dir("llama")), device="cpu", dtype="float32", n_slots=1024, max_batch_size=4,
                max_num_batched_tokens=16, prefill_only_tokens=None) as s:
        yield s


@pytest.fixture(scope="module")
def app(server):
    return create_app(server, model_name="m", max_queue=8)


def call(app, fn):
    """Run `fn(openai_client, httpx_client)` (a coroutine function) against the app."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="none", http_client=c, max_retries=0)
            return await fn(client, c)
    return asyncio.run(go())


def sse_chunks(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def token_text(server, token: int) -> str:
    return server.tokenizer.decode([token], skip_special_tokens=False)


def test_echo_scores_the_prompt(app, server):
    """lm-evaluation-harness's request: echo, logprobs, max_tokens 0, a token-id prompt."""
    prompt = list(range(300, 337))
    ref = server.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=3))[0]

    async def fn(client, _):
        return await client.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=3)

    resp = call(app, fn)
    choice = resp.choices[0]
    assert choice.text == server.tokenizer.decode(prompt, skip_special_tokens=False)
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [token_text(server, t) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry = ref.prompt_logprobs[p]
        assert lp.token_logprobs[p] == pytest.approx(entry.logprob, abs=TOL)
        assert lp.top_logprobs[p] == pytest.approx({token_text(server, t): v for t, v in entry.top}, abs=TOL)
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(prompt))]


@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprobs_streamed_equal_plain(app, server, echo):
    prompt = "The river city light music"
    body = {"model": "m", "prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "echo": echo}

    async def fn(_, c):
        return (await c.post("/v1/completions", json=body)).json(), \
            (await c.post("/v1/completions", json={**body, "stream": True})).text

    plain, streamed = call(app, fn)
    ids = server.prompt_encoder.encode(prompt)
    ref = server.generate(ids, SamplingParams(max_tokens=7, ignore_eos=True, logprobs=2,
                                              prompt_logprobs=2 if echo else None))[0]
    lp = plain["choices"][0]["logprobs"]
    assert plain["choices"][0]["text"] == (prompt if echo else "") + ref.text
    entries = (ref.prompt_logprobs if echo else []) + ref.logprobs
    assert len(lp["tokens"]) == len(entries) == (len(ids) if echo else 0) + 7
    for value, entry in zip(lp["token_logprobs"], entries):
        assert (value is None) == (entry is None)
        if entry is not None:
            assert value == pytest.approx(entry.logprob, abs=TOL)
    chunks = sse_chunks(streamed)
    joined = {k: [] for k in lp}
    for chunk in chunks:
        if chunk["choices"] and chunk["choices"][0]["logprobs"] is not None:
            for k in lp:
                joined[k] += chunk["choices"][0]["logprobs"][k]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == plain["choices"][0]["text"]
    assert joined == lp


def test_chat_logprobs_streamed_equal_plain(app, server):
    messages = [{"role": "user", "content": "Name three colours."}]
    kwargs = dict(model="m", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4,
                  extra_body={"ignore_eos": True})

    async def fn(client, _):
        plain = await client.chat.completions.create(**kwargs)
        chunks = [ch async for ch in await client.chat.completions.create(stream=True, **kwargs)]
        return plain, chunks

    plain, chunks = call(app, fn)
    content = plain.choices[0].logprobs.content
    assert len(content) == 6 and all(len(item.top_logprobs) == 4 for item in content)
    for item in content:
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=TOL)  # greedy: the argmax
        assert item.bytes == list(item.token.encode("utf-8"))
    streamed = [item for ch in chunks if ch.choices and ch.choices[0].logprobs
                for item in ch.choices[0].logprobs.content]
    assert [i.model_dump() for i in streamed] == [i.model_dump() for i in content]


def test_logit_bias_and_penalties_over_http_equal_the_python_api(app, server):
    prompt = list(range(50, 70))
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"1234": 8.0, "77": -100}, "presence_penalty": 0.5, "frequency_penalty": 0.3,
            "repetition_penalty": 1.2, "logprobs": 1}

    async def fn(_, c):
        return (await c.post("/v1/completions", json=body)).json()

    resp = call(app, fn)
    ref = server.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={1234: 8.0, 77: -100},
                                                 presence_penalty=0.5, frequency_penalty=0.3,
                                                 repetition_penalty=1.2, logprobs=1))[0]
    assert resp["choices"][0]["text"] == ref.text
    assert resp["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs],
                                                                             abs=TOL)


HI = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"9" * 30: 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"1": "x"}}, "logit_bias.1"),
]


def test_bad_values_are_400s_naming_the_field(app):
    async def fn(_, c):
        return [(param, await c.post(path, json={"model": "m", **body})) for path, body, param in BAD]

    for param, r in call(app, fn):
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param, err
        assert param.split(".")[0] in err["message"], err
