"""One client must never hurt the others: hostile parameters, inputs and connections.

Each test takes one way a single request could fail, stall or corrupt other requests, and checks
that it cannot: the attacker gets a clear error (status, field, limit) or a valid answer, and
bystanders running alongside it finish with exactly the fake model's greedy reference, with every
KV slot back afterwards.

No assertion is about time: where the threat is a cost (stop strings, tokenization), the test
counts work (profiler events on the engine thread) or blocks the attacker on an event and checks
that bystanders finish meanwhile.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import threading
import time

import httpx
import pytest
import torch

from fake_model import FakeModel, FakeSpec, FakeTokenizer, fake_reference
from orca_ext.errors import InvalidRequestError
from orca_ext.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from orca_ext.server import Server

V = FakeSpec().vocab_size
BYSTANDER_PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7]]
BYSTANDER_TOKENS = 12


def assert_idle(server: Server) -> None:
    st = server.stats()
    assert st["waiting"] == 0 and st["running"] == 0
    assert st["slots_reserved"] == 0 and st["slots_used"] == 0 and st["slots_allocated"] == 0


def alongside_bystanders(server: Server, model: FakeModel, attack) -> list:
    """Run `attack()` (which submits the hostile requests and returns their ids) in the same
    iterations as greedy bystanders: a gated first forward holds the engine while everything is
    submitted, so all of them share the next batch. Checks every bystander against the fake
    model's reference and returns the attackers' final outputs."""
    gate = threading.Event()
    model.gate = gate
    model.entered.clear()
    params = SamplingParams(max_tokens=BYSTANDER_TOKENS, ignore_eos=True)
    bystanders = [server.submit(BYSTANDER_PROMPTS[0], params)]
    assert model.entered.wait(30)  # the first bystander's prefill is executing, held at the gate
    bystanders += [server.submit(p, params) for p in BYSTANDER_PROMPTS[1:]]
    attackers = attack()
    model.gate = None
    gate.set()
    outs = [server.result(rid, timeout=120) for rid in attackers]  # timeouts: hang guards
    for rid, prompt in zip(bystanders, BYSTANDER_PROMPTS):
        out = server.result(rid, timeout=120)
        assert out.finish_reason == "length" and out.error is None, out
        assert out.token_ids == fake_reference(prompt, BYSTANDER_TOKENS)
    assert_idle(server)
    return outs


# -- one request cannot fail its batch -------------------------------------------------------------
@pytest.mark.parametrize("top_k", [2**63, 2**64 + 5, 10**40])
def test_top_k_beyond_int64_is_served_and_fails_nobody(make_server, top_k):
    """top_k = 2**63 and beyond is accepted and clamped to the vocabulary, so it cannot overflow
    the sampler's int64 tensor: the request is served exactly like top_k = 0 (top_k >= vocab
    keeps every token) and its batch-mates are unaffected."""
    model = FakeModel()
    server = make_server(model)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=top_k, seed=3, ignore_eos=True)
    [out] = alongside_bystanders(server, model, lambda: [server.submit([1, 2, 3], params)])
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert all(0 <= t < V for t in out.token_ids)
    same = SamplingParams(max_tokens=8, temperature=1.0, top_k=0, seed=3, ignore_eos=True)
    assert server.generate([1, 2, 3], same)[0].token_ids == out.token_ids


def test_a_sampler_failure_fails_only_its_row(make_server):
    """When the batched sampler raises on one row's values (a seed no generator takes, forced in
    past validation here), only that request ends with an error: the rows are re-run one by one
    and every batch-mate gets its tokens."""
    model = FakeModel()
    server = make_server(model)
    broken = SamplingParams(max_tokens=5, temperature=1.0, seed=1)
    object.__setattr__(broken, "seed", "1")  # no generator can be seeded with it
    [out] = alongside_bystanders(server, model, lambda: [server.submit([4, 4], broken)])
    assert out.finish_reason == "error" and "sampling failed" in out.error and out.token_ids == []


class WideLogitsModel(FakeModel):
    """A model whose logits are wider than its vocabulary (padded lm_head) and which, like
    CausalLM, rejects a whole batch holding an out-of-vocabulary token id. A context holding
    `trigger` puts its greedy token at id V, outside the vocabulary."""

    def __init__(self, trigger: int, **kw):
        super().__init__(**kw)
        self.trigger = trigger

    def forward(self, batch):
        if batch.max_token_id >= self.spec.vocab_size:
            raise ValueError(f"batch has token id {batch.max_token_id} but vocab_size={self.spec.vocab_size}")
        logits = super().forward(batch)
        wide = torch.cat([logits, torch.full((logits.shape[0], 3), -1e4)], dim=1)
        for b, (s, n) in enumerate(zip(batch.kv_start.tolist(), batch.kv_len.tolist())):
            if self.trigger in self.cache[s:s + n].tolist():
                wide[b, V] = 1e4
        return wide


def test_an_unusable_forward_input_fails_only_its_request(make_server):
    """A request whose next input no forward can take (an id sampled from logits wider than the
    vocabulary) fails alone with "outside the vocabulary": the engine checks each row's inputs
    and leaves that row out of the forward its batch-mates run in."""
    trigger = 100
    assert all(trigger not in p + fake_reference(p, BYSTANDER_TOKENS) for p in BYSTANDER_PROMPTS)
    model = WideLogitsModel(trigger)
    server = make_server(model, tokenizer=FakeTokenizer(vocab_size=V + 3))  # can show id V
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [out] = alongside_bystanders(server, model, lambda: [server.submit([7, trigger], params)])
    assert out.finish_reason == "error" and "outside the vocabulary" in out.error
    assert out.token_ids == [V]  # the sampled id that no forward can take


# -- tiny temperatures and top_p give valid tokens -------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 5e-324])
def test_tiny_temperature_is_greedy(make_server, temperature):
    """A temperature below GREEDY_TEMPERATURE (1e-5), down to the smallest float, is greedy: the
    logits are never divided into inf/NaN, and the tokens equal the greedy reference."""
    model = FakeModel()
    server = make_server(model)
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=5, ignore_eos=True)
    assert params.greedy
    [out] = alongside_bystanders(server, model, lambda: [server.submit([6, 1, 6], params)])
    assert out.finish_reason == "length" and out.token_ids == fake_reference([6, 1, 6], 10)


def test_extreme_top_p_and_temperature_give_valid_tokens(make_server):
    """top_p = 1e-50 (0 in float32) keeps the most likely token, so the request is greedy rather
    than an all -inf row of NaN probabilities. A temperature of 1e300 (inf in float32) is clamped
    to float32's range and samples almost uniformly over valid ids."""
    model = FakeModel()
    server = make_server(model)
    nucleus = SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-50, seed=2, ignore_eos=True)
    hot = SamplingParams(max_tokens=30, temperature=1e300, top_k=50, seed=2, ignore_eos=True)
    a, b = alongside_bystanders(server, model, lambda: [server.submit([8, 8], nucleus),
                                                        server.submit([8, 9], hot)])
    assert a.finish_reason == "length" and a.token_ids == fake_reference([8, 8], 10)
    assert b.finish_reason == "length" and len(b.token_ids) == 30 and all(0 <= t < V for t in b.token_ids)
    assert len(set(b.token_ids)) > 10  # spread out, not one garbage id repeated


