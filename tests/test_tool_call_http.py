"""Streamed tool calls over HTTP, checked with the openai client against the non-streamed answer.

The server runs a tiny random-weight Qwen3-shaped model with a tools-capable chat template
(tool_models.py); its calls are grammar-constrained (tool_choice "required" or a named function,
or a regex under tool_choice "auto" for text before a call), so every call below is what the
parser reads. A stream accumulated the way OpenAI's docs show must equal the non-streamed
response of the same seed, choice by choice.
"""
from __future__ import annotations

import json

import httpx
import pytest

from tool_models import WEATHER, tool_client, tool_server  # noqa: F401 (fixtures)

NOTE = {"type": "function", "function": {
    "name": "save_note", "description": "Save a note",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 24},
                                                    "tags": {"type": "array", "items": {"type": "string"},
                                                             "maxItems": 3}},
                   "required": ["text", "tags"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model(tool_client) -> str:
    return tool_client.models.list().data[0].id


def _accumulate(chunks) -> dict[int, dict]:
    """Per choice index: content, tool calls and finish_reason, accumulated as OpenAI's docs show
    (the first delta of a call carries its id and name; later ones add argument fragments)."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            c = choices.setdefault(ch.index, {"content": "", "calls": {}, "finish_reason": None, "fragments": 0})
            c["content"] += ch.delta.content or ""
            for d in ch.delta.tool_calls or ():
                if d.index not in c["calls"]:
                    assert d.id and d.type == "function" and d.function.name, d
                    assert d.function.arguments == "", d
                    c["calls"][d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None, d
                    c["calls"][d.index]["arguments"] += d.function.arguments
                    c["fragments"] += 1
            if ch.finish_reason:
                assert c["finish_reason"] is None
                c["finish_reason"] = ch.finish_reason
    return choices


def _whole(choice) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]


def _streamed(c: dict) -> list[tuple[str, str]]:
    assert sorted(c["calls"]) == list(range(len(c["calls"])))
    return [(call["name"], call["arguments"]) for _, call in sorted(c["calls"].items())]


@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", True),
    ({"type": "function", "function": {"name": "save_note"}}, True),
    ({"type": "function", "function": {"name": "get_weather"}}, False),
])
def test_stream_accumulates_to_the_whole_answer_per_choice(tool_client, model, tool_choice, parallel):
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather, then a note."}], tools=[WEATHER, NOTE],
              tool_choice=tool_choice, parallel_tool_calls=parallel, n=3, max_tokens=120, temperature=1.0, seed=5)
    whole = tool_client.chat.completions.create(**kw)
    streamed = _accumulate(tool_client.chat.completions.create(stream=True, **kw))
    assert sorted(streamed) == [0, 1, 2]
    for choice in whole.choices:
        c = streamed[choice.index]
        assert _whole(choice), choice   # a forced call is there, finished or cut short
        assert _streamed(c) == _whole(choice)
        assert c["finish_reason"] == choice.finish_reason in ("tool_calls", "length")
        assert c["content"] == "" and choice.message.content is None
        assert c["fragments"] >= len(c["calls"])   # arguments come in fragments, not whole at the end
        for name, arguments in _whole(choice)[:-1] if choice.finish_reason == "length" else _whole(choice):
            assert name in ("get_weather", "save_note")
            assert isinstance(json.loads(arguments), dict)


def test_call_cut_short_by_max_tokens_keeps_the_arguments_so_far(tool_client, model):
    cut_in_arguments = 0
    for max_tokens in (16, 19, 22, 25):
        kw = dict(model=model, messages=[{"role": "user", "content": "Note this."}], tools=[NOTE],
                  tool_choice="required", max_tokens=max_tokens, temperature=1.0, seed=8)
        whole = tool_client.chat.completions.create(**kw).choices[0]
        c = _accumulate(tool_client.chat.completions.create(stream=True, **kw))[0]
        assert whole.finish_reason == c["finish_reason"] == "length"
        assert _streamed(c) == _whole(whole)
        if _whole(whole):   # past the header: the call with the arguments written so far
            (name, arguments), = _whole(whole)
            assert name == "save_note" and arguments.startswith("{")
            with pytest.raises(ValueError):
                json.loads(arguments)
            cut_in_arguments += 1
        else:               # inside the header: the text is content, as written
            assert whole.message.content.startswith("<tool_call>") and c["content"] == whole.message.content
    assert cut_in_arguments >= 2


def test_text_before_the_call_streams_as_content(tool_client, model):
    """tool_choice auto, the output shaped by a regex: the prose streams as content, the markup
    never reaches the client, the call streams as deltas."""
    regex = (r'Let me check[a-z ]{0,6}\. <tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "[A-Za-z<}"]{1,8}", "days": [1-7]\}\}\n</tool_call>')
    for seed in range(3):
        kw = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], max_tokens=80,
                  temperature=1.0, seed=seed, extra_body={"guided_regex": regex})
        whole = tool_client.chat.completions.create(**kw).choices[0]
        c = _accumulate(tool_client.chat.completions.create(stream=True, **kw))[0]
        assert whole.finish_reason == c["finish_reason"] == "tool_calls"
        assert whole.message.content.startswith("Let me check") and "<tool_call>" not in whole.message.content
        assert c["content"].strip() == whole.message.content
        assert _streamed(c) == _whole(whole) and _whole(whole)[0][0] == "get_weather"


def test_raw_chunks_have_openais_shape(tool_server, model):
    body = {"model": model, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER],
            "tool_choice": "required", "max_tokens": 60, "temperature": 1.0, "seed": 3, "stream": True}
    deltas = []
    with httpx.stream("POST", tool_server.url("/v1/chat/completions"), json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas += [ch["delta"] for ch in json.loads(line[6:])["choices"]]
    calls = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert all(len(tc) == 1 for tc in calls)
    opened: list[int] = []
    fragments = 0
    for (d,) in calls:
        if d["index"] not in opened:   # a call opens with its id and name
            assert d["index"] == len(opened)
            opened.append(d["index"])
            assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
            assert d["function"] == {"name": "get_weather", "arguments": ""}
        else:                          # then only argument fragments
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            fragments += 1
    assert opened and fragments > len(opened)


def test_sdk_stream_helper_accumulates_the_same_calls(tool_client, model):
    """The SDK's chat.completions.stream helper accumulates argument deltas itself."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, NOTE],
              tool_choice="required", max_tokens=120, temperature=1.0, seed=21)
    whole = tool_client.chat.completions.create(**kw).choices[0]
    argument_events = 0
    with tool_client.chat.completions.stream(**kw) as stream:
        for ev in stream:
            argument_events += ev.type == "tool_calls.function.arguments.delta"
        final = stream.get_final_completion().choices[0]
    assert _whole(final) == _whole(whole) and final.finish_reason == whole.finish_reason
    assert argument_events > len(_whole(whole))
