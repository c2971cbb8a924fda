"""Tool calls in chat responses: the model's text -> `tool_calls`, whole and streamed.

Applies when the request has tools and tool_choice is not "none" (ChatCompletionRequest.
parses_tool_calls). The text is parsed by the server's tool parser (guided/tool_parsers.py,
Hermes by default): the calls become the message's `tool_calls`, the rest its content (null
when empty), and a request that ended normally with calls has finish_reason "tool_calls".
"""
from __future__ import annotations

from typing import Optional

from ..guided.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS, ToolCallStream
from .protocol import ChatCompletionRequest


def with_tool_calls(body: ChatCompletionRequest, response: dict) -> dict:
    """The chat.completion `response` with each choice's tool calls parsed out of its message."""
    if not body.parses_tool_calls:
        return response
    for choice in response["choices"]:
        parsed = TOOL_PARSERS[DEFAULT_TOOL_PARSER]().parse(choice["message"]["content"] or "")
        if parsed.calls:
            choice["message"]["content"] = parsed.content or None
            choice["message"]["tool_calls"] = [c.as_dict() for c in parsed.calls]
            choice["finish_reason"] = finish_reason(choice["finish_reason"], True)
    return response


def finish_reason(reason: Optional[str], called: bool) -> Optional[str]:
    return "tool_calls" if called and reason == "stop" else reason


def delta_stream(body: ChatCompletionRequest) -> Optional[ToolCallStream]:
    """The streaming parser for the request (None: content is streamed as it comes)."""
    return ToolCallStream(TOOL_PARSERS[DEFAULT_TOOL_PARSER]()) if body.parses_tool_calls else None