# -- stop strings are bounded, and cheap per token -------------------------------------------------
@pytest.mark.parametrize("stop, message", [
    (["x"] * (MAX_STOP_STRINGS + 1), rf"stop has {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}"),
    (["ok", "y" * (MAX_STOP_STRING_CHARS + 1)],
     rf"stop\[1\] has {MAX_STOP_STRING_CHARS + 1} characters; at most {MAX_STOP_STRING_CHARS}"),
    (["ok", "\ud800"], r"stop\[1\] is not valid Unicode"),
    (b"STOP", "stop must be a string or a list of strings"),
])
def test_stop_string_limits(stop, message):
    """At most MAX_STOP_STRINGS stop strings of MAX_STOP_STRING_CHARS characters each, and at
    most MAX_STOP_TOKEN_IDS stop token ids, are accepted; beyond that the error names the field
    (param and message) and the limit. The limits themselves are accepted."""
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(stop=stop)
    assert info.value.param == "stop"
    with pytest.raises(InvalidRequestError, match=rf"at most {MAX_STOP_TOKEN_IDS}") as info:
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert info.value.param == "stop_token_ids"
    SamplingParams(stop=["z" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)  # the limits themselves pass


class OneTokenModel(FakeModel):
    """Always predicts token 0 ('A' for FakeTokenizer): the text is 'AAAA...'."""

    def forward(self, batch):
        logits = super().forward(batch)  # keeps the fake model's KV bookkeeping checks
        out = torch.full_like(logits, -1.0)
        out[:, 0] = 0.0
        return out


def engine_thread_calls(server: Server, counter: list[int], prompt, params) -> tuple[int, object]:
    """Profiler events (Python and C calls, counted into `counter` by the engine thread's
    profiler) that the engine thread spends on one request run alone."""
    before = counter[0]
    out = server.generate(prompt, params)[0]
    return counter[0] - before, out


def test_stop_check_cost_does_not_multiply_with_the_stop_strings(make_server):
    """The per-token stop check reads only the new characters, whatever the stop strings: it does
    not compare every prefix of every stop string against the text's end (16 x 255 endswith
    calls per token here). The work is counted as profiler events on the engine thread: a request
    with the largest allowed, never-matching stop strings costs only a few events per generated
    character more than the same request without them (plus at most the longest stop string,
    for a streaming matcher's failure transitions)."""
    counter = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            counter[0] += 1

    threading.setprofile(profile)  # applies to threads started from now on: the engine's loop
    try:
        server = make_server(OneTokenModel())
    finally:
        threading.setprofile(None)
    n = 120
    # Every prefix of every stop is checked and fails ('B'/'C'/... never follow the text's 'A's).
    stops = [chr(0x42 + i) + "A" * (MAX_STOP_STRING_CHARS - 1) for i in range(MAX_STOP_STRINGS)]
    plain_calls, plain = engine_thread_calls(server, counter, [1, 2],
                                             SamplingParams(max_tokens=n, ignore_eos=True))
    stop_calls, stopped = engine_thread_calls(server, counter, [1, 2],
                                              SamplingParams(max_tokens=n, ignore_eos=True, stop=stops))
    assert plain.text == stopped.text == "A" * n
    extra = stop_calls - plain_calls
    assert extra <= 8 * (n + MAX_STOP_STRING_CHARS), (extra, plain_calls)
    # Stops that do match the text's pattern: held back while they could still complete, then cut.
    hit, = server.generate([1, 2], SamplingParams(max_tokens=n, stop=["A" * 50 + "B", "A" * 40]))
    assert hit.finish_reason == "stop" and hit.text == ""
    assert_idle(server)
    assert sys.getprofile() is None  # this thread was never profiled


# -- prompt encoding never holds the engine's tokenizer lock ---------------------------------------
class GatedTokenizer(FakeTokenizer):
    """encode() of a text containing 'Z' blocks until `gate` is set (a stand-in for encoding a
    megabyte of text). Copies share the gate and the counters, as copies of one tokenizer would
    share nothing but the test's view of them."""

    def __init__(self, shared=None):
        super().__init__()
        self.shared = shared or {"gate": threading.Event(), "encoding": threading.Event(), "calls": [0]}

    def encode(self, text: str) -> list[int]:
        self.shared["calls"][0] += 1
        if "Z" in text:
            self.shared["encoding"].set()
            assert self.shared["gate"].wait(60)
        return super().encode(text)

    def __deepcopy__(self, memo):
        return GatedTokenizer(self.shared)


def test_encoding_a_prompt_never_blocks_generation(make_server):
    """A text prompt is encoded without the lock the engine thread takes to detokenize every
    token, so a client encoding a huge text cannot stall the streams. Here the attacker's encode
    blocks outright; bystanders still run to completion meanwhile. (Were the lock shared, they
    could not: result() would time out, a hang guard, not a speed check.)"""
    tok = GatedTokenizer()
    server = make_server(tokenizer=tok)
    rids = []
    attacker = threading.Thread(target=lambda: rids.append(server.submit("ZZZZ", SamplingParams(max_tokens=3))))
    attacker.start()
    try:
        assert tok.shared["encoding"].wait(30)
        params = SamplingParams(max_tokens=BYSTANDER_TOKENS, ignore_eos=True)
        ids = [server.submit(p, params) for p in BYSTANDER_PROMPTS]
        for rid, prompt in zip(ids, BYSTANDER_PROMPTS):
            out = server.result(rid, timeout=60)
            assert out.token_ids == fake_reference(prompt, BYSTANDER_TOKENS)
            assert out.text == FakeTokenizer().decode(out.token_ids)  # detokenized meanwhile
    finally:
        tok.shared["gate"].set()
        attacker.join(60)
    assert server.result(rids[0]).prompt_token_ids == [25] * 4  # 'Z'
    assert_idle(server)


def test_text_too_long_for_the_context_is_rejected_before_encoding(make_server):
    """A text that cannot fit the context is rejected before it is encoded, so a huge prompt
    costs no encoding. FakeTokenizer's longest token is 1 character, so with max_model_len 64 any
    text over 64 characters is rejected (param "prompt") without calling encode; 60 characters
    are encoded once."""
    tok = GatedTokenizer()
    server = make_server(tokenizer=tok, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="prompt has 65 characters; at most 64 can fit") as info:
        server.submit("A" * 65)
    assert info.value.param == "prompt"
    assert tok.shared["calls"][0] == 0
    out = server.generate("A" * 60, SamplingParams(max_tokens=4))[0]  # the bound itself fits
    assert out.prompt_token_ids == [0] * 60 and tok.shared["calls"][0] == 1
    assert_idle(server)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from orca_ext.models import load_tokenizer

    return load_tokenizer(tokenizer_dir)


def test_real_tokenizer_bound_rejects_a_megabyte_prompt(make_server, hf_tokenizer):
    model = FakeModel(FakeSpec(vocab_size=len(hf_tokenizer)))
    server = make_server(model, tokenizer=hf_tokenizer)
    with pytest.raises(InvalidRequestError, match=r"prompt has 900000 characters; at most \d+ can fit") as info:
        server.submit("lorem ipsum " * 75_000)
    assert info.value.param == "prompt"
    assert server.stats()["iterations"] == 0


# -- Python API inputs ----------------------------------------------------------------------------
def test_lone_surrogate_and_bytes_prompts_are_invalid_requests(make_server, hf_tokenizer):
    """A lone surrogate in a text prompt, a bytes-like prompt (which would otherwise iterate as
    token ids: b"hi" as [104, 105]) and a token-id prompt over max_model_len are each an
    InvalidRequestError about the prompt, and the server keeps serving."""
    model = FakeModel(FakeSpec(vocab_size=len(hf_tokenizer)))
    server = make_server(model, tokenizer=hf_tokenizer)
    surrogate = r"prompt is not valid Unicode text: a lone surrogate '\\ud800' at character 3"
    with pytest.raises(InvalidRequestError, match=surrogate) as info:
        server.submit("hi \ud800 there")
    assert info.value.param == "prompt"
    for prompt in (b"hi", bytearray(b"hi"), memoryview(b"hi")):
        with pytest.raises(InvalidRequestError, match=f"got {type(prompt).__name__}; decode it to a str") as info:
            server.submit(prompt)
        assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match=r"prompt has 3000 tokens; max_model_len = 2000") as info:
        server.submit([1] * 3000)
    assert info.value.param == "prompt"
    out = server.generate("hi there", SamplingParams(max_tokens=3))[0]  # the server still serves
    assert len(out.token_ids) == 3
    assert_idle(server)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_max_model_len_above_the_model_is_one_line(tiny_model_dir, capsys, caplog, command):
    """A max_model_len above the model's is reported as one error line naming both limits, with no
    traceback."""
    from orca_ext.cli import main

    args = [command] + (["hello"] if command == "generate" else []) + [
        "--model", str(tiny_model_dir("llama")), "--max-model-len", "100000", "--device", "cpu"]
    assert main(args) == 2
    err = capsys.readouterr().err + "".join(r.getMessage() + "\n" for r in caplog.records if r.levelname == "ERROR")
    lines = [line for line in err.splitlines() if "max_model_len=100000" in line]
    assert len(lines) == 1 and "max_position_embeddings=512" in lines[0]
    assert "Traceback" not in err


