"""The Hermes tool-call parser, whole and streamed.

Properties: a stream cut anywhere gives exactly the whole parse's calls (names, argument JSON
text) and content; the deltas have OpenAI's order (a call's start, then its argument fragments);
arguments stream as they are written, and content as it comes, holding back only what may be a
marker; outputs built from known pieces parse to those pieces (the independent reference), also
when cut short at any point as max_tokens would.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from orca_ext.guided.tool_parsers import (TOOL_PARSERS, ArgumentsDelta, CallStart, ContentDelta, HermesToolParser,
                                          ToolParser)

START, END = "<tool_call>", "</tool_call>"
UGLY_STRINGS = ["<", "}", "{", "]", '"', '\\"', "\\", "</tool_call>", "<tool_call>", "é", "\u2028", "\n",
                "a\\nb", "{\"name\": \"x\"}", "</tool", ""]


# -- random outputs ---------------------------------------------------------------------------------

def _json_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["obj", "list", "str", "num", "lit"] if depth < 3 else ["str", "num", "lit"])
    if kind == "obj":
        return {_string(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind == "list":
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "str":
        return _string(rng)
    if kind == "num":
        return rng.choice([0, -7, 3.25, 1e21, rng.randint(-10**6, 10**6)])
    return rng.choice([True, False, None])


def _string(rng: random.Random) -> str:
    return "".join(rng.choice(UGLY_STRINGS + ["ab", "k", " "]) for _ in range(rng.randint(0, 4)))


def _dumps(rng: random.Random, value) -> str:
    """JSON text in a random layout, as different models write it."""
    return rng.choice([
        lambda v: json.dumps(v),
        lambda v: json.dumps(v, ensure_ascii=False),
        lambda v: json.dumps(v, separators=(",", ":")),
        lambda v: json.dumps(v, indent=rng.choice([1, 2]), ensure_ascii=rng.random() < 0.5),
    ])(value)


def _ws(rng: random.Random) -> str:
    return rng.choice(["", "", " ", "\n", " \n  "])


def _prose(rng: random.Random) -> str:
    parts = ["Sure", " ", "\n", "<", "<tool", "tool_call>", "</tool_call>", "{", "}", '"', "\\", "x < y", "é"]
    while True:
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 6)))
        if START not in text:
            return text


@dataclass
class Built:
    text: str
    prose: list[tuple[int, int]]           # spans of text outside calls
    calls: list[tuple[str, int, str]]      # (name, where the arguments start, arguments text)


def _build(rng: random.Random, calls: int) -> Built:
    """Prose and well-formed calls (name first), interleaved."""
    text, prose, built = "", [], []
    for k in range(calls + 1):
        p = (rng.choice(["", "\n", "\n\n"]) if k else "") + _prose(rng)   # what follows a call is text
        prose.append((len(text), len(text) + len(p)))
        text += p
        if k == calls:
            break
        name = rng.choice(["get_weather", "f", "a.b-c_9", "名前"])
        args = _dumps(rng, {_string(rng): _json_value(rng) for _ in range(rng.randint(0, 4))})
        key = rng.choice(['"arguments"', '"parameters"'])
        head = (START + _ws(rng) + "{" + _ws(rng) + '"name"' + _ws(rng) + ":" + _ws(rng) + json.dumps(name)
                + _ws(rng) + "," + _ws(rng) + key + _ws(rng) + ":" + _ws(rng))
        built.append((name, len(text) + len(head), args))
        text += head + args + _ws(rng) + "}" + _ws(rng) + END
    return Built(text, prose, built)


def _odd_block(rng: random.Random) -> str:
    """Blocks that are not in the streamable order, or not calls at all."""
    args = {"q": _string(rng), "n": [1, {"x": "}"}]}
    return rng.choice([
        START + "\n" + json.dumps({"arguments": args, "name": "late_name"}) + "\n" + END,
        START + json.dumps({"name": "stringly", "arguments": json.dumps(args)}) + END,
        START + json.dumps({"name": "no_args"}) + END,
        START + json.dumps({"name": 5, "arguments": {}}) + END,
        START + "\nnot json\n" + END,
        START + " plain words",
        START + '{"name": "f", "arguments": {"a": 1}, "extra": true}' + END,
        START + '{"name": "unclosed", "arguments": {"a": [1, 2}' + "\n" + END + " after",
        START + '{"name": "bad\\escape", "arguments": {}}' + END,
    ])


def _random_output(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.random()
        pieces.append(_build(rng, rng.randint(1, 2)).text if kind < 0.5 else
                      _odd_block(rng) if kind < 0.8 else _prose(rng))
    text = "".join(pieces)
    if rng.random() < 0.4:   # cut short, as max_tokens does
        text = text[:rng.randint(0, len(text))]
    return text


# -- streaming ------------------------------------------------------------------------------------

def _stream(pieces: list[str], parser: ToolParser | None = None) -> list:
    parser = parser or HermesToolParser()
    deltas = []
    for k, p in enumerate(pieces):
        deltas += parser.feed(p, final=k == len(pieces) - 1)
    return deltas


def _accumulate(deltas: list) -> tuple[str, list[tuple[str, str, str]]]:
    """(content, [(id, name, arguments)]) the way an OpenAI client accumulates a stream, checking
    the order of the deltas on the way."""
    content, calls = "", []
    for d in deltas:
        if isinstance(d, ContentDelta):
            content += d.text
        elif isinstance(d, CallStart):
            assert d.index == len(calls), "calls are numbered in order"
            calls.append([d.id, d.name, ""])
        else:
            assert isinstance(d, ArgumentsDelta) and d.index == len(calls) - 1, "fragments follow their call"
            calls[d.index][2] += d.text
    return content, [tuple(c) for c in calls]


def _random_split(rng: random.Random, text: str) -> list[str]:
    if len(text) < 2:
        return [text]
    if rng.random() < 0.2:
        return list(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_streamed_calls_equal_the_whole_parse_for_any_split():
    rng = random.Random(20240521)
    with_calls = 0
    for _ in range(400):
        text = _random_output(rng)
        whole = HermesToolParser().parse(text)
        with_calls += bool(whole.calls)
        for _ in range(4):
            content, calls = _accumulate(_stream(_random_split(rng, text)))
            assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in whole.calls], text
            assert content.strip() == whole.content.strip(), text
            assert all(i.startswith("call_") for i, _, _ in calls) and len({i for i, _, _ in calls}) == len(calls)
            if START not in whole.content:
                assert START not in content, text
        if not whole.calls:   # nothing is lost or added when there is no call
            assert whole.content == text
    assert with_calls > 150


def test_built_outputs_parse_to_their_pieces_whole_and_cut_short():
    """The independent reference: outputs assembled from known calls and prose."""
    rng = random.Random(7)
    for _ in range(300):
        b = _build(rng, rng.randint(0, 3))
        cut = len(b.text) if rng.random() < 0.3 else rng.randint(0, len(b.text))
        text = b.text[:cut]
        whole = HermesToolParser().parse(text)
        expected = [(name, args[:cut - at]) for name, at, args in b.calls if cut > at]
        assert [(c.name, c.arguments) for c in whole.calls] == expected, text
        for (name, at, args), call in zip(b.calls, whole.calls):
            if cut >= at + len(args):
                assert json.loads(call.arguments) == json.loads(args)
        prose = "".join(text[s:min(e, cut)] for s, e in b.prose if s < cut)
        unfinished = [at for name, at, _ in b.calls if at >= cut > b.text.rfind(START, 0, at)]
        if unfinished:   # cut inside a call's header: that text is content
            prose += text[b.text.rfind(START, 0, unfinished[0]):]
        assert whole.content == (prose.strip() if expected else prose), text
        content, calls = _accumulate(_stream(_random_split(rng, text)))
        assert [(n, a) for _, n, a in calls] == expected and content.strip() == whole.content.strip()


def test_arguments_and_content_stream_as_they_are_written():
    """Fed character by character, the arguments sent so far are exactly what was written of them
    (nothing is held back inside valid JSON), and content lags by at most the characters that may
    start a marker (plus whitespace, held until text follows it)."""
    rng = random.Random(3)
    for _ in range(60):
        b = _build(rng, rng.randint(1, 2))
        parser = HermesToolParser()
        deltas = []
        first_call = b.text.index(START)
        for k, c in enumerate(b.text):
            deltas += parser.feed(c)
            content, calls = _accumulate(deltas)
            for (name, at, args), call in zip(b.calls, calls):
                if k + 1 > at:
                    assert call[1] == name and call[2] == args[:k + 1 - at]
            if k < first_call:
                written = b.text[:k + 1]
                assert written.startswith(content)
                assert len(written.rstrip()) - len(content) <= len(START) - 1


def test_call_deltas_name_once_then_fragments():
    text = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris <}"}}\n</tool_call>'
    deltas = _stream([text[i:i + 3] for i in range(0, len(text), 3)])
    kinds = [type(d).__name__ for d in deltas]
    assert kinds[0] == "ContentDelta" and deltas[0].text.startswith("Che")
    assert kinds.count("CallStart") == 1 and kinds.index("CallStart") < kinds.index("ArgumentsDelta")
    assert sum(k == "ArgumentsDelta" for k in kinds) > 5   # streamed in fragments, not at the end
    content, calls = _accumulate(deltas)
    assert content.strip() == "Checking." and calls[0][1:] == ("get_weather", '{"city": "Pa\\"ris <}"}')


@pytest.mark.parametrize("text, content, calls", [
    ("plain text with < and <tool and no call", "plain text with < and <tool and no call", []),
    (START + '\n{"arguments": {"a": [1]}, "name": "g"}\n' + END, None, [("g", '{"a": [1]}')]),
    (START + '{"name": "f", "arguments": "{\\"a\\": 1}"}' + END, None, [("f", '{"a": 1}')]),
    (START + '{"name": "f"}' + END, None, [("f", "{}")]),
    (START + "\nnot json\n" + END + " tail", START + "\nnot json\n" + END + " tail", []),
    ("a " + START + " b", "a " + START + " b", []),
    ('unfinished <tool_call>\n{"name": "f"', 'unfinished <tool_call>\n{"name": "f"', []),
    ('x <tool_call>{"name": "f", "arguments": {"a": [1, ', "x", [("f", '{"a": [1, ')]),
    (START + '{"name": "f", "arguments": {"a": 1}, "id": 3}\n' + END + " done", "done", [("f", '{"a": 1}')]),
    (START + '{"name": "f", "arguments": {"a": 1\n' + END + "after", "after", [("f", '{"a": 1\n')]),
    (START + '{"name": "f", "arguments": {}}' + START + '{"name": "g", "arguments": {}}' + END, None,
     [("f", "{}"), ("g", "{}")]),
])
def test_parse_cases(text, content, calls):
    out = HermesToolParser().parse(text)
    assert [(c.name, c.arguments) for c in out.calls] == calls
    assert out.content == (content if content is not None else "")


def test_parse_shapes():
    out = HermesToolParser().parse('Sure. <tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call>')
    assert out.content == "Sure." and len(out.calls) == 1
    call = out.calls[0]
    assert call.name == "f" and json.loads(call.arguments) == {"x": "é"}
    d = call.as_dict()
    assert d["type"] == "function" and d["id"].startswith("call_") and d["function"]["name"] == "f"
    assert HermesToolParser().parse("no calls").calls == []


def test_registry_parsers_are_incremental():
    for cls in TOOL_PARSERS.values():
        assert issubclass(cls, ToolParser) and cls.scan is not ToolParser.scan


def test_long_header_is_read_whole():
    """A header that never completes is bounded: past max_header it waits for the block's end."""
    name = "n" * 3000
    text = START + '{"name": "' + name + '", "arguments": {"a": 1}}' + END
    content, calls = _accumulate(_stream([text[i:i + 7] for i in range(0, len(text), 7)]))
    assert content == "" and [(n, a) for _, n, a in calls] == [(name, '{"a": 1}')]
