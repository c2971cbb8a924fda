"""Chat messages -> prompt token ids, with bounded work and the clients' text kept as text.

Limits, checked before the template renders anything (a rejected chat costs no rendering):
- at most `max_messages` messages: max_model_len divided by the fewest tokens the chat template
  adds for one message (measured once, from the template itself; at least 1);
- at most `max_chars` characters of content in all: max_model_len times the longest token, the
  same bound as a text prompt's (encoding.py).

Message text is text. The template's own markers (`<|im_start|>`, BOS, ...) are control tokens,
but a special-token string inside a message's content is encoded as plain characters, as OpenAI
does: a client cannot open a system turn by writing `<|im_start|>system` in its message. To do so,
the template is rendered a second time with each content replaced by a unique placeholder; the
special tokens found in that skeleton are placed as their ids, and the text between them
(skeleton text and contents) is encoded with `split_special_tokens=True`. For content without
special-token strings this gives exactly the ids of encoding the rendered text, which is checked
once at start-up on a probe conversation. A template that changes content (it trims it, or
renders it depending on what it holds) or a tokenizer that fails that probe encodes the rendered
text instead, and refuses content holding a special-token string with a 400.

Tools (OpenAI's `tools`, and the `tool_calls` / `tool_call_id` of assistant and tool messages) are
passed to the template, which renders them its own way. Their text is rendered into the skeleton,
so a special-token string inside it is refused with a 400 (param "tools" or "messages"), and
their characters count against `max_chars` with the contents'.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
from typing import Any, Optional, Sequence

from .encoding import Part, PromptEncoder, check_text
from .errors import InvalidRequestError
from .models import apply_chat_template

log = logging.getLogger(__name__)

FIELD = "messages"
# A conversation of every role, with spaces, punctuation and newlines at the content's edges.
_PROBE = ({"role": "system", "content": "You answer briefly."},
          {"role": "user", "content": "Hello, world! What is 1 + 1?\n"},
          {"role": "assistant", "content": " Two. "},
          {"role": "user", "content": "And\tnow  "})


def _tool_text(value) -> str:
    """The text of tools or tool calls as a template sees it (for limits and special tokens)."""
    return json.dumps(value, ensure_ascii=False) if value else ""


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special tokens: string -> id (empty when it declares none)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {tok.content: int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    if not specials:
        names = getattr(tokenizer, "all_special_tokens", None) or ()
        ids = getattr(tokenizer, "all_special_ids", None) or ()
        specials = {s: int(i) for s, i in zip(names, ids)}
    return {s: i for s, i in specials.items() if s}


class ChatPromptEncoder:
    """Renders and encodes chat messages ([{"role", "content"}, ...]) for one tokenizer."""

    def __init__(self, tokenizer: Any, encoder: PromptEncoder) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_chars: Optional[int] = encoder.max_chars
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.tokens_per_message = self._fewest_tokens_per_message() if has_template else 1
        limit = encoder.max_tokens
        self.max_messages: Optional[int] = limit // self.tokens_per_message if limit else None
        self._specials = special_token_ids(tokenizer)
        self._special_re = (re.compile("|".join(re.escape(s) for s in sorted(self._specials, key=len, reverse=True)))
                            if self._specials else None)
        self.keeps_text = has_template and self._special_re is not None and self._probe_keeps_text()

    # -- limits ------------------------------------------------------------------------------------
    def check(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> None:
        """InvalidRequestError (param "messages") when the messages cannot fit: too many of them,
        or too many characters (tools and tool calls included). Costs one len() per message and
        one JSON dump of the tools; nothing is rendered."""
        self.check_count(len(messages))
        chars = 0
        for m in messages:
            chars += len(m["content"])
            if m.get("tool_calls"):
                chars += len(_tool_text(m["tool_calls"]))
        if tools:
            chars += len(_tool_text(tools))
        self.encoder.check_length(chars, FIELD)

    def check_count(self, n_messages: int) -> None:
        """InvalidRequestError (param "messages") when n_messages messages cannot fit. The HTTP
        layer calls this while parsing, before any message is validated."""
        if self.max_messages is not None and n_messages > self.max_messages:
            raise InvalidRequestError(
                f"messages has {n_messages} messages; at most {self.max_messages} can fit max_model_len "
                f"= {self.encoder.max_tokens} (the chat template adds at least {self.tokens_per_message} "
                f"tokens per message)", param=FIELD)

    # -- encoding ----------------------------------------------------------------------------------
    def ids(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> list[int]:
        """Token ids of the rendered chat (with the generation prompt); InvalidRequestError
        (param "messages") for messages that cannot fit or that the template rejects."""
        self.check(messages, tools)
        for m in messages:
            check_text(m["content"], FIELD)
        self._check_tool_text(messages, tools)
        rendered = self.render(messages, tools)
        if self._special_re is None:
            return self.encoder.encode(rendered, field=FIELD, add_special_tokens=False)
        parts = self._parts(messages, rendered, tools) if self.keeps_text else None
        if parts is not None:
            return self.encoder.encode_parts(parts, field=FIELD, add_special_tokens=False,
                                             split_special_tokens=True)
        for i, m in enumerate(messages):
            found = self._special_re.search(m["content"])
            if found:
                raise InvalidRequestError(
                    f"messages[{i}].content holds the special token {found.group()!r}, which this "
                    f"model's chat template cannot keep as text", param=FIELD)
        return self.encoder.encode(rendered, field=FIELD, add_special_tokens=False)

    def render(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None) -> str:
        """The template's text; its refusals (bad roles, "roles must alternate") are the client's."""
        try:
            if tools or any(len(m) > 2 for m in messages):  # tools, tool_calls or tool_call_id
                return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                          tokenize=False, add_generation_prompt=True)
            return apply_chat_template(self.tokenizer, messages)
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(f"messages: the chat template rejected them: {exc}", param=FIELD) from exc
        except Exception as exc:
            if type(exc).__module__.startswith("jinja2"):  # jinja2.TemplateError raised by the template
                raise InvalidRequestError(f"messages: the chat template rejected them: {exc}",
                                          param=FIELD) from exc
            raise

    def _check_tool_text(self, messages: Sequence[dict], tools: Optional[Sequence[dict]]) -> None:
        """Tool definitions and tool calls are rendered into the skeleton, where a special-token
        string would become a control token: such text is refused."""
        check_text(_tool_text(tools), "tools")
        for m in messages:
            check_text(_tool_text(m.get("tool_calls")), FIELD)
        if self._special_re is None:
            return
        if tools and (found := self._special_re.search(_tool_text(tools))):
            raise InvalidRequestError(f"tools hold the special token {found.group()!r}", param="tools")
        for i, m in enumerate(messages):
            text = _tool_text(m.get("tool_calls") or ()) + str(m.get("tool_call_id") or "")
            if found := self._special_re.search(text):
                raise InvalidRequestError(f"messages[{i}] holds the special token {found.group()!r} in its "
                                          f"tool calls", param=FIELD)

    def _parts(self, messages: Sequence[dict], rendered: str,
               tools: Optional[Sequence[dict]] = None) -> Optional[list[Part]]:
        """The rendered chat as text parts and the ids of the template's own special tokens, or
        None when the template does not insert every content verbatim, exactly once."""
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        skeleton = self.render([{**m, "content": mark} for m, mark in zip(messages, marks)], tools)
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", skeleton)
        # pieces alternates: skeleton text, content index, skeleton text, ...
        used = [int(k) for k in pieces[1::2]]
        if sorted(used) != list(range(len(messages))):
            return None
        if "".join(p if n % 2 == 0 else messages[int(p)]["content"] for n, p in enumerate(pieces)) != rendered:
            return None
        parts: list[Part] = []
        text: list[str] = []   # the text since the last special token

        def flush() -> None:
            joined = "".join(text)
            if joined:
                parts.append(joined)
            text.clear()

        for n, piece in enumerate(pieces):
            if n % 2:
                text.append(messages[int(piece)]["content"])
                continue
            start = 0
            for found in self._special_re.finditer(piece):
                text.append(piece[start:found.start()])
                flush()
                parts.append(self._specials[found.group()])
                start = found.end()
            text.append(piece[start:])
        flush()
        return parts

    def _probe_keeps_text(self) -> bool:
        """Whether placing the skeleton's special tokens and encoding the text between them gives
        the ids of encoding the rendered text, on a probe conversation."""
        try:
            rendered = apply_chat_template(self.tokenizer, _PROBE)
            parts = self._parts(_PROBE, rendered)
            if parts is None:
                log.warning("the chat template does not insert message contents verbatim; chat content "
                            "holding a special-token string is refused")
                return False
            whole = self.encoder.encode(rendered, field=FIELD, add_special_tokens=False)
            split = self.encoder.encode_parts(parts, field=FIELD, add_special_tokens=False,
                                              split_special_tokens=True)
        except Exception as exc:  # an exotic template or tokenizer: refuse special strings instead
            log.warning("chat content cannot be encoded apart from the template (%s: %s); chat content "
                        "holding a special-token string is refused", type(exc).__name__, exc)
            return False
        if whole != split:
            log.warning("encoding chat content apart from the template changes its tokens; chat content "
                        "holding a special-token string is refused")
        return whole == split

    def _fewest_tokens_per_message(self) -> int:
        """The fewest tokens the template adds per empty message, over the roles (at least 1)."""
        fewest = None
        for roles in (("user",), ("system",), ("assistant",), ("user", "assistant")):
            try:
                counts = [len(self.encoder.encode(
                    apply_chat_template(self.tokenizer, [{"role": r, "content": ""} for r in roles * k],
                                        add_generation_prompt=False),
                    field=FIELD, add_special_tokens=False)) for k in (1, 2)]
            except Exception:  # the template refuses this sequence of roles
                continue
            per = (counts[1] - counts[0]) // len(roles)
            if per >= 1:
                fewest = per if fewest is None else min(fewest, per)
        return fewest or 1
