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
"""
from __future__ import annotations

import copy
import logging
import queue
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from .errors import InvalidRequestError

log = logging.getLogger(__name__)

DEFAULT_POOL_SIZE = 2


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
        self.max_chars: Optional[int] = max_tokens * per_token if max_tokens and per_token else None
        self._per_token = per_token

    def encode(self, text: str, *, field: str = "prompt", **kwargs: Any) -> list[int]:
        """Token ids of `text`; InvalidRequestError (param=`field`) for text that is not valid
        Unicode or that is too long to fit. kwargs go to tokenizer.encode (e.g.
        add_special_tokens=False)."""
        check_text(text, field)
        if self.max_chars is not None and len(text) > self.max_chars:
            raise InvalidRequestError(
                f"{field} has {len(text)} characters; at most {self.max_chars} can fit max_model_len "
                f"(no token of this vocabulary is longer than {self._per_token} characters)", param=field)
        with self._borrow() as tok:
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
