"""Tool calls in chat responses: the model's text -> `tool_calls`, whole and streamed.

Applies when the request has tools and tool_choice is not "none" (ChatCompletionRequest.
parses_tool_calls). The text is parsed by the server's tool parser (guided/tool_parsers.py,
Hermes by default): the calls become the message's `tool_calls`, the rest its content (null
when empty), and a request that ended normally with calls has finish_reason "tool_calls".

Streamed, each choice has its own parser and the deltas take OpenAI's shape: a call opens with
{"index", "id", "type": "function", "function": {"name", "arguments": ""}}, then its arguments
follow as {"index", "function": {"arguments": fragment}} while they are generated. A call cut
short by max_tokens keeps the arguments generated so far (finish_reason "length"), whole or
streamed.
"""
from __future__ import annotations

from typing import Optional

from ..guided.tool_parsers import (DEFAULT_TOOL_PARSER, TOOL_PARSERS, ArgumentsDelta, CallStart, ContentDelta,
                                   ToolDelta, ToolParser)
from .protocol import ChatCompletionRequest


def new_parser() -> ToolParser:
    return TOOL_PARSERS[DEFAULT_TOOL_PARSER]()


def with_tool_calls(body: ChatCompletionRequest, response: dict) -> dict:
    """The chat.completion `response` with each choice's tool calls parsed out of its message."""
    if not body.parses_tool_calls:
        return response
    for choice in response["choices"]:
        parsed = new_parser().parse(choice["message"]["content"] or "")
        if parsed.calls:
            choice["message"]["content"] = parsed.content or None
            choice["message"]["tool_calls"] = [c.as_dict() for c in parsed.calls]
            choice["finish_reason"] = finish_reason(choice["finish_reason"], True)
    return response


def finish_reason(reason: Optional[str], called: bool) -> Optional[str]:
    return "tool_calls" if called and reason == "stop" else reason


class ChatDeltas:
    """One choice's stream: text deltas in, OpenAI chat `delta` objects out."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser

    @property
    def calls(self) -> int:
        return self.parser.calls

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        return [chat_delta(d) for d in self.parser.feed(delta, final)]


def chat_delta(d: ToolDelta) -> dict:
    if isinstance(d, ContentDelta):
        return {"content": d.text}
    if isinstance(d, CallStart):
        return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}}]}
    assert isinstance(d, ArgumentsDelta)
    return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}


def delta_stream(body: ChatCompletionRequest) -> Optional[ChatDeltas]:
    """The streaming parser for one choice of the request (None: content is streamed as it comes)."""
    return ChatDeltas(new_parser()) if body.parses_tool_calls else None
