"""Text prompts -> token ids, on the caller's thread and never under the engine's tokenizer lock.

The engine thread detokenizes every generated token through the server's tokenizer, under a lock
(HF fast tokenizers raise "Already borrowed" when encode, which resets truncation and padding
state, runs beside another call). If prompts were encoded under that same lock, one client
sending a megabyte of text would stall every stream for as long as its encoding takes. So
prompts are encoded by a small pool of private copies of the tokenizer instead, each used by one
thread at a time, and a text too long to fit the context is rejected before any encoding.

The length bound: no token of the vocabulary covers more than `longest_token_chars` characters,
so a text of more than `max_model_len * longest_token_chars` characters cannot encode to
`max_model_len` tokens or fewer (unless the tokenizer's normalizer deletes characters, which
the tokenizers we load do not do).

The work bound: a text can still be up to that many characters and yet far more tokens than
fit. Past `max_tokens * DIRECT_CHARS_PER_TOKEN` characters, the text is first counted in pieces of
about `PIECE_CHARS` characters, cut before a space where one is near, and rejected as soon as the
pieces add up to more than fit; only a text that may fit is encoded whole. So a rejected text
costs about as much encoding as the longest text that fits, whatever its length. Cutting a text
changes its token count only next to the cut (the pre-tokenizers split at spaces anyway, and a
piece adds at most its own start and end tokens): each piece is allowed `PIECE_SLACK_TOKENS` more
tokens than it could contribute to the whole, so no text that fits is rejected.
"""
from __future__ import annotations

import copy
import logging
import queue
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Union

from .errors import InvalidRequestError

log = logging.getLogger(__name__)

DEFAULT_POOL_SIZE = 2
PIECE_CHARS = 16_384            # characters per piece of the counting pass
DIRECT_CHARS_PER_TOKEN = 8      # texts up to max_tokens x this many characters skip the counting pass
PIECE_SLACK_TOKENS = 4          # tokens a piece may count on its own beyond its share of the whole
CUT_WINDOW_CHARS = 1_024        # how far back from a piece's end a cut looks for a space

# A text part of a prompt, or a token id placed as is (encode_parts).
Part = Union[str, int]


def longest_token_chars(tokenizer: Any) -> Optional[int]:
    """Characters of the longest token string in the vocabulary (None when the tokenizer does not
    expose its vocabulary). Byte-level vocabularies spell each byte as one character, so this is
    also an upper bound in characters of the text a token can stand for."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:  # an exotic tokenizer: no bound rather than no server
        return None
    return max((len(t) for t in vocab), default=None) or None


def piece_end(text: str, start: int, piece_chars: int = PIECE_CHARS) -> int:
    """Where the piece of `text` that begins at `start` ends: about `piece_chars` on, moved back
    to just before a space (the first of a run) when one lies within CUT_WINDOW_CHARS."""
    end = start + piece_chars
    if end >= len(text):
        return len(text)
    space = text.rfind(" ", max(start + 1, end - CUT_WINDOW_CHARS), end)
    if space <= start:
        return end
    while space - 1 > start and text[space - 1] == " ":
        space -= 1
    return space


def exceeds_tokens(tokenizer: Any, text: str, budget: int, *, piece_chars: int = PIECE_CHARS,
                   **kwargs: Any) -> Optional[int]:
    """None when `text` may encode to `budget` tokens or fewer; otherwise how many characters
    were encoded, piece by piece, before the count proved it cannot (module docstring)."""
    start = counted = pieces = 0
    while start < len(text):
        end = piece_end(text, start, piece_chars)
        counted += len(tokenizer.encode(text[start:end], **kwargs))
        pieces += 1
        if counted - PIECE_SLACK_TOKENS * pieces > budget:
            return end
        start = end
    return None


def check_text(text: str, field: str) -> None:
    """Strings that cannot be encoded as UTF-8 (lone surrogates, e.g. from a JSON "\\ud800"
    escape) are the client's error, not a tokenizer crash; `field` names the request field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{field} is not valid Unicode text: a lone surrogate "
                                  f"{text[exc.start]!r} at character {exc.start}", param=field) from None


