"""Incremental detokenization and stop-string matching.

Byte-level tokenizers can split one UTF-8 character over several tokens; decoding a prefix then
ends in U+FFFD. The detokenizer holds such text back until the character is complete, so a
streamed text only ever grows and never shows half a character. It decodes a short window
(a few already-emitted tokens plus the new ones) rather than the whole sequence, and seeds that
window with the tail of the prompt so a first token's leading space survives SentencePiece-style
decoding.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feed generated token ids one by one; `text` is the resolved text so far (append-only)."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, context_tokens: int = 5):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids)[-context_tokens:] if context_tokens > 0 else []
        self._ids: list[int] = context
        self._prefix = 0              # window start: tokens before it are fully emitted
        self._read = len(context)     # tokens before it have been emitted as text
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly resolved text ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: emit whatever is still held back, even an incomplete character."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: Sequence[str], search_from: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string that ends after `search_from`; (index, stop) or None."""
    best = None
    for s in stops:
        idx = text.find(s, max(0, search_from - len(s) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    A streamed snapshot withholds that suffix: if the stop string completes later it must not
    appear in the output, and published text must never shrink.
    """
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