# -- HTTP: logs, uploads, browsers, docs ----------------------------------------------------------
def make_app(server, **kw):
    from orca_ext.http import create_app

    return create_app(server, model_name="m", max_queue=16, **kw)


async def asgi_call(app, path: str, messages: list, headers: list | None = None, method: str = "POST"):
    """Call the ASGI app with `messages` as the client's side; after them the client goes quiet.
    Returns the status (None if nothing was sent)."""
    sent = []
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")] + (headers or []),
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), 60)  # a hang guard
    starts = [m for m in sent if m["type"] == "http.response.start"]
    return starts[0]["status"] if starts else None


def outcome_count(app, outcome: str) -> float:
    return app.state.service.metrics.registry.get_sample_value(
        "orca_http_requests_total", {"endpoint": "completions", "outcome": outcome}) or 0.0


def test_client_strings_are_escaped_in_logs(make_server, caplog):
    """Client strings (the model name, unknown field names) are logged escaped, each rejection on
    one line: a newline and ANSI escapes in them cannot forge a CRITICAL record."""
    server = make_server()
    app = make_app(server)
    forged = "x\n2026-01-01 00:00:00 CRITICAL root: disk on fire\x1b[2K\x1b[31m"

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000") as c:
            bad_model = await c.post("/v1/completions", json={"model": forged, "prompt": "AB"})
            bad_field = await c.post("/v1/completions", json={"prompt": "AB", forged: 1})
            good = await c.post("/v1/completions", json={"prompt": "AB", "max_tokens": 3, "temperature": 0})
            return bad_model, bad_field, good

    with caplog.at_level(logging.DEBUG):
        bad_model, bad_field, good = asyncio.run(go())
    assert bad_model.status_code == 404 and bad_model.json()["error"]["param"] == "model"
    assert bad_field.status_code == 400 and bad_field.json()["error"]["message"].endswith(forged)  # JSON-escaped
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == FakeTokenizer().decode(
        fake_reference([0, 1], 3))  # 'AB'
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("orca_ext")]
    assert sum("CRITICAL root" in m for m in ours) == 2  # both rejections were logged ...
    assert not any("\n" in m or "\x1b" in m for m in ours)  # ... on one line each, escapes escaped
    assert_idle(server)