class PromptEncoder:
    """Encode texts with a pool of up to `pool_size` private copies of `tokenizer`.

    `max_tokens` (the server's max_model_len) bounds the text length checked before encoding.
    A tokenizer that cannot be copied is used itself, under `fallback_lock` (the lock its other
    user holds), which is safe but gives up the isolation.
    """

    def __init__(self, tokenizer: Any, *, max_tokens: Optional[int] = None,
                 pool_size: int = DEFAULT_POOL_SIZE, fallback_lock: Optional[threading.Lock] = None):
        self._tokenizer = tokenizer
        self._pool_size = max(1, pool_size)
        self._idle: queue.LifoQueue = queue.LifoQueue()
        self._made = 0
        self._make_lock = threading.Lock()
        self._fallback_lock = fallback_lock or threading.Lock()
        self._copyable = True
        per_token = longest_token_chars(tokenizer)
        self._max_tokens = max_tokens or None
        self.max_chars: Optional[int] = max_tokens * per_token if max_tokens and per_token else None
        self._per_token = per_token

    @property
    def max_tokens(self) -> Optional[int]:
        """The most tokens a prompt may have (the server's max_model_len, within its KV cache)."""
        return self._max_tokens

    def check_length(self, text_chars: int, field: str) -> None:
        """InvalidRequestError (param=`field`) when `text_chars` characters cannot fit."""
        if self.max_chars is not None and text_chars > self.max_chars:
            raise InvalidRequestError(
                f"{field} has {text_chars} characters; at most {self.max_chars} can fit max_model_len "
                f"(no token of this vocabulary is longer than {self._per_token} characters)", param=field)

    def encode(self, text: str, *, field: str = "prompt", **kwargs: Any) -> list[int]:
        """Token ids of `text`; InvalidRequestError (param=`field`) for text that is not valid
        Unicode or that is too long to fit. kwargs go to tokenizer.encode (e.g.
        add_special_tokens=False)."""
        return self.encode_parts((text,), field=field, **kwargs)

    def encode_parts(self, parts: Sequence[Part], *, field: str = "prompt", **kwargs: Any) -> list[int]:
        """Token ids of `parts` in order: each text encoded on its own (kwargs go to
        tokenizer.encode), each int placed as that token id. The same checks as encode, on all
        the parts together."""
        chars = 0
        for part in parts:
            if isinstance(part, str):
                check_text(part, field)
                chars += len(part)
        self.check_length(chars, field)
        ids: list[int] = []
        with self._borrow() as tok:
            for part in parts:
                if isinstance(part, str):
                    ids.extend(self._encode_bounded(tok, part, field, len(ids), kwargs))
                else:
                    ids.append(part)
        return ids

    def _encode_bounded(self, tok: Any, text: str, field: str, before: int, kwargs: dict) -> list[int]:
        """tok.encode(text), after a counting pass for a text long enough to exceed what is left
        of the budget once `before` tokens precede it."""
        if self._max_tokens is not None:
            budget = self._max_tokens - before
            if len(text) > max(PIECE_CHARS, budget * DIRECT_CHARS_PER_TOKEN):
                encoded = exceeds_tokens(tok, text, budget, **kwargs)
                if encoded is not None:
                    raise InvalidRequestError(
                        f"{field} encodes to more than {self._max_tokens} tokens, the most that fit "
                        f"max_model_len and the KV cache (counted in its first {encoded} of "
                        f"{len(text)} characters)", param=field)
        return list(tok.encode(text, **kwargs))

    @contextmanager
    def _borrow(self) -> Iterator[Any]:
        try:
            tok = self._idle.get_nowait()
        except queue.Empty:
            tok = self._make()
            if tok is None and self._made:
                tok = self._idle.get()  # the pool is full: wait for a copy to come back
        if tok is None:  # no copy could be made
            with self._fallback_lock:
                yield self._tokenizer
            return
        try:
            yield tok
        finally:
            self._idle.put(tok)

    def _make(self) -> Any:
        """A new private copy while the pool is below its size, else None (the caller waits)."""
        with self._make_lock:
            if self._made >= self._pool_size or not self._copyable:
                return None
            try:
                tok = copy.deepcopy(self._tokenizer)
            except Exception as exc:
                self._copyable = False
                log.warning("the tokenizer cannot be copied (%s: %s); prompts are encoded under the "
                            "detokenizer's lock", type(exc).__name__, exc)
                return None
            self._made += 1
            return tok
