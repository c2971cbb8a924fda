"""OpenAI-compatible HTTP server: `python -m orca_ext serve` on the real default model.

The server runs as a subprocess (tests/http_utils.py). Its answers are checked against an
independent in-process `Server.generate` of the same greedy request, through the official
`openai` client where the client can express the request and through raw HTTP where the test is
about the wire (SSE framing, error bodies, disconnects).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from http_utils import ServerProcess

KEY = "sk-test-" + os.urandom(6).hex()
# A small KV cache keeps the subprocesses light on this shared machine; it also sets the
# context limit (max_model_len = min(8192, n_slots)).
KV_ENV = {"ORCA_EXT_KV_CACHE_MEMORY": "256MiB"}
REF_SLOTS = 5825  # what 256 MiB holds for SmolLM2-135M (46080 bytes per slot), for the reference

WORDS = ("the river city light music under star old new small bright road window garden "
         "morning because while after before people tree house water little").split()


def _text_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))).capitalize()


# -- fixtures --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from orca_ext.models import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def engine():
    """The in-process reference engine (the same default model, greedy decoding)."""
    from orca_ext import Server

    with Server(n_slots=REF_SLOTS) as s:
        yield s


@pytest.fixture(scope="module")
def server(engine):
    # Depends on `engine` only to order the model loads (one at a time on two cores).
    # Scraped without the key, and right after each request: a public, never-cached /metrics.
    with ServerProcess("--api-key", KEY, "--public-metrics", "--metrics-interval", "0", env=KV_ENV) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_name(default_model_dir) -> str:
    return os.path.basename(os.path.normpath(str(default_model_dir)))


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _metrics(server: ServerProcess) -> dict[str, float]:
    """/metrics parsed with prometheus_client: {'name{label=value,...}': value}."""
    text = httpx.get(server.url("/metrics"), timeout=30).text
    flat = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            flat[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return flat


def _sse_events(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def _wait_idle(server: ServerProcess, deadline_s: float = 120.0) -> dict[str, float]:
    """Poll /metrics until the engine holds no request and no KV slot (a deadline, not a speed
    assertion: the callers check *why* it became idle through the outcome counters)."""
    end = time.monotonic() + deadline_s
    while True:
        m = _metrics(server)
        if m["orca_requests_running"] == 0 and m["orca_requests_waiting"] == 0 \
                and m["orca_kv_slots_reserved"] == 0 and m["orca_http_requests_inflight"] == 0:
            return m
        assert time.monotonic() < end, f"engine still busy: {m}"
        time.sleep(0.1)


# -- basic endpoints -------------------------------------------------------------------------------

def test_health_and_models(server, client, model_name):
    assert httpx.get(server.url("/health")).json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_matches_engine(client, engine, model_name, tokenizer):
    from orca_ext import SamplingParams

    rng = random.Random(11)
    text_prompt = _text_prompt(rng)
    id_prompt = [rng.randrange(200, engine.vocab_size) for _ in range(37)]
    for prompt, max_tokens in ((text_prompt, 13), (id_prompt, 9)):
        ref = engine.generate(prompt, SamplingParams(max_tokens=max_tokens))[0]
        got = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert got.choices[0].text == ref.text
        assert got.choices[0].finish_reason == ref.finish_reason
        n_prompt = len(tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        assert got.usage.prompt_tokens == n_prompt == len(ref.prompt_token_ids)
        assert got.usage.completion_tokens == len(ref.token_ids)
        assert got.usage.total_tokens == n_prompt + len(ref.token_ids)
        assert got.model == model_name and got.object == "text_completion"


def test_completion_stream_matches_engine(server, client, engine, model_name):
    from orca_ext import SamplingParams

    prompt = "Write a short story about a lighthouse keeper."
    ref = engine.generate(prompt, SamplingParams(max_tokens=21, ignore_eos=True))[0]
    chunks = list(client.completions.create(
        model=model_name, prompt=prompt, max_tokens=21, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert not chunks[-1].choices  # the usage chunk comes last, with no choices
    assert chunks[-1].usage.completion_tokens == 21
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)

    # The wire format: SSE "data:" events, each JSON, the last one "[DONE]".
    short = engine.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    body = {"model": model_name, "prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, headers=_auth(), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "text_completion" and p["id"] == parsed[0]["id"] for p in parsed)
    assert "".join(p["choices"][0]["text"] for p in parsed) == short.text
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in parsed)  # include_usage not asked


def test_chat_matches_engine(client, engine, model_name, tokenizer):
    from orca_ext import SamplingParams

    messages = [{"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    # Independent prompt construction: the tokenizer's own template, tokenized by transformers.
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref = engine.generate(ids, SamplingParams(max_tokens=24))[0]

    got = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=24,
                                         temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.text
    assert got.choices[0].finish_reason == ref.finish_reason
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == len(ref.token_ids)

    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == ref.text
    assert with_choices[-1].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_seed_and_sampling_options(client, engine, model_name):
    from orca_ext import SamplingParams

    prompt = "List five fruits: apple, banana,"
    ref = engine.generate(prompt, SamplingParams(max_tokens=30))[0]
    # A stop string taken from the middle of the greedy text: the answer is the text before it.
    words = ref.text.split()
    stop = words[len(words) // 2]
    got = client.completions.create(model=model_name, prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "@@@"])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == ref.text[:ref.text.index(stop)]

    # A seeded sampled request is reproducible and equals the engine's for the same seed.
    params = dict(temperature=0.9, top_p=0.95, seed=1234)
    seeded_ref = engine.generate(prompt, SamplingParams(max_tokens=12, top_k=40, **params))[0]
    for _ in range(2):
        got = client.completions.create(model=model_name, prompt=prompt, max_tokens=12,
                                        extra_body={"top_k": 40}, **params)
        assert got.choices[0].text == seeded_ref.text


def test_64_concurrent_streams(client, server, engine, model_name, tokenizer):
    from orca_ext import SamplingParams

    rng = random.Random(64)
    prompts = [_text_prompt(rng) for _ in range(64)]
    max_tokens = [rng.randint(1, 6) for _ in range(64)]
    refs = engine.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])
    aclient = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=300)

    async def one(prompt: str, n: int):
        stream = await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage, finish

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
        finally:
            await aclient.close()

    before = _metrics(server)
    results = asyncio.run(all_of_them())
    for prompt, n, ref, (text, usage, finish) in zip(prompts, max_tokens, refs, results):
        assert finish == "length"
        assert usage.completion_tokens == n == len(ref.token_ids)
        assert usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert text == ref.text
    after = _wait_idle(server)
    key = "orca_http_requests_total{endpoint=completions,outcome=length}"
    assert after[key] - before.get(key, 0) == 64
    assert after["orca_generation_tokens_total"] - before["orca_generation_tokens_total"] == sum(max_tokens)


# -- disconnects -------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, n", [("Tell me everything about the sea.", 1),
                                       (["Tell me everything about the sea.", [7, 300, 4000]], 2)],
                         ids=["one_prompt", "batch_of_two_n2"])
def test_disconnect_mid_stream_aborts(server, model_name, prompt, n):
    """Every sequence of the request (each prompt of a batch, each of its n) is aborted."""
    before = _wait_idle(server)
    abort_key = "orca_http_requests_total{endpoint=completions,outcome=abort}"
    body = {"model": model_name, "prompt": prompt, "n": n, "max_tokens": 3000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    sequences = (len(prompt) if isinstance(prompt, list) else 1) * n
    with httpx.Client(headers=_auth(), timeout=120) as c:
        with c.stream("POST", server.url("/v1/completions"), json=body) as r:
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
            n = 0
            for line in lines:
                if line.startswith("data: "):
                    n += 1
                    if n == 3:
                        break
            busy = _metrics(server)
            assert busy["orca_requests_running"] + busy["orca_requests_waiting"] == sequences
            assert busy["orca_kv_slots_reserved"] >= 3000
        # leaving the block closes the connection mid-stream
    after = _wait_idle(server)
    assert after[abort_key] - before.get(abort_key, 0) == 1
    assert after["orca_generation_tokens_total"] == before["orca_generation_tokens_total"]  # never "finished"
    assert after["orca_kv_slots_used"] == 0
    # The engine stopped early: far fewer than the 3000 tokens it would have run to.
    assert after["orca_engine_generated_tokens"] - before["orca_engine_generated_tokens"] < 3000


def test_disconnect_while_waiting_non_streaming(server, model_name):
    before = _wait_idle(server)
    abort_key = "orca_http_requests_total{endpoint=chat,outcome=abort}"
    body = {"model": model_name, "messages": [{"role": "user", "content": "Count to a million."}],
            "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/chat/completions"), json=body, headers=_auth(), timeout=3.0)
    after = _wait_idle(server)
    assert after[abort_key] - before.get(abort_key, 0) == 1
    assert after["orca_engine_generated_tokens"] - before["orca_engine_generated_tokens"] < 3000


# -- errors ----------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    # (body, status, param)
    # Refused while parsing the body (strict JSON types, unsupported options, the model name).
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "n": 17}, 400, "n"),
    ({"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ({"prompt": "hi", "best_of": 17}, 400, "best_of"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ({"prompt": [1, True]}, 400, "prompt"),
    ({"prompt": ["one", [1, 2], 3]}, 400, "prompt"),
    ({"prompt": ["x"] * 257}, 400, "prompt"),
    ({"prompt": ["x"] * 20, "n": 13}, 400, "prompt"),
    ({"prompt": {"text": "hi"}}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    # Refused by the engine's checks (SamplingParams, Server.submit): param is the
    # InvalidRequestError's, and completions use the engine's field names.
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -3}, 400, "top_k"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop": ["x"] * 17}, 400, "stop"),
    ({"prompt": "hi", "stop_token_ids": [49152]}, 400, "stop_token_ids"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 49152]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": list(range(9000))}, 400, "prompt"),
    # A batch is checked whole: the refused prompt's place names it.
    ({"prompt": ["hi", [1, 2, 49152]]}, 400, "prompt.1"),
    ({"prompt": [[5, 6], ""]}, 400, "prompt.1"),
    ({"prompt": ["hi", [1, 2, 3]], "max_tokens": 100000}, 400, "max_tokens"),
]

HI = [{"role": "user", "content": "hi"}]
BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": HI, "n": 17}, 400, "n"),
    ({"messages": HI, "tools": []}, 400, "tools"),
    ({"messages": "hi"}, 400, "messages"),
    # Refused by the engine's checks, reported under the chat endpoint's field names: the
    # engine's max_tokens is whichever spelling the client sent, its prompt is the messages.
    ({"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": HI, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    ({"messages": HI, "max_tokens": 100000}, 400, "max_tokens"),
    ({"messages": HI, "temperature": -1}, 400, "temperature"),
    ({"messages": HI, "stop": [""]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi " * 7000}]}, 400, "messages"),
]

# OpenAI's error "type" for each status code.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error"}


def _check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    assert err["type"] == ERROR_TYPES[status], err
    if param is not None:  # the message names the field too
        assert param.split(".")[-1] in err["message"] or param.split(".")[0] in err["message"], err
    return err


def test_bad_inputs_never_reach_the_engine(server, client, model_name):
    stats_before = _wait_idle(server)
    with httpx.Client(headers=_auth(), timeout=60) as c:
        for body, status, param in BAD_COMPLETIONS:
            _check_error(c.post(server.url("/v1/completions"), json={"model": model_name, **body}), status, param)
        for body, status, param in BAD_CHATS:
            _check_error(c.post(server.url("/v1/chat/completions"), json={"model": model_name, **body}),
                         status, param)
        json_type = {"content-type": "application/json"}
        for path in ("/v1/completions", "/v1/chat/completions"):
            url = server.url(path)
            err = _check_error(c.post(url, content=b'{"prompt": "hi",', headers=json_type), 400, None)
            assert "JSON" in err["message"]
            _check_error(c.post(url, content=b"[1, 2]", headers=json_type), 400, None)
            _check_error(c.post(url, content=b'{"prompt": "hi"}'), 415, None)  # no Content-Type
            big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
            _check_error(c.post(url, content=big, headers=json_type), 413, None)

            def chunked():  # no Content-Length: the limit must hold while reading
                for _ in range(40):
                    yield b"x" * (64 << 10)

            _check_error(c.post(url, content=chunked(), headers=json_type), 413, None)
        _check_error(c.get(server.url("/v1/nothing-here")), 404, None)
    # The openai client turns these into its typed errors.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hi", n=17)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="text-davinci-003", prompt="hi")
    # ... engine-side rejections included, with param in the endpoint's field names.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hi", max_tokens=100000)
    assert info.value.param == "max_tokens" and info.value.type == "invalid_request_error"
    assert info.value.body["message"].startswith("len(prompt) + max_tokens = ")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=HI, max_completion_tokens=100000)
    assert info.value.param == "max_completion_tokens" and info.value.type == "invalid_request_error"
    assert info.value.body["message"].startswith("max_completion_tokens: len(prompt) + max_tokens = ")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=HI, top_p=1.5)
    assert info.value.param == "top_p" and info.value.body["message"].startswith("top_p must be in (0, 1]")
    stats_after = _metrics(server)
    # Nothing was submitted: the engine's own counters did not move.
    for key in ("orca_iterations_total", "orca_engine_requests_finished_total", "orca_engine_prompt_tokens"):
        assert stats_after[key] == stats_before[key], key
    assert stats_after["orca_http_requests_total{endpoint=completions,outcome=invalid}"] >= len(BAD_COMPLETIONS)


def test_api_key(server, model_name):
    body = {"model": model_name, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(server.url("/v1/completions"), json=body, headers=headers)
        err = _check_error(r, 401, None)
        assert err["code"] == "invalid_api_key"
    assert httpx.get(server.url("/v1/models")).status_code == 401
    bad = openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model_name, prompt="hi", max_tokens=1)
    assert httpx.post(server.url("/v1/completions"), json=body, headers=_auth()).status_code == 200
    # /health and /metrics stay open for probes and scrapers.
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/metrics")).status_code == 200


# -- metrics ---------------------------------------------------------------------------------------

def test_metrics_scrape(server, client, model_name):
    before = _wait_idle(server)
    n = 7
    got = client.completions.create(model=model_name, prompt="One, two, three,", max_tokens=n, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == n
    after = _wait_idle(server)

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert delta("orca_http_requests_total{endpoint=completions,outcome=length}") == 1
    assert delta("orca_generation_tokens_total") == n
    assert delta("orca_prompt_tokens_total") == got.usage.prompt_tokens
    for hist in ("orca_time_to_first_token_seconds", "orca_time_per_output_token_seconds",
                 "orca_e2e_request_latency_seconds"):
        assert delta(f"{hist}_count") == 1
        assert delta(f"{hist}_bucket{{le=+Inf}}") == 1
        assert delta(f"{hist}_sum") > 0
    # e2e >= ttft + (n - 1) * tpot, all from the same request's timestamps.
    assert delta("orca_e2e_request_latency_seconds_sum") >= delta("orca_time_to_first_token_seconds_sum")
    assert delta("orca_iterations_total") >= n  # one token per iteration at most
    assert after["orca_iteration_seconds"] > 0
    assert after["orca_kv_slots_total"] > 0
    for gauge in ("orca_requests_waiting", "orca_requests_running", "orca_kv_slots_reserved", "orca_kv_slots_used"):
        assert after[gauge] == 0, gauge


# -- backpressure ----------------------------------------------------------------------------------

def test_queue_full_backpressure(engine, server, model_name):
    # Started after the main server is up (fixture order), with room for one request only.
    with ServerProcess("--max-queue", "1", "--metrics-interval", "0", env=KV_ENV) as small:
        long_body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
                     "temperature": 0, "stream": True}
        short_body = {"model": model_name, "prompt": "Hello", "max_tokens": 2}
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", small.url("/v1/completions"), json=long_body) as r:
                lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
                assert next(line for line in lines if line.startswith("data: "))  # admitted, generating
                rejected = c.post(small.url("/v1/completions"), json=short_body)
                err = _check_error(rejected, 429, None)
                assert err["code"] == "queue_full"
                assert int(rejected.headers["retry-after"]) >= 1
                m = _metrics(small)
                assert m["orca_http_requests_total{endpoint=completions,outcome=rejected_queue_full}"] == 1
                assert m["orca_http_requests_inflight"] == 1
            # The long stream was abandoned: its slot in the queue comes back.
            _wait_idle(small)
            ok = c.post(small.url("/v1/completions"), json=short_body)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
            # A batch's prompts count one each: two can never fit a queue of one.
            err = _check_error(c.post(small.url("/v1/completions"), json={**short_body, "prompt": ["a", "b"]}),
                               400, "prompt")
            assert "--max-queue" in err["message"]


# -- in-process app ------------------------------------------------------------------------------

def test_app_in_process_matches_engine(engine):
    """create_app over the in-process Server, through ASGI without a socket: the plain and the
    streamed answer equal the engine's, and the request leaves nothing running."""
    from orca_ext import SamplingParams
    from orca_ext.http import create_app

    app = create_app(engine, model_name="m", max_queue=4, api_key=None)
    prompt = "The three primary colours are"
    ref = engine.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))[0]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            body = {"model": "m", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            plain = await c.post("/v1/completions", json=body)
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
            card = await c.get("/v1/models/m")
            return plain, streamed, card

    plain, streamed, card = asyncio.run(go())
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == ref.text
    events = _sse_events(streamed.text.splitlines())
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == ref.text
    assert card.json()["max_model_len"] == engine.max_model_len and card.json()["vocab_size"] == engine.vocab_size
    assert engine.stats()["running"] == 0
    assert app.state.service.inflight == 0


def test_internal_error_is_a_logged_500(engine, caplog):
    """A bug (here: submit raising RuntimeError) answers 500 in OpenAI's shape, is logged with the
    request id, releases its queue place and leaves the server serving."""
    from orca_ext.http import create_app

    class Buggy:
        def __init__(self, s):
            self._s = s

        def __getattr__(self, name):
            return getattr(self._s, name)

        def submit(self, prompt, params=None, *, request_id=None, client=None):
            if params.max_tokens == 7:  # the trigger (the HTTP layer submits prompts as token ids)
                raise RuntimeError("simulated bug")
            return self._s.submit(prompt, params, request_id=request_id, client=client)

    app = create_app(Buggy(engine), model_name="m", max_queue=1, api_key=None)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            bad = await c.post("/v1/completions", json={"prompt": "trigger the bug", "max_tokens": 7})
            good = await c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
            return bad, good

    with caplog.at_level("ERROR", logger="orca_ext.http.app"):
        bad, good = asyncio.run(go())
    err = _check_error(bad, 500, None)
    rid = bad.headers["x-request-id"]
    assert rid in err["message"]
    assert any(rid in r.getMessage() and r.exc_info for r in caplog.records)
    assert good.status_code == 200  # max_queue=1: the failed request gave its place back
    assert app.state.service.inflight == 0


def test_engine_errors_and_stream_bugs_answer_in_openai_shape(caplog):
    """A request the engine fails answers 500 engine_error (JSON) or an in-band error event then
    [DONE] (SSE); a bug while streaming is an in-band internal_error. Each names the request id,
    and every admission is given back."""
    from fake_model import FakeModel, FakeTokenizer
    from orca_ext import Server
    from orca_ext.http import create_app

    poison = 99

    class BreaksMidStream:
        def __init__(self, s):
            self._s = s

        def __getattr__(self, name):
            return getattr(self._s, name)

        async def _broken(self, rid):
            async for out in self._s.stream_async(rid):
                yield out
                raise RuntimeError("simulated bug while streaming")

        def stream_async(self, rid):
            return self._broken(rid)

    with Server(FakeModel(nan_token=poison), tokenizer=FakeTokenizer(), n_slots=200) as server:
        failing = create_app(server, model_name="m", max_queue=2)
        buggy = create_app(BreaksMidStream(server), model_name="m", max_queue=2)
        bad = {"prompt": [1, poison, 2], "max_tokens": 5}
        good = {"prompt": [3, 4], "max_tokens": 30, "ignore_eos": True, "stream": True}

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=failing), base_url="http://a") as c:
                plain = await c.post("/v1/completions", json=bad)
                streamed = await c.post("/v1/completions", json={**bad, "stream": True})
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=buggy), base_url="http://b") as c:
                broken = await c.post("/v1/completions", json=good)
            return plain, streamed, broken

        with caplog.at_level("ERROR"):
            plain, streamed, broken = asyncio.run(go())
        err = _check_error(plain, 500, None)
        assert err["code"] == "engine_error" and "non-finite" in err["message"]
        assert plain.headers["x-request-id"] in err["message"]
        for response, code in ((streamed, "engine_error"), (broken, "internal_error")):
            assert response.status_code == 200
            events = _sse_events(response.text.splitlines())
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == code and response.headers["x-request-id"] in error["message"]
        assert len(_sse_events(broken.text.splitlines())) == 3  # one chunk, the error, [DONE]
        assert any("simulated bug while streaming" in str(r.exc_info) for r in caplog.records)
        assert failing.state.service.inflight == 0 and buggy.state.service.inflight == 0
        assert server.stats()["waiting"] == 0 and server.stats()["undelivered_outputs"] == 0
