"""The `logprobs` objects of OpenAI's responses, built from the engine's TokenLogprob entries.

Completions (the legacy shape, which lm-evaluation-harness reads):
    {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
     "text_offset": [int]}
Chat:
    {"content": [{"token": str, "logprob": float, "bytes": [int],
                  "top_logprobs": [{"token": str, "logprob": float, "bytes": [int]}]}]}

A token's text is the tokenizer's decoding of that token alone. JSON has no infinities: a logprob
of -inf (a token that top-k, top-p or a bias ruled out) is reported as LOGPROB_FLOOR, as vLLM does.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Optional, Sequence

from ..request import TokenLogprob

LOGPROB_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class TokenTexts:
    """Text of single tokens, decoded with a private copy of the tokenizer (only the event loop
    calls it, so it never contends with the engine's detokenizer) and cached per token id (the
    cache is bounded by the vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self._cache: dict[int, str] = {}

    def text(self, token_ids: Sequence[int]) -> str:
        """The text of a token sequence (an echoed token-id prompt)."""
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(entries: Sequence[Optional[TokenLogprob]], token_ids: Sequence[int],
                        texts: TokenTexts, text_offset: int = 0) -> dict:
    """Completions' logprobs of `token_ids` (an entry None: a token nothing predicts, the first of
    an echoed prompt). `text_offset`: where the first token's text starts in the choice's text."""
    tokens, values, tops, offsets = [], [], [], []
    offset = text_offset
    for token, entry in zip(token_ids, entries):
        text = texts(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(_finite(entry.logprob))
            tops.append({texts(t): _finite(v) for t, v in entry.top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict:
    """Chat's logprobs object of the generated tokens' entries."""
    def item(token: int, value: float) -> dict:
        text = texts(token)
        return {"token": text, "logprob": _finite(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                        for e in entries]}