def test_upload_aborted_mid_body_is_a_disconnect_not_an_internal_error(make_server, caplog):
    """A client that hangs up while sending its body is a disconnect: one INFO line, outcome
    "abort", no warning or error, and its queue place is given back."""
    server = make_server()
    app = make_app(server)
    messages = [{"type": "http.request", "body": b'{"prompt": "AB', "more_body": True}, {"type": "http.disconnect"}]
    with caplog.at_level(logging.INFO):
        asyncio.run(asgi_call(app, "/v1/completions", messages))
    assert outcome_count(app, "abort") == 1 and outcome_count(app, "internal_error") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("disconnected while sending its body" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)
    assert app.state.service.inflight == 0
    assert_idle(server)


def test_a_body_that_never_completes_times_out(make_server):
    """A body that is not complete within the body timeout is answered 408, so a client cannot
    hold a request (and its connection) by never finishing its body."""
    server = make_server()
    app = make_app(server, body_timeout=0.2)
    status = asyncio.run(asgi_call(app, "/v1/completions",
                                   [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}]))
    assert status == 408 and outcome_count(app, "invalid") == 1
    assert_idle(server)


def test_dns_rebinding_and_cross_site_posts_are_refused(make_server):
    """Without an API key too, a loopback-bound server answers loopback Host names only (and the
    trusted hosts), POST bodies must be application/json (which a browser sends cross-origin only
    after a CORS preflight), and CORS headers appear only for origins given to --cors-origins."""
    server = make_server()
    app = make_app(server, bind_host="127.0.0.1")
    widened = make_app(server, bind_host="127.0.0.1", trusted_hosts=["api.example.com", "*.corp.example"],
                       cors_origins=["https://ui.example.com"])
    body = b'{"prompt": "AB", "max_tokens": 2}'
    foreign = {"Host": "evil.example", "Origin": "http://evil.example", "Content-Type": "text/plain"}

    async def go(a, headers, method="POST"):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://127.0.0.1:8000") as c:
            return await c.request(method, "/v1/completions", content=body, headers=headers)

    r = asyncio.run(go(app, foreign))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    r = asyncio.run(go(app, {**foreign, "Host": "localhost:8000"}))
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert "access-control-allow-origin" not in r.headers
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000"):
        r = asyncio.run(go(app, {"Host": host, "Content-Type": "application/json; charset=utf-8"}))
        assert r.status_code == 200, (host, r.text)
    for host, status in (("api.example.com", 200), ("a.corp.example:443", 200), ("evil.example", 400),
                         ("api.example.com.evil.example", 400)):
        r = asyncio.run(go(widened, {"Host": host, "Content-Type": "application/json"}))
        assert r.status_code == status, host
    preflight = {"Host": "api.example.com", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    r = asyncio.run(go(widened, {**preflight, "Origin": "https://ui.example.com"}, "OPTIONS"))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example.com"
    r = asyncio.run(go(widened, {**preflight, "Origin": "http://evil.example"}, "OPTIONS"))
    assert "access-control-allow-origin" not in r.headers
    assert_idle(server)


def test_api_docs_are_off_by_default_and_behind_the_key(make_server):
    """/docs, /redoc and /openapi.json are not served by default; when enabled, they need the API
    key."""
    server = make_server()
    plain = make_app(server, api_key="k")
    docs = make_app(server, api_key="k", enable_docs=True)

    async def go(a, path, headers=None):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://127.0.0.1:8000") as c:
            return await c.get(path, headers=headers)

    for path in ("/docs", "/redoc", "/openapi.json"):
        assert asyncio.run(go(plain, path)).status_code == 404
        assert asyncio.run(go(docs, path)).status_code == 401
        assert asyncio.run(go(docs, path, {"Authorization": "Bearer k"})).status_code == 200
    assert "/v1/completions" in asyncio.run(go(docs, "/openapi.json", {"Authorization": "Bearer k"})).json()["paths"]


# -- slow clients ---------------------------------------------------------------------------------
def test_slow_header_connections_are_closed(make_server):
    """A connection whose request headers are incomplete --header-timeout seconds after it opened
    (or after its previous response) is closed, so connections that trickle their headers cannot
    be held open; a normal client is served meanwhile. (recv's socket timeout is a hang guard
    only.)"""
    import socket

    from http_utils import free_port
    from orca_ext.http import transport

    server = make_server()
    app = make_app(server)
    port = free_port()
    config = transport.make_config(app, host="127.0.0.1", port=port, log_level="warning", header_timeout=0.3)
    http = transport.DrainingServer(config, lambda hurry: app.state.service.drain(0.0, hurry))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            if http.started:
                break
            threading.Event().wait(0.05)
        slow = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            slow.append(s)
        # A keep-alive connection: one full request, then a slow second one.
        keep = socket.create_connection(("127.0.0.1", port), timeout=30)
        keep.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the whole first response
            chunk = keep.recv(4096)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200")
        keep.sendall(b"GET /health HTTP/1.1\r\nHo")
        ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "AB", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200
        for s in slow + [keep]:
            assert s.recv(4096) == b""  # closed by the server
            s.close()
    finally:
        http.should_exit = True
        thread.join(60)
    assert not thread.is_alive()
    assert_idle(server)


# -- shutdown -------------------------------------------------------------------------------------
def sse_events(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_drain_lets_running_requests_finish_then_ends_the_rest_in_band(make_server):
    """drain() (what SIGINT/SIGTERM run) refuses new requests (503), gives running ones the grace
    period (here cut short the moment the short request is done), then ends the rest with an
    error event followed by [DONE]: no stream is cut without an event."""
    gate = threading.Event()
    model = FakeModel(gate=gate)  # holds the engine until both requests are in
    server = make_server(model)
    app = make_app(server)
    svc = app.state.service

    async def until(condition, what: str) -> None:  # a hang guard, not a speed check
        for _ in range(6000):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never happened: {what}")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000",
                                     timeout=60) as c:
            def post(max_tokens):
                return asyncio.create_task(c.post("/v1/completions", json={
                    "prompt": "AB", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}))

            short, long = post(3), post(1900)
            await until(lambda: svc.inflight == 2 and all(a.submitted for a in svc.admissions.values()),
                        "both requests submitted")
            drain = asyncio.create_task(svc.drain(60.0, hurry=short.done))
            await until(lambda: svc.draining, "draining")
            refused = await c.post("/v1/completions", json={"prompt": "AB"})
            model.gate = None
            gate.set()
            await drain
            return await short, await long, refused

    short, long, refused = asyncio.run(go())
    events = sse_events(short.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    events = sse_events(long.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert FakeTokenizer().decode(fake_reference([0, 1], 1900)).startswith(text) and len(text) < 1900
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert outcome_count(app, "shutdown") == 2 and outcome_count(app, "length") == 1
    assert svc.inflight == 0
    assert_idle(server)


def test_sigterm_drains_streams_and_exits_cleanly(tiny_model_dir):
    """The same drain through a real signal: every open stream ends with [DONE] (those cut after
    the grace period with an error event first), the process exits 0, and its log holds no
    traceback and no ERROR line."""
    import signal

    from http_utils import ServerProcess

    with ServerProcess("--model", str(tiny_model_dir("llama")), "--max-batch-size", "1", "--shutdown-grace", "0.3",
                       env={"ORCA_EXT_KV_CACHE_MEMORY": "64MiB"}) as sp:
        results: dict[int, list] = {}
        started = threading.Semaphore(0)

        def stream(i):
            body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
            lines = []
            with httpx.stream("POST", sp.url("/v1/completions"), json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not lines:
                            started.release()
                        lines.append(line[len("data: "):])
            results[i] = lines

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert started.acquire(timeout=120)  # the first stream is producing
        # ... and all three are admitted (the other two wait for the one batch seat).
        deadline = time.monotonic() + 120
        while not re.search(r"^orca_http_requests_inflight 3(\.0)?$",
                            httpx.get(sp.url("/metrics"), timeout=10).text, re.M):
            assert time.monotonic() < deadline, "the three streams were never in flight together"
            time.sleep(0.05)
        sp.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        code = sp.proc.wait(120)
        log = sp.log()
    assert code == 0, log[-3000:]
    assert all(results[i][-1] == "[DONE]" for i in range(3)), results
    cut = [i for i in range(3) if any('"server_shutting_down"' in e for e in results[i])]
    assert cut, "with --max-batch-size 1 and 3 x 400 tokens, something must outlast a 0.3 s grace"
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_dropped_undelivered_outputs_are_summarised(make_server, caplog):
    """Dropped undelivered outputs cannot flood the log: the first drop is reported, later ones as
    a periodic summary (and one at shutdown); stats() counts them all."""
    server = make_server(max_batch_size=1, max_undelivered_outputs=3)
    with caplog.at_level(logging.WARNING, logger="orca_ext.server"):
        ids = [server.submit([i + 1], SamplingParams(max_tokens=2)) for i in range(10)]
        last = server.submit([9], SamplingParams(max_tokens=1))
        server.result(last)  # FCFS with batch size 1: all earlier requests have finished
        assert server.stats()["dropped_outputs"] == 7
        assert len(caplog.records) == 1 and "dropping" in caplog.records[0].getMessage()
        for i, rid in enumerate(ids[7:], start=7):
            assert server.result(rid).token_ids == fake_reference([i + 1], 2)
        assert_idle(server)
        server.shutdown()
    assert len(caplog.records) == 2 and "dropped 6 more" in caplog.records[1].getMessage()


# -- a stream of rejected requests cannot take the engine's CPU ------------------------------------
def test_rejection_budget_arithmetic():
    from orca_ext.http.rejections import RejectionBudget

    now = [0.0]
    b = RejectionBudget(rate=100, burst=300, min_charge=50, max_delay=2.0, max_clients=2, clock=lambda: now[0])
    assert b.delay("a") == 0.0
    b.charge("a", 10)           # charged at least min_charge: 300 - 50 = 250 left
    b.charge("a", 250)          # 0 left: still allowed
    assert b.delay("a") == 0.0
    b.charge("a", 120)          # -120: in debt for 1.2 s
    assert b.delay("a") == pytest.approx(1.2)
    b.charge("a", 1000)         # -1120: the delay is capped
    assert b.delay("a") == 2.0
    assert b.delay("b") == 0.0  # other addresses are unaffected
    now[0] = 11.2               # 11.2 s x 100 B/s paid it off
    assert b.delay("a") == 0.0
    now[0] = 100.0
    b.charge("a", 50), b.charge("b", 50), b.charge("c", 50)
    assert len(b._buckets) == 2 and b.delay("a") == 0  # bounded memory: the oldest is forgotten


def test_a_closing_connection_clears_only_its_own_rejection_marks():
    from orca_ext.http import rejections

    b = rejections.RejectionBudget(rate=1, burst=1, min_charge=50, max_delay=2.0)
    for i in range(50):  # many clients in debt, each with a marked connection
        b.charge(f"c{i}", 50, f"10.0.0.{i}:4000")
    b.charge("c0", 50, "10.0.0.0:4001")
    assert b.hold_back("c0", "10.0.0.0:4000") > 0 and b.hold_back("c0", "10.0.0.0:4001") > 0
    b.connection_closed("10.0.0.0:4000")
    assert b.hold_back("c0", "10.0.0.0:4000") == 0       # the same port again: a new connection
    assert b.hold_back("c0", "10.0.0.0:4001") > 0        # its other connection keeps its mark
    assert b.hold_back("c7", "10.0.0.7:4000") > 0        # and other clients' marks stay
    b.connection_closed("10.0.0.99:1")                    # an unmarked connection: nothing to do
    for i in range(rejections.MAX_MARKED_CONNECTIONS + 10):  # a transport that never reports closes
        b.charge("c1", 50, f"10.0.1.1:{i}")
    assert len(b._marked_by) == rejections.MAX_MARKED_CONNECTIONS  # bounded memory


def test_a_client_flooding_rejected_bodies_is_slowed_and_others_are_not(make_server):
    """A client address over its rejected-bytes budget gets 429 (after a delay, Connection:
    close) without its body being read, so a flood of bad requests cannot take the engine's CPU
    (reading and parsing a 1 MB body per request, back to back, takes ~40% of the server's CPU in
    bench/isolation.py); another address is served normally meanwhile."""
    from orca_ext.http.rejections import RejectionBudget

    server = make_server()
    app = make_app(server, rejections=RejectionBudget(rate=1000, burst=40_000, min_charge=1000, max_delay=0.01))
    big = json.dumps({"prompt": "AB", "stop": ["x"] * 5000}).encode()  # ~25 kB, invalid (too many stops)

    async def go():
        attacker = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("127.0.0.2", 4000)),
                                     base_url="http://127.0.0.1:8000")
        bystander = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 4001)),
                                      base_url="http://127.0.0.1:8000")
        async with attacker, bystander:
            headers = {"Content-Type": "application/json"}
            statuses = [(await attacker.post("/v1/completions", content=big, headers=headers)) for _ in range(4)]
            good = await bystander.post("/v1/completions", json={"prompt": "AB", "max_tokens": 3})
            return statuses, good

    statuses, good = asyncio.run(go())
    assert [r.status_code for r in statuses] == [400, 400, 429, 429]  # 2 x 25 kB > 40 kB burst
    assert statuses[0].json()["error"] == {"message": f"stop has 5000 strings; at most {MAX_STOP_STRINGS} are allowed",
                                           "type": "invalid_request_error", "param": "stop", "code": None}
    assert statuses[2].json()["error"]["code"] == "too_many_rejected_requests"
    assert statuses[2].headers["connection"] == "close" and int(statuses[2].headers["retry-after"]) >= 1
    assert good.status_code == 200
    assert outcome_count(app, "rejected_too_many_errors") == 2 and outcome_count(app, "invalid") == 2
    assert_idle(server)


