"""InvalidRequestError.param: every rejection at submit names its request field, and the HTTP
layer reports that field in the endpoint's own names (docs/DESIGN.md section 5).

The HTTP cases run in process (ASGI, no socket) over the fake model, through the official
`openai` client, so they check what a client actually receives.
"""
from __future__ import annotations

import asyncio
import pickle

import httpx
import openai
import pytest

from fake_model import FakeModel, FakeSpec, FakeTokenizer
from orca_ext.errors import InvalidRequestError
from orca_ext.sampling import MAX_STOP_STRINGS, SamplingParams
from orca_ext.server import Server

V = FakeSpec().vocab_size
MAX_MODEL_LEN = 64


def test_the_error_is_a_value_error_with_its_message_and_param():
    exc = InvalidRequestError("top_p must be in (0, 1], got 0", param="top_p")
    assert isinstance(exc, ValueError)
    assert str(exc) == "top_p must be in (0, 1], got 0" and exc.param == "top_p"
    assert InvalidRequestError("no one field").param is None
    back = pickle.loads(pickle.dumps(exc))  # what multiprocessing does to an exception
    assert type(back) is InvalidRequestError and str(back) == str(exc) and back.param == "top_p"


# -- Server.submit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, params, param, message", [
    ("", None, "prompt", "prompt must not be empty"),
    ([], None, "prompt", "prompt must not be empty"),
    (7, None, "prompt", "prompt must be a string or a list of token ids, got int"),
    (b"AB", None, "prompt", "got bytes; decode it to a str first"),
    ([1, 2.5], None, "prompt", r"prompt\[1\] must be an integer token id"),
    ([1, V], None, "prompt", rf"prompt\[1\] = {V} is outside the vocabulary \[0, {V}\)"),
    ([1] * (MAX_MODEL_LEN + 1), None, "prompt", rf"prompt has {MAX_MODEL_LEN + 1} tokens; max_model_len = 64"),
    ("A" * (MAX_MODEL_LEN + 1), None, "prompt", rf"prompt has {MAX_MODEL_LEN + 1} characters; at most 64"),
    ("AB\ud800", None, "prompt", "prompt is not valid Unicode text: a lone surrogate"),
    ([1] * 40, SamplingParams(max_tokens=30), "max_tokens",
     r"len\(prompt\) \+ max_tokens = 40 \+ 30 = 70 exceeds max_model_len = 64"),
    ([1], SamplingParams(stop_token_ids=[2, V]), "stop_token_ids",
     rf"stop_token_ids\[1\] = {V} is outside the vocabulary"),
    ([1], {"max_tokens": 3}, "params", "params must be a SamplingParams, got dict"),
])
def test_submit_names_the_field_in_param_and_message(make_server, prompt, params, param, message):
    server = make_server(max_model_len=MAX_MODEL_LEN, n_slots=100)
    with pytest.raises(InvalidRequestError, match=message) as info:
        server.submit(prompt, params)
    assert info.value.param == param
    assert server.stats()["iterations"] == 0 and server.stats()["waiting"] == 0  # no engine work


def test_request_ids_and_generate_params_are_named(make_server):
    server = make_server(max_model_len=MAX_MODEL_LEN, n_slots=100)
    with pytest.raises(InvalidRequestError, match="request_id must be a non-empty string") as info:
        server.submit([1], request_id="")
    assert info.value.param == "request_id"
    rid = server.submit([1], SamplingParams(max_tokens=50), request_id="mine")
    with pytest.raises(InvalidRequestError, match="request_id 'mine' is already in use") as info:
        server.submit([1], request_id="mine")
    assert info.value.param == "request_id"
    server.abort(rid)
    with pytest.raises(InvalidRequestError, match="params has 1 entries for 2 prompts") as info:
        server.generate([[1], [2]], [SamplingParams()])
    assert info.value.param == "params"


def test_a_request_over_the_kv_cache_is_reported_against_max_tokens(make_server):
    server = make_server(max_model_len=100, n_slots=50)
    with pytest.raises(InvalidRequestError, match=r"= 60 exceeds n_slots = 50") as info:
        server.submit([1] * 40, SamplingParams(max_tokens=20))
    assert info.value.param == "max_tokens"


def test_stop_strings_and_text_without_a_tokenizer_name_their_field():
    server = Server(FakeModel(), n_slots=100)
    try:
        with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer") as info:
            server.submit([1], SamplingParams(stop=["x"]))
        assert info.value.param == "stop"
        with pytest.raises(InvalidRequestError, match="a text prompt needs a tokenizer") as info:
            server.submit("AB")
        assert info.value.param == "prompt"
    finally:
        server.shutdown()


# -- the HTTP mapping ------------------------------------------------------------------------------
def test_field_names_map_engine_fields_to_the_endpoints_own():
    from orca_ext.http.errors import request_rejected
    from orca_ext.http.protocol import ChatCompletionRequest, CompletionRequest

    chat = [{"role": "user", "content": "hi"}]
    completion = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 5})
    new_chat = ChatCompletionRequest.model_validate({"messages": chat, "max_completion_tokens": 5})
    old_chat = ChatCompletionRequest.model_validate({"messages": chat, "max_tokens": 5})
    length = InvalidRequestError("len(prompt) + max_tokens = 9 > 8", param="max_tokens")
    too_long = InvalidRequestError("prompt has 9 tokens; max_model_len = 8", param="prompt")
    encoder = InvalidRequestError("messages has 90 characters; at most 80", param="messages")
    unnamed = InvalidRequestError("something about no one field")
    cases = [
        (completion, length, "max_tokens", str(length)),
        (completion, too_long, "prompt", str(too_long)),
        (new_chat, length, "max_completion_tokens", f"max_completion_tokens: {length}"),
        (old_chat, length, "max_tokens", str(length)),
        (old_chat, too_long, "messages", f"messages: {too_long}"),
        (old_chat, encoder, "messages", str(encoder)),  # already in the client's words
        (new_chat, unnamed, None, str(unnamed)),
    ]
    for body, exc, param, message in cases:
        err = request_rejected(exc, body.field_names)
        assert err.status == 400 and err.body() == {"error": {
            "message": message, "type": "invalid_request_error", "param": param, "code": None}}


