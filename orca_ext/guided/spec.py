"""What a request constrains its output to, as a grammar text, within fixed bounds.

A `GuidedSpec` is built from one of the request forms (a JSON schema, any JSON object, a regular
expression, a list of choices, or a Lark grammar made by the tool-calling code) and turned into
the grammar text llguidance compiles. Every form is client-supplied and hostile: its size, its
nesting depth and its number of choices are bounded here, before anything is compiled, and each
refusal is an InvalidRequestError naming the request field it came from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import InvalidRequestError

# Bounds on one request's constraint, checked before compiling. The compile itself is bounded by
# compiler.PARSER_LIMITS and compiler.DEFAULT_COMPILE_TIMEOUT.
MAX_GRAMMAR_BYTES = 32 * 1024   # the schema / regex / grammar text, UTF-8
MAX_SCHEMA_DEPTH = 32           # nesting of objects and arrays in a JSON schema
MAX_CHOICES = 256               # entries of guided_choice
KINDS = ("json_schema", "regex", "choice", "lark")

# Generated JSON is laid out as Python's json.dumps does it, with no other whitespace: free
# whitespace lets a model pad its output with blanks until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Characters that are syntax in llguidance's (Rust) regex dialect; every one of them may be escaped.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


@dataclass(frozen=True)
class GuidedSpec:
    """One constraint: `kind` (KINDS) and its canonical `text` (the cache key), and `field`, the
    request field it came from (named in errors)."""

    kind: str
    text: str
    field: str

    def grammar(self) -> str:
        """The grammar text for llguidance.LLMatcher (ValueError: not a grammar at all)."""
        import llguidance

        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, overrides=JSON_LAYOUT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        return llguidance.LLMatcher.grammar_from_lark(self.text)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)


def _check_size(text: str, field: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError(f"{field} is {size} bytes; at most {MAX_GRAMMAR_BYTES} are allowed", param=field)


def _depth(value: Any, field: str) -> None:
    """InvalidRequestError when `value` nests deeper than MAX_SCHEMA_DEPTH (iterative: a deep
    value cannot exhaust the stack)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"{field} nests deeper than {MAX_SCHEMA_DEPTH} levels", param=field)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def json_schema_spec(schema: Any, field: str) -> GuidedSpec:
    """A JSON schema given as a parsed object (dict or bool) or as its JSON text."""
    if isinstance(schema, str):
        _check_size(schema, field)
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"{field} is not valid JSON: {exc}", param=field) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{field} must be a JSON schema object, got {type(schema).__name__}",
                                  param=field)
    _depth(schema, field)
    # Key order is kept: it is the order the output's properties are generated in.
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    _check_size(text, field)
    return GuidedSpec("json_schema", text, field)


def json_object_spec(field: str) -> GuidedSpec:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return GuidedSpec("json_schema", '{"type":"object"}', field)


def regex_spec(pattern: Any, field: str) -> GuidedSpec:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError(f"{field} must be a non-empty string", param=field)
    _check_size(pattern, field)
    return GuidedSpec("regex", pattern, field)


def regex_literal(text: str) -> str:
    """`text` as a regular expression matching exactly it."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def choice_spec(choices: Any, field: str) -> GuidedSpec:
    """Exactly one of the given strings."""
    if not isinstance(choices, Sequence) or isinstance(choices, (str, bytes)) or not choices:
        raise InvalidRequestError(f"{field} must be a non-empty list of strings", param=field)
    if len(choices) > MAX_CHOICES:
        raise InvalidRequestError(f"{field} has {len(choices)} entries; at most {MAX_CHOICES} are allowed",
                                  param=field)
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise InvalidRequestError(f"{field}[{i}] must be a non-empty string", param=field)
    text = "(" + "|".join(regex_literal(c) for c in choices) + ")"
    _check_size(text, field)
    return GuidedSpec("choice", text, field)


def lark_spec(grammar: str, field: str) -> GuidedSpec:
    _check_size(grammar, field)
    return GuidedSpec("lark", grammar, field)