# -- shared addresses, trusted proxies, /metrics and Host literals (HTTP transport level) ----------
def asgi_client(app, client: tuple[str, int]) -> httpx.AsyncClient:
    """An httpx client of the app whose requests come from `client` (address, port): one port
    is one connection to the app."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=client), base_url="http://127.0.0.1:8000")


def test_host_literals_must_be_exact():
    """A bracketed Host is an IPv6 literal with nothing after it but an optional :port."""
    from orca_ext.http.guards import host_is_allowed

    loopback_only = frozenset()
    for host in ("[::1]", "[::1]:8000", "localhost:8000", "127.0.0.1"):
        assert host_is_allowed(host, loopback_only), host
    for host in ("[::1]evil", "[::1]evil.example", "[::1]:8000evil", "[::1]:", "[::1]@evil.example",
                 "[localhost]", "[::1", "localhost:80x", "localhost:\u00b2", "evil.example"):
        assert not host_is_allowed(host, loopback_only), host


def test_host_with_text_after_the_ipv6_literal_is_refused(make_server):
    server = make_server()
    app = make_app(server, bind_host="127.0.0.1")

    async def go(host):
        async with asgi_client(app, ("127.0.0.1", 4000)) as c:
            return await c.post("/v1/completions", json={"prompt": "AB", "max_tokens": 2}, headers={"Host": host})

    r = asyncio.run(go("[::1]evil"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    assert asyncio.run(go("[::1]:8000")).status_code == 200
    assert_idle(server)


def test_client_keys_trust_forwarded_for_only_from_trusted_proxies():
    from orca_ext.http.clients import ClientKeys

    keys = ClientKeys(["10.0.0.0/8", "::1"])
    assert keys.key("10.0.0.1", ["1.2.3.4"]) == "1.2.3.4"
    assert keys.key("10.0.0.1", ["6.6.6.6, 1.2.3.4, 10.0.0.7"]) == "1.2.3.4"  # right-most untrusted
    assert keys.key("10.0.0.1", ["6.6.6.6", "1.2.3.4"]) == "1.2.3.4"          # several header lines
    assert keys.key("10.0.0.1", ["1.2.3.4, garbage"]) == "10.0.0.1"          # nothing past garbage
    assert keys.key("192.0.2.9", ["1.2.3.4"]) == "192.0.2.9"                 # untrusted peer: ignored
    assert keys.key("::1", ["2001:db8::1"]) == "2001:db8::/64"               # IPv6 clients by /64
    assert keys.key("::ffff:192.0.2.1") == "192.0.2.1"
    assert keys.key("2001:db8::1") == keys.key("2001:db8::ffff") != keys.key("2001:db8:0:1::1")
    with pytest.raises(ValueError, match="--trusted-proxies: 'nope'"):
        ClientKeys(["nope"])


def test_a_declared_body_costs_nothing_and_others_on_a_shared_address_are_served(make_server):
    """Behind a NAT (one address), a client sends header-only requests that declare a huge body,
    each on a new connection, and a bad 25 kB body now and then: the declared sizes cost it
    nothing (only the minimum charge per rejection), and when its bad bodies put the address in
    debt, a connection that was rejected is held back (429, body unread) while a well-formed
    request from the same address on another connection is still served."""
    from orca_ext.http.rejections import RejectionBudget

    server = make_server()
    budget = RejectionBudget(rate=1000, burst=60_000, min_charge=1000, max_delay=0.01)
    app = make_app(server, rejections=budget)
    huge = {"Content-Type": "application/json", "Content-Length": str(10 ** 9)}
    bad = json.dumps({"prompt": "AB", "stop": ["x"] * 5000}).encode()  # ~25 kB, too many stop strings
    good = {"prompt": "AB", "max_tokens": 3, "temperature": 0}

    async def go():
        declared = []
        for port in range(5000, 5020):  # 20 x 1 kB charged, never 20 x 1 GB
            declared.append(await asgi_call(app, "/v1/completions", [{"type": "http.request", "body": b"",
                                                                       "more_body": True}],
                                            headers=[(b"content-length", str(10 ** 9).encode())]))
        left_after_declared = budget.left("127.0.0.1")
        async with asgi_client(app, ("127.0.0.1", 6000)) as attacker:
            rejected = [(await attacker.post("/v1/completions", content=bad, headers={"Content-Type": "application/json"}))
                        for _ in range(4)]
        in_debt = budget.delay("127.0.0.1") > 0
        async with asgi_client(app, ("127.0.0.1", 6001)) as neighbour:
            served = await neighbour.post("/v1/completions", json=good)
        return declared, left_after_declared, rejected, in_debt, served

    declared, left, rejected, in_debt, served = asyncio.run(go())
    assert declared == [413] * 20
    assert left == pytest.approx(60_000 - 20 * 1000, abs=100)
    assert [r.status_code for r in rejected][:2] == [400, 400] and in_debt
    assert rejected[-1].status_code == 429 and rejected[-1].json()["error"]["code"] == "too_many_rejected_requests"
    assert rejected[-1].headers["connection"] == "close"
    assert served.status_code == 200
    assert served.json()["choices"][0]["text"] == FakeTokenizer().decode(fake_reference([0, 1], 3))
    assert_idle(server)


def test_behind_a_trusted_proxy_each_forwarded_client_has_its_own_budget(make_server):
    """Two clients share one connection of a trusted proxy: the one whose bad requests put it in
    debt is held back (429), the other, named by X-Forwarded-For, is served on the same
    connection. From an untrusted peer the header names nobody: its spoofed addresses share the
    peer's budget."""
    from orca_ext.http.rejections import RejectionBudget

    server = make_server()
    budget = RejectionBudget(rate=1000, burst=40_000, min_charge=1000, max_delay=0.01)
    app = make_app(server, rejections=budget, trusted_proxies=["10.0.0.0/8"])
    bad = json.dumps({"prompt": "AB", "stop": ["x"] * 5000}).encode()

    async def go(peer):
        async with asgi_client(app, (peer, 7000)) as proxy:
            def send(client, content=bad):
                return proxy.post("/v1/completions", content=content, headers={
                    "Content-Type": "application/json", "X-Forwarded-For": f"6.6.6.6, {client}"})
            rejected = [(await send("1.1.1.1")).status_code for _ in range(4)]
            served = await send("2.2.2.2", json.dumps({"prompt": "AB", "max_tokens": 2}).encode())
            return rejected, served.status_code

    assert asyncio.run(go("10.0.0.1")) == ([400, 400, 429, 429], 200)
    assert budget.delay("1.1.1.1") > 0 and budget.delay("2.2.2.2") == 0
    rejected, served = asyncio.run(go("192.0.2.1"))  # untrusted: one client, whatever the header says
    assert rejected == [400, 400, 429, 429] and served == 429
    assert_idle(server)


