"""The Hermes tool-call parser, whole and streamed: a stream cut anywhere gives the same calls
and content as parsing the whole text."""
from __future__ import annotations

import json
import random

import pytest

from orca_ext.guided.tool_parsers import HermesToolParser, ToolCallStream


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


TEXTS = [
    "plain text with < and <tool and no call",
    _call("f", {"a": 1}),
    _call("f", {"a": [1, 2]}) + "\n" + _call("g_2", {"s": "</tool_call"}),
    "Let me check. " + _call("weather", {"city": "Paris"}) + " Done.",
    "<tool_call>\nnot json\n</tool_call> tail",
    "unfinished <tool_call>\n{\"name\": \"f\"",
]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_whole_parse(text):
    whole = HermesToolParser().parse(text)
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = ToolCallStream(HermesToolParser())
        deltas = []
        for k, p in enumerate(pieces):
            deltas += stream.feed(p, final=k == len(pieces) - 1)
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        content = "".join(d.get("content", "") for d in deltas)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [(c.name, c.arguments) for c in whole.calls]
        assert [c["index"] for c in calls] == list(range(len(calls)))
        assert content.strip() == whole.content.strip()
        # Nothing that could be part of a call is shown as content before the call is complete.
        assert "<tool_call>" not in content or not whole.calls or "not json" in text


def test_parse_shapes():
    out = HermesToolParser().parse("Sure. " + _call("f", {"x": "é"}))
    assert out.content == "Sure." and len(out.calls) == 1
    call = out.calls[0]
    assert call.name == "f" and json.loads(call.arguments) == {"x": "é"}
    d = call.as_dict()
    assert d["type"] == "function" and d["id"].startswith("call_") and d["function"]["name"] == "f"
    assert HermesToolParser().parse("no calls").calls == []
