"""Tool calling's constraints: `tool_choice` "required" or a named function as a grammar.

The grammar makes the output exactly what the tool-call parser reads (tool_parsers.py's Hermes
format): one or more `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, each
call's JSON an object whose name is one of the allowed tools and whose arguments follow that
tool's parameter schema. So a forced call is always valid JSON naming a real tool, whatever the
model.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from ..errors import InvalidRequestError
from .spec import GuidedSpec, _depth, lark_spec

MAX_TOOLS = 128
FIELD = "tools"
_ANY_OBJECT = {"type": "object"}


def _call_schema(function: dict) -> dict:
    params = function.get("parameters")
    return {"type": "object",
            "properties": {"name": {"const": function["name"]},
                           "arguments": params if params is not None else _ANY_OBJECT},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_spec(tools: Sequence[dict], choice: Any, parallel: bool = True) -> Optional[GuidedSpec]:
    """The constraint for `choice` over `tools` ([{"type": "function", "function": {...}}]):
    None for "auto" and "none" (free text, parsed afterwards), a grammar for "required" (any of
    the tools) and for {"type": "function", "function": {"name": ...}} (that one tool).
    With `parallel`, one or more calls; else exactly one."""
    if choice in (None, "auto", "none"):
        return None
    functions = [t["function"] for t in tools]
    if choice == "required":
        chosen = functions
        field = "tool_choice"
    else:
        name = choice["function"]["name"]
        chosen = [f for f in functions if f["name"] == name]
        field = "tool_choice"
        if not chosen:
            raise InvalidRequestError(f"tool_choice names the function {name[:64]!r}, which is not in tools",
                                      param=field)
    schemas = [_call_schema(f) for f in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    _depth(schema, FIELD)
    body = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    # The JSON layout of the call is spec.JSON_LAYOUT's, set with llguidance's x-guidance options.
    layout = '{"x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},'
    body = layout + body[1:]
    call = '"<tool_call>\\n" call_json "\\n</tool_call>"'
    lark = (f"start: {call}" + (' ("\\n" ' + call + ")*" if parallel else "") + "\n"
            f"call_json: %json {body}\n")
    return lark_spec(lark, field)


def check_tools(tools: Sequence[dict]) -> None:
    """Bounds on the tool list: its length and the nesting of each parameter schema."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed", param=FIELD)
    names = set()
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        if name in names:
            raise InvalidRequestError(f"tools[{i}]: the function name {name!r} is used twice", param=FIELD)
        names.add(name)
        if t["function"].get("parameters") is not None:
            _depth(t["function"]["parameters"], FIELD)