def test_metrics_come_from_a_shared_snapshot_behind_the_key(make_server):
    """/metrics needs the API key when one is set (unless public_metrics). 50 concurrent scrapes
    and the scrapes after them within the interval read server.stats(), which takes the engine
    lock, once; with interval 0 each sequential scrape renders afresh."""
    server = make_server()
    calls = []
    real_stats = server.stats
    server.stats = lambda: calls.append(1) or real_stats()  # counts the engine-lock reads
    keyed = make_app(server, api_key="k", metrics_interval=3600)
    public = make_app(server, api_key="k", public_metrics=True, metrics_interval=0)
    calls.clear()  # registering the collectors read it once each

    async def scrape(app, n, headers=None):
        async with asgi_client(app, ("127.0.0.1", 4000)) as c:
            return await asyncio.gather(*(c.get("/metrics", headers=headers) for _ in range(n)))

    assert [r.status_code for r in asyncio.run(scrape(keyed, 1))] == [401]
    assert not calls
    scrapes = asyncio.run(scrape(keyed, 50, {"Authorization": "Bearer k"}))
    assert {r.status_code for r in scrapes} == {200} and "orca_kv_slots_total" in scrapes[0].text
    assert len({r.text for r in scrapes}) == 1 and len(calls) == 1
    for _ in range(3):  # later scrapes within the interval: the same snapshot, no engine lock
        assert asyncio.run(scrape(keyed, 1, {"Authorization": "Bearer k"}))[0].text == scrapes[0].text
    assert len(calls) == 1
    calls.clear()
    for _ in range(3):
        assert asyncio.run(scrape(public, 1))[0].status_code == 200
    assert len(calls) == 3