class ChatTokenizer(FakeTokenizer):
    """FakeTokenizer (one character per token) with a chat template that concatenates the
    message contents. Its vocabulary also lists one 4-character string, so the encoder's
    length bound admits texts of up to 4 x max_model_len characters: texts between
    max_model_len and that bound are encoded, then refused by the token count. Copies share
    the `copies` counter."""

    chat_template = "the contents, concatenated"

    def __init__(self, copies: list[int] | None = None):
        super().__init__()
        self.copies = copies if copies is not None else [0]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize
        return "".join(m["content"] for m in messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return super().encode(text)

    def get_vocab(self) -> dict[str, int]:
        return {**super().get_vocab(), "ABCD": V}

    def __deepcopy__(self, memo):
        self.copies[0] += 1
        return ChatTokenizer(self.copies)


def call_app(app, calls):
    """Run `calls(client)` against `app` with an openai.AsyncOpenAI client over ASGI."""
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app/v1") as http:
            client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="none", max_retries=0, http_client=http)
            return await calls(client)
    return asyncio.run(go())


def test_engine_rejections_reach_the_openai_client_under_the_clients_field_names(make_server):
    from orca_ext.http import create_app

    server = make_server(tokenizer=ChatTokenizer(), max_model_len=MAX_MODEL_LEN, n_slots=100)
    app = create_app(server, model_name="m", max_queue=4)
    hi = [{"role": "user", "content": "hi"}]
    completions = [  # (keyword arguments, param, start of the message)
        (dict(prompt=[1, V]), "prompt", f"prompt[1] = {V} is outside the vocabulary"),
        (dict(prompt="AB", max_tokens=100), "max_tokens", "len(prompt) + max_tokens = 2 + 100 = 102 exceeds"),
        (dict(prompt="AB", max_tokens=0), "max_tokens", "max_tokens must be an integer >= 1"),
        (dict(prompt="AB", top_p=0), "top_p", "top_p must be in (0, 1]"),
        (dict(prompt="AB", extra_body={"top_k": -3}), "top_k", "top_k must be an integer >= 0"),
        (dict(prompt="AB", stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop", f"stop has {MAX_STOP_STRINGS + 1} strings"),
        (dict(prompt="AB", extra_body={"stop_token_ids": [V]}), "stop_token_ids",
         f"stop_token_ids[0] = {V} is outside the vocabulary"),
    ]
    chats = [
        (dict(messages=hi, max_completion_tokens=100), "max_completion_tokens",
         "max_completion_tokens: len(prompt) + max_tokens = 2 + 100 = 102 exceeds max_model_len = 64"),
        (dict(messages=hi, max_completion_tokens=0), "max_completion_tokens",
         "max_completion_tokens: max_tokens must be an integer >= 1"),
        (dict(messages=hi, max_tokens=100), "max_tokens", "len(prompt) + max_tokens = 2 + 100 = 102 exceeds"),
        (dict(messages=hi, temperature=-1), "temperature", "temperature must be a finite number >= 0"),
        (dict(messages=[{"role": "user", "content": "A" * 100}]), "messages",
         "messages: prompt has 100 tokens; max_model_len = 64"),
        (dict(messages=[{"role": "user", "content": "A" * 300}]), "messages",
         "messages has 300 characters; at most 256 can fit max_model_len"),
    ]

    async def calls(client):
        errors = []
        for create, cases in ((client.completions.create, completions),
                              (client.chat.completions.create, chats)):
            for kwargs, param, message in cases:
                with pytest.raises(openai.BadRequestError) as info:
                    await create(model="m", **kwargs)
                errors.append((info.value, param, message))
        return errors

    for err, param, message in call_app(app, calls):
        assert err.status_code == 400 and err.type == "invalid_request_error" and err.code is None
        assert err.param == param, (err.body, param)
        assert err.body["message"].startswith(message), (err.body, message)
    assert server.stats()["iterations"] == 0  # every one was refused before any engine work
    assert app.state.service.inflight == 0


def test_chat_and_completion_prompts_share_the_servers_encoder(make_server):
    """One PromptEncoder per server: a chat prompt and a text completion, one after the other,
    are encoded by the same private tokenizer copy."""
    from orca_ext.http import create_app

    tokenizer = ChatTokenizer()
    server = make_server(tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, n_slots=100)
    app = create_app(server, model_name="m", max_queue=4)

    async def calls(client):
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "AB"}], max_tokens=3, temperature=0)
        text = await client.completions.create(model="m", prompt="AB", max_tokens=3, temperature=0)
        return chat, text

    chat, text = call_app(app, calls)
    assert chat.usage.prompt_tokens == text.usage.prompt_tokens == 2
    assert chat.choices[0].message.content == text.choices[0].text
    assert tokenizer.copies[0] == 1
