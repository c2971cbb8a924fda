"""Every field of OpenAI's chat and completions request bodies is implemented or answered with a
400 naming it, and README.md lists exactly the latter.

The reference for "every field" is the installed `openai` package's request parameter types; a
field the package adds later fails the README check until the README (or the server) says what
becomes of it.
"""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import (ChatCompletionAssistantMessageParam, ChatCompletionDeveloperMessageParam,
                               ChatCompletionStreamOptionsParam, ChatCompletionSystemMessageParam,
                               ChatCompletionToolMessageParam, ChatCompletionUserMessageParam)
from openai.types.chat import completion_create_params as chat_params

from http_utils import ServerProcess
from orca_ext.http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions
from tool_models import make_tool_model

README = Path(__file__).resolve().parents[1] / "README.md"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
# Plausible values for the unsupported fields (any value of an unknown field is refused).
VALUES = {"audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text"], "store": True,
          "prediction": {"type": "content", "content": "x"}, "functions": [{"name": "f"}], "function_call": "auto",
          "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low", "verbosity": "low",
          "web_search_options": {}, "moderation": {}, "prompt_cache_key": "k", "prompt_cache_options": {},
          "prompt_cache_retention": "24h", "safety_identifier": "u1", "suffix": "!"}


def _keys(typed_dict) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


CHAT_UNSUPPORTED = _keys(chat_params.CompletionCreateParamsStreaming) - set(ChatCompletionRequest.model_fields)
# suffix is parsed only to be refused with its own message.
COMPLETION_UNSUPPORTED = (_keys(completion_params.CompletionCreateParamsStreaming)
                          - set(CompletionRequest.model_fields)) | {"suffix"}
STREAM_OPTIONS_UNSUPPORTED = _keys(ChatCompletionStreamOptionsParam) - set(StreamOptions.model_fields)
MESSAGE_UNSUPPORTED = set().union(*(_keys(t) for t in (
    ChatCompletionSystemMessageParam, ChatCompletionDeveloperMessageParam, ChatCompletionUserMessageParam,
    ChatCompletionAssistantMessageParam, ChatCompletionToolMessageParam))) - set(ChatMessage.model_fields)


def _readme_unsupported() -> set[str]:
    """The backticked names of README's "Not supported" bullet."""
    text = README.read_text()
    bullet = re.search(r"^- Not supported\b.*?(?=^- |^\s*$)", text, re.S | re.M)
    assert bullet, "README has no 'Not supported' bullet"
    return set(re.findall(r"`([^`]+)`", bullet.group(0)))


def test_readme_lists_exactly_the_unsupported_fields():
    assert CHAT_UNSUPPORTED and "suffix" in COMPLETION_UNSUPPORTED   # the reference is not empty
    listed = _readme_unsupported()
    expected = (CHAT_UNSUPPORTED | COMPLETION_UNSUPPORTED | MESSAGE_UNSUPPORTED
                | {f"stream_options.{k}" for k in STREAM_OPTIONS_UNSUPPORTED})
    assert expected <= listed, f"unsupported but not in README: {sorted(expected - listed)}"
    implemented = (set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)) - expected
    assert not listed & implemented, f"implemented but listed as unsupported: {sorted(listed & implemented)}"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    model = make_tool_model(tmp_path_factory.mktemp("tool_model"), tokenizer_dir)
    with ServerProcess("--model", str(model)) as sp:
        yield sp


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url("/v1"), timeout=120) as client:
        yield client


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


def _refused(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 400, (body, r.status_code, r.text)
    return r.json()["error"]


def test_each_unsupported_field_is_a_400_naming_it(http):
    for field in sorted(CHAT_UNSUPPORTED):
        err = _refused(http, "/chat/completions", {**CHAT, field: VALUES.get(field, "x")})
        assert err["param"] == field and field in err["message"], err
    for field in sorted(COMPLETION_UNSUPPORTED):
        err = _refused(http, "/completions", {**COMPLETION, field: VALUES.get(field, "x")})
        assert err["param"] == field and field in err["message"], err
    for field in sorted(STREAM_OPTIONS_UNSUPPORTED):
        err = _refused(http, "/chat/completions", {**CHAT, "stream": True, "stream_options": {field: True}})
        assert err["param"] == f"stream_options.{field}", err
    for field in sorted(MESSAGE_UNSUPPORTED):
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "ok", field: VALUES.get(field, {"name": "f", "arguments": "{}"})}]
        err = _refused(http, "/chat/completions", {**CHAT, "messages": messages})
        assert err["param"] == f"messages.1.{field}", err


@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, "messages.0.content"),
    ("/chat/completions", {**CHAT, "tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools.0.type"),
    ("/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [WEATHER]}}}, "tool_choice"),
    ("/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "custom", "custom": {"name": "c"}}},
     "tool_choice"),
    ("/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice"),
])
def test_unsupported_values_are_400s_naming_the_field(http, path, body, param):
    err = _refused(http, path, body)
    assert err["param"] == param, err
    assert "supported" in err["message"] or "should be" in err["message"] or "required" in err["message"], err


def test_the_openai_client_sees_the_refusal(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], store=True)
    assert exc.value.param == "store"