# -- prompt and seed types, through the Python API --------------------------------------------------
@pytest.mark.parametrize("prompt", [torch.tensor([[1, 2]]), torch.tensor([[1], [2]]), torch.tensor(5),
                                    torch.tensor([1.0, 2.0]), torch.tensor([True, False]), [[1, 2]],
                                    [torch.tensor([1, 2])]], ids=repr)
def test_a_prompt_that_is_not_a_flat_list_of_ids_is_an_invalid_request(make_server, prompt):
    """A 2-D tensor, a 0-d one, float or bool ids, nested lists: InvalidRequestError about the
    prompt at submit, and the server keeps serving. A 1-D integer tensor or numpy array is a
    list of ids."""
    import numpy as np

    server = make_server()
    with pytest.raises(InvalidRequestError, match="prompt") as info:
        server.submit(prompt)
    assert info.value.param == "prompt"
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for ids in (torch.tensor([3, 1, 4]), np.array([3, 1, 4]), [np.int64(3), torch.tensor(1), 4]):
        assert server.result(server.submit(ids, params), timeout=60).token_ids == fake_reference([3, 1, 4], 4)
    assert_idle(server)


def test_a_numpy_uint64_seed_is_served_like_the_same_int(make_server):
    """seed=np.uint64(2**64 - 1) is the int 2**64 - 1: served (not failed in the sampler) with
    the same tokens, beside bystanders that are unaffected; beyond the uint64 range it is an
    InvalidRequestError about the seed at construction."""
    import numpy as np

    model = FakeModel()
    server = make_server(model)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=np.uint64(2**64 - 1), ignore_eos=True)
    [out] = alongside_bystanders(server, model, lambda: [server.submit([1, 2, 3], params)])
    assert out.finish_reason == "length" and out.error is None
    same = SamplingParams(max_tokens=8, temperature=1.0, seed=2**64 - 1, ignore_eos=True)
    assert server.generate([1, 2, 3], same)[0].token_ids == out.token_ids
    with pytest.raises(InvalidRequestError, match=r"seed must be in \[-2\*\*63, 2\*\*64 - 1\]") as info:
        SamplingParams(seed=2**64)
    assert info.value.param == "seed"


