"""Tool-call parsers: the model's text -> OpenAI `tool_calls`, incrementally as it streams.

A parser reads one model family's tool-call markup from one output. It is fed the text as it is
generated (`feed(delta, final)`) and returns typed deltas: `ContentDelta` (text outside calls),
`CallStart` (a call's index, id and function name, once) and `ArgumentsDelta` (the next fragment
of that call's arguments JSON, as the model writes it). The whole-output parse (`parse`) is the
same parser fed the whole text at once, so the streamed and the whole answers agree by
construction: the fragments of a call concatenate to the whole parse's `arguments`.

`HermesToolParser` reads the Hermes / Qwen format,
`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` (any number of blocks; the text
outside them is the content). Its arguments stream as written once the header up to
`"arguments": ` is complete.

Adding a parser: subclass `ToolParser` and implement `scan(delta, final) -> list[ToolDelta]`:
consume the new text, return what is decided, hold back only text that is undecided (a tail
that may still grow into markup), and flush everything when `final`. Open a call with
`self.begin_call(name)` (it numbers the calls and gives the id). Register the class in
TOOL_PARSERS under the name the server selects it by. The base class holds back whitespace
between calls and merges adjacent deltas.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Optional, Union


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def as_dict(self, index: Optional[int] = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int    # the call's position among this output's calls, from 0
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int    # the CallStart it continues
    text: str


ToolDelta = Union[ContentDelta, CallStart, ArgumentsDelta]


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCall]


class ToolParser:
    """The incremental parser of one output (one instance per choice)."""

    def __init__(self) -> None:
        self.calls = 0        # calls begun so far
        self._blank = ""      # whitespace-only content held until text follows it

    def scan(self, delta: str, final: bool) -> list[ToolDelta]:
        raise NotImplementedError

    def begin_call(self, name: str) -> CallStart:
        start = CallStart(self.calls, new_call_id(), name)
        self.calls += 1
        return start

    def feed(self, delta: str, final: bool = False) -> list[ToolDelta]:
        """The deltas decided by the text so far. Whitespace-only content is held until text
        follows it (the blank lines between calls are not content), and dropped at the end of an
        output that made calls."""
        out: list[ToolDelta] = []
        for d in _merged(self.scan(delta, final)):
            if not isinstance(d, ContentDelta):
                out.append(d)
            elif not d.text.strip():
                self._blank += d.text
            else:
                out.append(ContentDelta(self._blank + d.text))
                self._blank = ""
        if final and self._blank and not self.calls:
            out.append(ContentDelta(self._blank))
            self._blank = ""
        return _merged(out)

    def parse(self, text: str) -> ParsedOutput:
        """The whole output at once (on a fresh parser): the content (stripped when there are
        calls) and the calls."""
        content: list[str] = []
        calls: list[list[str]] = []   # [id, name, arguments]
        for d in self.feed(text, final=True):
            if isinstance(d, ContentDelta):
                content.append(d.text)
            elif isinstance(d, CallStart):
                calls.append([d.id, d.name, ""])
            else:
                calls[d.index][2] += d.text
        text_out = "".join(content)
        return ParsedOutput(text_out.strip() if calls else text_out,
                            [ToolCall(name, args, call_id) for call_id, name, args in calls])


def _merged(deltas: list[ToolDelta]) -> list[ToolDelta]:
    """Adjacent content, and adjacent fragments of one call's arguments, as one delta each."""
    out: list[ToolDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if isinstance(d, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + d.text)
        elif isinstance(d, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == d.index:
            out[-1] = ArgumentsDelta(d.index, last.text + d.text)
        elif not (isinstance(d, (ContentDelta, ArgumentsDelta)) and not d.text):
            out.append(d)
    return out


# -- Hermes ----------------------------------------------------------------------------------------

_WS = " \t\n\r"
_TEXT, _HEAD, _ARGS_OBJECT, _ARGS_STRING, _TAIL, _BLOCK = range(6)


class _NeedMore(Exception):
    """The text ends before the header can be decided."""


class _Mismatch(Exception):
    """The text is not the streamable header."""


class HermesToolParser(ToolParser):
    """States: text (content until `<tool_call>`); the header (`{"name": "f", "arguments": `,
    held until complete); the arguments (an object streams character by character as written, a
    string value is sent decoded once it closes); the tail (the rest of the block up to
    `</tool_call>`, dropped). A block whose JSON is not in that order (say, "arguments" first)
    is read whole at its `</tool_call>`; a block that is not a call is content, as written."""

    start = "<tool_call>"
    end = "</tool_call>"
    max_header = 1024   # chars of a header in progress before the block is read whole instead

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""          # text received and not yet decided
        self._state = _TEXT
        self._depth = 0         # arguments: nesting of {} and []
        self._in_string = False
        self._escaped = False
        self._scanned = 0       # string arguments / whole block: chars of _buf already scanned

    def scan(self, delta: str, final: bool) -> list[ToolDelta]:
        self._buf += delta
        out: list[ToolDelta] = []
        steps = {_TEXT: self._text, _HEAD: self._head, _ARGS_OBJECT: self._args_object,
                 _ARGS_STRING: self._args_string, _TAIL: self._tail, _BLOCK: self._block}
        while steps[self._state](out, final):
            pass
        return out

    # Each step consumes what it can decide and returns whether the state changed (run again).

    def _text(self, out: list[ToolDelta], final: bool) -> bool:
        i = self._buf.find(self.start)
        if i < 0:
            keep = 0 if final else _partial_suffix(self._buf, self.start)
            out.append(ContentDelta(self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        out.append(ContentDelta(self._buf[:i]))
        self._buf = self._buf[i:]
        self._state = _HEAD
        return True

    def _head(self, out: list[ToolDelta], final: bool) -> bool:
        buf = self._buf
        try:
            i = _skip_ws(buf, len(self.start))
            if buf[i] != "{":   # not a call: the marker is text
                out.append(ContentDelta(self.start))
                self._buf = buf[len(self.start):]
                self._state = _TEXT
                return True
            name, i = _header_fields(buf, i + 1)
        except _NeedMore:
            if final:   # cut short inside the header: the client gets the text
                out.append(ContentDelta(buf))
                self._buf = ""
                return False
            if len(buf) <= self.max_header:
                return False
            self._state, self._scanned = _BLOCK, len(self.start)
            return True
        except _Mismatch:
            self._state, self._scanned = _BLOCK, len(self.start)
            return True
        out.append(self.begin_call(name))
        self._buf = buf[i:]
        if buf[i] == "{":
            self._state, self._depth, self._in_string, self._escaped = _ARGS_OBJECT, 0, False, False
        else:
            self._state, self._scanned, self._escaped = _ARGS_STRING, 1, False
        return True

    def _args_object(self, out: list[ToolDelta], final: bool) -> bool:
        buf, index = self._buf, self.calls - 1
        for i, c in enumerate(buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    out.append(ArgumentsDelta(index, buf[:i + 1]))
                    self._buf, self._state = buf[i + 1:], _TAIL
                    return True
            elif c == "<":
                # Outside a string the JSON is broken anyway; a closing marker ends the call.
                rest = buf[i:]
                if rest.startswith(self.end):
                    out.append(ArgumentsDelta(index, buf[:i]))
                    self._buf, self._state = buf[i + len(self.end):], _TEXT
                    return True
                if self.end.startswith(rest) and not final:
                    out.append(ArgumentsDelta(index, buf[:i]))
                    self._buf = rest
                    return False
        out.append(ArgumentsDelta(index, buf))
        self._buf = ""
        return False

    def _args_string(self, out: list[ToolDelta], final: bool) -> bool:
        buf = self._buf
        for i in range(self._scanned, len(buf)):
            c = buf[i]
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                try:
                    text = json.loads(buf[:i + 1])
                except ValueError:   # a bad escape: the text as written
                    text = buf[1:i]
                out.append(ArgumentsDelta(self.calls - 1, text))
                self._buf, self._state = buf[i + 1:], _TAIL
                return True
        self._scanned = len(buf)
        if final:   # cut short: the call has no arguments
            self._buf = ""
        return False

    def _tail(self, out: list[ToolDelta], final: bool) -> bool:
        end, start = self._buf.find(self.end), self._buf.find(self.start)
        if end >= 0 and (start < 0 or end < start):
            self._buf, self._state = self._buf[end + len(self.end):], _TEXT
            return True
        if start >= 0:   # a new call without the previous one's closing marker
            self._buf, self._state = self._buf[start:], _HEAD
            return True
        keep = 0 if final else max(_partial_suffix(self._buf, self.end), _partial_suffix(self._buf, self.start))
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _block(self, out: list[ToolDelta], final: bool) -> bool:
        end = self._buf.find(self.end, max(len(self.start), self._scanned - len(self.end) + 1))
        if end < 0:
            self._scanned = len(self._buf)
            if final:
                out.append(ContentDelta(self._buf))
                self._buf = ""
            return False
        block = self._buf[:end + len(self.end)]
        call = _whole_call(block[len(self.start):end])
        if call is None:
            out.append(ContentDelta(block))
        else:
            name, arguments = call
            start = self.begin_call(name)
            out += [start, ArgumentsDelta(start.index, arguments)]
        self._buf, self._state = self._buf[len(block):], _TEXT
        return True


def _whole_call(block: str) -> Optional[tuple[str, str]]:
    """(name, arguments JSON) of a complete block's JSON, or None when it is not a call."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _header_fields(buf: str, i: int) -> tuple[str, int]:
    """Reads `"name": "<name>", "arguments": ` from buf[i:] (after the opening brace): the name
    and the index of the arguments value, which must be an object or a string."""
    i = _literal(buf, _skip_ws(buf, i), '"name"')
    i = _skip_ws(buf, _literal(buf, _skip_ws(buf, i), ":"))
    if buf[i] != '"':
        raise _Mismatch
    j = _string_end(buf, i)
    try:
        name = json.loads(buf[i:j])
    except ValueError:
        raise _Mismatch from None
    i = _skip_ws(buf, _literal(buf, _skip_ws(buf, j), ","))
    need = False
    for key in ('"arguments"', '"parameters"'):
        try:
            i = _literal(buf, i, key)
            break
        except _NeedMore:
            need = True
        except _Mismatch:
            pass
    else:
        raise _NeedMore if need else _Mismatch
    i = _skip_ws(buf, _literal(buf, _skip_ws(buf, i), ":"))
    if buf[i] not in '{"':
        raise _Mismatch
    return name, i


def _skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i] in _WS:
        i += 1
    if i == len(buf):
        raise _NeedMore
    return i


def _literal(buf: str, i: int, text: str) -> int:
    got = buf[i:i + len(text)]
    if got == text:
        return i + len(text)
    if len(got) < len(text) and text.startswith(got):
        raise _NeedMore
    raise _Mismatch


def _string_end(buf: str, i: int) -> int:
    """The index after the JSON string that opens at buf[i]."""
    escaped = False
    for j in range(i + 1, len(buf)):
        c = buf[j]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            return j + 1
    raise _NeedMore


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}
DEFAULT_TOOL_PARSER = "hermes"
