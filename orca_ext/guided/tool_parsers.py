"""Tool-call parsers: the model's text -> OpenAI `tool_calls`, whole or while it streams.

A parser knows one model family's tool-call markup. `HermesToolParser` reads the Hermes / Qwen
format, `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` (any number of blocks;
the text outside them is the message content).

Adding a parser: subclass `ToolParser`, set `start` (the marker that opens a call, held back
while streaming until it is complete) and implement `parse_call(block) -> ToolCall | None` for
the text between markers (or override `parse` for markup that is not marker-delimited); then
register it in TOOL_PARSERS under the name the server selects it by.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_dict(self, index: Optional[int] = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCall]


class ToolParser:
    start = ""
    end = ""

    def parse_call(self, block: str) -> Optional[ToolCall]:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        """The content outside the call blocks, and the calls. A block that does not parse stays
        in the content as text (the client sees what the model wrote)."""
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(self.start, pos)
            if start < 0:
                content.append(text[pos:])
                break
            end = text.find(self.end, start + len(self.start))
            if end < 0:
                content.append(text[pos:])
                break
            call = self.parse_call(text[start + len(self.start):end])
            content.append(text[pos:start] if call is not None else text[pos:end + len(self.end)])
            if call is not None:
                calls.append(call)
            pos = end + len(self.end)
        return ParsedOutput("".join(content).strip() if calls else "".join(content), calls)


class HermesToolParser(ToolParser):
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_call(self, block: str) -> Optional[ToolCall]:
        try:
            value = json.loads(block)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):
            return ToolCall(value["name"], args)
        return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}
DEFAULT_TOOL_PARSER = "hermes"


class ToolCallStream:
    """Turns a stream of text deltas into OpenAI chat deltas: {"content": ...} for text outside
    calls, and one {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}
    per call once its block is complete. Text that may be the start of a call is held back, and
    so is whitespace until text follows it (the blank lines between calls are not content)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._buf = ""
        self._blank = ""
        self.calls = 0

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        out: list[dict] = []
        for d in self._feed(delta, final):
            text = d.get("content")
            if text is None:
                out.append(d)
            elif not text.strip():
                self._blank += text
            else:
                out.append({"content": self._blank + text})
                self._blank = ""
        if final and self._blank and not self.calls:
            out.append({"content": self._blank})
        return out

    def _feed(self, delta: str, final: bool) -> list[dict]:
        self._buf += delta
        out: list[dict] = []
        p = self.parser
        while self._buf:
            start = self._buf.find(p.start)
            if start < 0:
                # Everything except a tail that could still grow into the start marker.
                keep = 0 if final else _partial_suffix(self._buf, p.start)
                text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                if text:
                    out.append({"content": text})
                break
            if start > 0:
                out.append({"content": self._buf[:start]})
                self._buf = self._buf[start:]
            end = self._buf.find(p.end, len(p.start))
            if end < 0:
                if final:  # an unfinished call block: the client gets the text
                    out.append({"content": self._buf})
                    self._buf = ""
                break
            block = self._buf[:end + len(p.end)]
            self._buf = self._buf[end + len(p.end):]
            call = p.parse_call(block[len(p.start):-len(p.end)])
            if call is None:
                out.append({"content": block})
            else:
                out.append({"tool_calls": [call.as_dict(self.calls)]})
                self.calls += 1
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