def test_probe_buckets_queue_waiters_in_turn_up_to_the_longest_wait():
    """reserve() lets a bucket go into debt by at most max_wait of its refill: each caller past
    the burst waits one refill interval longer than the one before, and one that would wait too
    long is refused without being charged."""
    from orca_ext.http.buckets import ClientBuckets

    now = [100.0]
    buckets = ClientBuckets(rate=4.0, burst=3.0, max_clients=8, clock=lambda: now[0])
    waits = [buckets.reserve("a", 1.0, max_wait=1.0) for _ in range(9)]
    assert waits[:3] == [0.0, 0.0, 0.0]                           # the burst
    assert waits[3:7] == pytest.approx([0.25, 0.5, 0.75, 1.0])   # in turn, 1 / rate apart
    assert waits[7:] == [None, None]                              # past max_wait: refused
    assert buckets.balance("a") == pytest.approx(-4.0)            # ... and not charged
    assert buckets.reserve("b", 1.0, max_wait=0.0) == 0.0         # another client has its own
    now[0] += 0.5                                                 # two refills later
    assert buckets.reserve("a", 1.0, max_wait=1.0) == pytest.approx(0.75)


def test_a_client_probing_in_a_loop_is_paced_and_one_flooding_is_refused_and_held_back(make_server):
    """/health and /metrics share one per-client rate (burst 5x). A client probing one request
    after another past the burst is paced, not refused; one with more probes in flight than the
    rate serves within PROBE_MAX_WAIT gets 429s that count against its rejection budget, so a
    connection that keeps flooding while in debt is held back; another client is answered at once."""
    from orca_ext.http.rejections import RejectionBudget
    from orca_ext.http.settings import PROBE_MAX_WAIT

    rate = 8.0
    server = make_server()
    # One refusal puts the client in debt for good (it costs twice the burst, refilled at 1 byte/s),
    # however many of the probes sent at once a slow server still fits in PROBE_MAX_WAIT.
    app = make_app(server, probe_rate=rate, rejections=RejectionBudget(rate=1, burst=1000, min_charge=2000,
                                                                        max_delay=0.01))

    async def go():
        async with asgi_client(app, ("127.0.0.2", 4000)) as flooder, asgi_client(app, ("127.0.0.1", 4001)) as other:
            paths = ["/health", "/metrics"]
            in_loop = [(await flooder.get(paths[i % 2])).status_code for i in range(int(5 * rate) + 3)]
            at_once = await asyncio.gather(*(flooder.get(paths[i % 2]) for i in range(int(rate * PROBE_MAX_WAIT) + 8)))
            last = await flooder.get("/health")
            others = [(await other.get(path)).status_code for path in paths]
            return in_loop, at_once, last, others

    in_loop, at_once, last, others = asyncio.run(go())
    assert in_loop == [200] * len(in_loop)          # the burst, then one at a time: paced, never refused
    refused = [r for r in at_once if r.status_code == 429]
    assert 0 < len(refused) < len(at_once)           # those that fit in PROBE_MAX_WAIT waited their turn
    assert {r.status_code for r in at_once} == {200, 429}
    assert refused[0].json()["error"]["code"] == "too_many_probes"
    assert last.status_code == 429 and last.json()["error"]["code"] == "too_many_rejected_requests"
    assert last.headers["connection"] == "close"    # in debt on a refused connection: held back
    assert others == [200, 200]
    with pytest.raises(ValueError, match="probe_rate must be > 0"):
        make_app(server, probe_rate=0)


def test_health_reads_no_engine_state_under_the_lock(make_server):
    """/health answers from the server's closed flag and the executor's error alone, so a probe
    does not wait for an engine iteration, and says why when it cannot serve."""
    server = make_server()
    assert server.health() is None
    server.shutdown()
    assert server.health() == "server closed"
