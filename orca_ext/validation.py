"""From user input to a request the engine can run, or an InvalidRequestError whose message names
the field and the limit and whose `param` names the field. Nothing here touches the engine, so a
rejected request costs no engine work, and text prompts are encoded by `encoding.PromptEncoder`
on the caller's thread, never with the tokenizer the engine thread detokenizes with.
"""
from __future__ import annotations

import numbers
import threading
from typing import Any, Optional, Sequence, Union

import torch

from .encoding import PromptEncoder
from .errors import InvalidRequestError
from .sampling import SamplingParams

Prompt = Union[str, Sequence[int]]


def text_prompt_ids(encoder: PromptEncoder, text: str) -> list[int]:
    """Token ids of a text prompt: not empty, valid Unicode, short enough to fit (encoding.py)."""
    if not text:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    ids = encoder.encode(text)
    if not ids:
        raise InvalidRequestError("prompt must not be empty (it encodes to no tokens)", param="prompt")
    return ids


def token_id(value: Any, index: int) -> int:
    """One entry of a token-id prompt as an int: a Python, numpy or 0-d torch integer (bools and
    everything else are refused)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy integers
        return int(value)
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return int(value.item())
    shape = f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else ""
    text = repr(value)
    text = text if len(text) <= 60 else text[:60] + "..."
    raise InvalidRequestError(f"prompt[{index}] must be an integer token id (the prompt must be a flat list "
                              f"of ids), got {type(value).__name__}{shape} {text}", param="prompt")


class LockedTokenizer:
    """Serialises the detokenizer's calls: HF fast tokenizers may raise 'Already borrowed' when
    encode (which resets truncation/padding state) runs concurrently with another call. Only the
    engine thread decodes through it; prompts are encoded with a PromptEncoder's private copies,
    so no prompt, however long, ever holds this lock."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lock = threading.Lock()

    def decode(self, ids, **kwargs) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, **kwargs)


class RequestValidator:
    """Checks prompts and sampling parameters against one server's limits."""

    def __init__(self, encoder: Optional[PromptEncoder], vocab_size: int, max_model_len: int,
                 n_slots: int) -> None:
        self.encoder = encoder
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.n_slots = n_slots

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a text or token-id prompt; InvalidRequestError names what is wrong."""
        if isinstance(prompt, str):
            if self.encoder is None:
                if not prompt:
                    raise InvalidRequestError("prompt must not be empty", param="prompt")
                raise InvalidRequestError("prompt: a text prompt needs a tokenizer; pass token ids",
                                          param="prompt")
            # Checks its length and Unicode first, then encodes with a private tokenizer copy.
            return text_prompt_ids(self.encoder, prompt)
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            # Iterating bytes gives ints, which would silently pass as token ids.
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got "
                                      f"{type(prompt).__name__}; decode it to a str first", param="prompt")
        if isinstance(prompt, torch.Tensor) and prompt.ndim != 1:
            raise InvalidRequestError(f"prompt must be a 1-D sequence of token ids, got a tensor of shape "
                                      f"{list(prompt.shape)}", param="prompt")
        try:
            ids = list(prompt)
        except TypeError:
            raise InvalidRequestError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                param="prompt") from None
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if len(ids) > self.max_model_len:  # before looking at each id
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; max_model_len = {self.max_model_len}",
                                      param="prompt")
        for i, t in enumerate(ids):
            t = ids[i] = token_id(t, i)
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        return ids

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The request fits the context limit, the KV cache and the vocabulary. A request over a
        length limit is reported against max_tokens: that is the part of the length a client can
        lower without changing its prompt."""
        n = len(prompt_ids) + params.max_tokens
        if n > self.max_model_len:
            raise InvalidRequestError(
                f"len(prompt) + max_tokens = {len(prompt_ids)} + {params.max_tokens} = {n} exceeds "
                f"max_model_len = {self.max_model_len}", param="max_tokens")
        if n > self.n_slots:
            raise InvalidRequestError(
                f"len(prompt) + max_tokens = {len(prompt_ids)} + {params.max_tokens} = {n} exceeds "
                f"n_slots = {self.n_slots} (the KV cache capacity)", param="max_tokens")
        for i, t in enumerate(params.stop_token_ids):
            if t >= self.vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})",
                    param="stop_token_ids")
        for t, _ in params.logit_bias:
            if t >= self.vocab_size:
                raise InvalidRequestError(f"logit_bias key {t} is outside the vocabulary [0, {self.vocab_size})",
                                          param="logit_bias")
        if params.stop and self.encoder is None:
            raise InvalidRequestError("stop: stop strings need a tokenizer, and this model has none",
                                      param="stop")
