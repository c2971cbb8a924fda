"""SamplingParams: one request's generation settings, validated at construction.

Client-supplied numbers are hostile: every field is checked here, with an InvalidRequestError
whose `param` names the field and whose message names the limit, and normalised to plain
immutable values, so that params can be shared between requests. The batched sampler
(sampling.py) then clamps each value to what its tensors hold.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from .detokenizer import StopAutomaton, StopMatcher
from .errors import InvalidRequestError
from .guided.matcher import CompiledGrammar

# Temperatures below this are greedy. Dividing logits by a temperature near float32's smallest
# normal (~1e-38) overflows to inf/NaN; long before that, at 1e-5, a sampled draw is already an
# argmax for any logit gap a model produces, so the cut-off changes no meaningful distribution.
GREEDY_TEMPERATURE = 1e-5
# Stop-string limits (OpenAI allows 4 stop sequences). The per-token stop check is linear in the
# new text (detokenizer.StopMatcher), but building the matcher and holding text back still scale
# with these, so they are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
# Seeds: any int64 or uint64 value (numpy and torch integer scalars are converted to int); the
# request's generator is seeded with the seed modulo 2**64.
MIN_SEED = -(1 << 63)
MAX_SEED = (1 << 64) - 1
# Log probabilities: the most alternatives per token (OpenAI's chat limit; completions allow 5,
# checked by the HTTP layer). Each costs a top-k over the vocabulary and a few bytes per token.
MAX_LOGPROBS = 20
# Penalties: OpenAI's range for presence/frequency; repetition (a divisor of positive logits and
# a factor of negative ones) within a range whose extremes keep float32 logits finite.
MAX_ABS_PENALTY = 2.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# logit_bias: OpenAI's value range; the entry count bounds the per-row scatter and the request size.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ABS_LOGIT_BIAS = 100.0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings. Invalid values raise InvalidRequestError at construction,
    with `param` naming the field (an entry of stop or stop_token_ids is reported as that list)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0              # 0 = no top-k filtering
    top_p: float = 1.0          # 1.0 = no nucleus filtering
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    # Log probabilities (None: off). logprobs: of each generated token, with that many most likely
    # alternatives; prompt_logprobs: of each prompt token (the first has none), likewise.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    # Logits controls (0 / 1.0 / empty: off), applied before temperature, top-k and top-p.
    presence_penalty: float = 0.0      # subtracted once from every token generated so far
    frequency_penalty: float = 0.0     # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0    # divides (>0) or multiplies (<0) the logits of prompt and generated tokens
    logit_bias: Mapping[int, float] = ()   # token id -> added to its logit
    min_tokens: int = 0                # stop tokens (EOS, stop_token_ids) are masked before this many tokens
    # The grammar the output must follow (orca_ext.guided; compile it with GrammarCompiler).
    guided: Optional["CompiledGrammar"] = None

    def __post_init__(self) -> None:
        prompt_logprobs = _check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        # max_tokens 0 scores a prompt without generating (completions' echo with logprobs).
        low = 0 if prompt_logprobs is not None else 1
        if not _is_int(self.max_tokens) or self.max_tokens < low:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1 (0 only with prompt_logprobs), "
                                      f"got {self.max_tokens!r}", param="max_tokens")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}", param="temperature")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}",
                                      param="top_k")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        seed = _check_seed(self.seed)
        stop = _check_stop(self.stop)
        stop_ids = self.stop_token_ids if self.stop_token_ids is not None else ()
        if isinstance(stop_ids, (str, bytes)):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {_short(stop_ids)}",
                                      param="stop_token_ids")
        try:
            stop_ids = tuple(stop_ids)
        except TypeError:
            raise InvalidRequestError(
                f"stop_token_ids must be a list of integers, got {_short(self.stop_token_ids)}",
                param="stop_token_ids") from None
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids has {len(stop_ids)} entries; at most {MAX_STOP_TOKEN_IDS} are allowed",
                param="stop_token_ids")
        for i, t in enumerate(stop_ids):
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(f"stop_token_ids[{i}] must be an integer >= 0, got {t!r}",
                                          param="stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}", param="ignore_eos")
        logprobs = _check_logprobs(self.logprobs, "logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise InvalidRequestError(f"{name} must be a number in [-{MAX_ABS_PENALTY:g}, "
                                          f"{MAX_ABS_PENALTY:g}], got {_short(value)}", param=name)
            object.__setattr__(self, name, float(value))
        if not _is_real(self.repetition_penalty) \
                or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY:g}, "
                                      f"{MAX_REPETITION_PENALTY:g}] (1 disables it), got "
                                      f"{_short(self.repetition_penalty)}", param="repetition_penalty")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be an integer >= 0, got {_short(self.min_tokens)}",
                                      param="min_tokens")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                      f"({self.max_tokens})", param="min_tokens")
        logit_bias = _check_logit_bias(self.logit_bias)
        if self.guided is not None and not isinstance(self.guided, CompiledGrammar):
            raise InvalidRequestError(f"guided must be a CompiledGrammar or None, got {type(self.guided).__name__}",
                                      param="guided")
        # Normalise to plain immutable values so params can be shared between requests.
        object.__setattr__(self, "logprobs", logprobs)
        object.__setattr__(self, "prompt_logprobs", prompt_logprobs)
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        object.__setattr__(self, "min_tokens", int(self.min_tokens))
        object.__setattr__(self, "logit_bias", logit_bias)
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        # Compiled once here, on the caller's thread, and shared by every request using these
        # params (not a dataclass field: it takes no part in equality or repr).
        object.__setattr__(self, "_stop_automaton", StopAutomaton(stop) if stop else None)

    def stop_matcher(self) -> Optional[StopMatcher]:
        """A fresh streaming matcher of the stop strings (None without stop strings)."""
        return StopMatcher(self._stop_automaton) if self._stop_automaton is not None else None

    def for_sequence(self, index: int) -> "SamplingParams":
        """The params of sequence `index` of a request with n > 1 sequences: the same, except the
        seed, which is seed + index (mod 2**64, the generator's seed), so that sequence i of a
        seeded request is reproducible alone, and sequence 0 is the single-sequence request."""
        if self.seed is None or index == 0:
            return self
        return dataclasses.replace(self, seed=(self.seed + index) % (1 << 64))

    @property
    def controls_logits(self) -> bool:
        """Whether any penalty, logit_bias or min_tokens changes this request's logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below GREEDY_TEMPERATURE (too small to sample from safely)."""
        return self.temperature < GREEDY_TEMPERATURE


def _short(value, limit: int = 60) -> str:
    """repr() of a client value, cut so that an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _check_logprobs(value, name: str) -> Optional[int]:
    """None, or a number of alternatives in [0, MAX_LOGPROBS]."""
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {_short(value)}",
                                  param=name)
    return int(value)


def _check_logit_bias(bias) -> tuple:
    """The bias as a tuple of (token id, value) pairs sorted by id, within MAX_LOGIT_BIAS_ENTRIES
    entries of ids >= 0 (the server checks them against its vocabulary) and values in
    [-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS]."""
    if bias is None:
        return ()
    try:
        items = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    except TypeError:
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {_short(bias)}",
                                  param="logit_bias") from None
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias has {len(items)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} "
                                  f"are allowed", param="logit_bias")
    out = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {_short(bias)}",
                                      param="logit_bias")
        tok, value = item
        if not _is_int(tok) or tok < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {_short(tok)}",
                                      param="logit_bias")
        if not _is_real(value) or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias[{int(tok)}] must be a number in [-{MAX_ABS_LOGIT_BIAS:g}, "
                                      f"{MAX_ABS_LOGIT_BIAS:g}], got {_short(value)}", param="logit_bias")
        out[int(tok)] = float(value)
    return tuple(sorted(out.items()))


def _check_seed(seed) -> Optional[int]:
    """The seed as a Python int in [MIN_SEED, MAX_SEED], or None."""
    if seed is None:
        return None
    if isinstance(seed, bool) or (isinstance(seed, torch.Tensor) and seed.dtype == torch.bool):
        raise InvalidRequestError(f"seed must be an integer or None, got {seed!r}", param="seed")
    try:
        value = operator.index(seed)  # int, numpy integer scalars, one-element integer tensors
    except (TypeError, ValueError, RuntimeError):
        raise InvalidRequestError(f"seed must be an integer or None, got {_short(seed)}", param="seed") from None
    if isinstance(seed, torch.Tensor) and seed.ndim != 0:
        raise InvalidRequestError(f"seed must be an integer or None, got a tensor of shape {list(seed.shape)}",
                                  param="seed")
    if not MIN_SEED <= value <= MAX_SEED:
        raise InvalidRequestError(f"seed must be in [-2**63, 2**64 - 1] (int64 or uint64), got {value}",
                                  param="seed")
    return value


def _check_stop(stop) -> tuple:
    """The stop strings as a tuple, within MAX_STOP_STRINGS x MAX_STOP_STRING_CHARS."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (bytes, bytearray, memoryview)):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {type(stop).__name__}",
                                  param="stop")
    try:
        stop = tuple(stop)
    except TypeError:
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {_short(stop)}",
                                  param="stop") from None
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                                  param="stop")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise InvalidRequestError(f"stop[{i}] must be a non-empty string, got {_short(s)}", param="stop")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"stop[{i}] has {len(s)} characters; at most "
                                      f"{MAX_STOP_STRING_CHARS} are allowed", param="stop")
        if not _is_utf8(s):
            raise InvalidRequestError(f"stop[{i}] is not valid Unicode text (it holds a lone surrogate)",
                                      param="stop")
    return stop


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
