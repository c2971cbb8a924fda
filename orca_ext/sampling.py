"""Sampling parameters (validated at construction) and the batched sampler.

Greedy rows are served by one argmax over the whole batch; only rows with temperature >=
GREEDY_TEMPERATURE take the sampled path. A sampled row draws its randomness from its own request's
torch.Generator, so a seeded request produces the same tokens whatever else shares its batch.

Client-supplied numbers are hostile: every field is validated here, and the sampler clamps each
value to what its float32/int64 tensors can hold (top_k to the vocabulary, temperature to the
float32 range), so no accepted value can raise inside the batched sampler. Should a row still fail
there, only that row's request fails: the batch is re-run row by row to find it.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import ops
from .detokenizer import StopAutomaton, StopMatcher
from .errors import InvalidRequestError

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
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                                      param="max_tokens")
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
        # Normalise to plain immutable values so params can be shared between requests.
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

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below GREEDY_TEMPERATURE (too small to sample from safely)."""
        return self.temperature < GREEDY_TEMPERATURE


def _short(value, limit: int = 60) -> str:
    """repr() of a client value, cut so that an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


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


NON_FINITE_LOGITS = "non-finite logits (NaN or Inf) in the model output"


class SampleResult:
    """Per-row outcome of one sampling call: a token id, or an error message for that row only.
    Both are None for a row that emits no token (a prompt chunk that is not the last)."""

    __slots__ = ("tokens", "errors")

    def __init__(self, tokens: list[Optional[int]], errors: list[Optional[str]]):
        self.tokens = tokens
        self.errors = errors


def _generator_for(request, device: torch.device) -> Optional[torch.Generator]:
    """The request's own generator (created on first use). Unseeded requests share the global RNG."""
    seed = request.params.seed
    if seed is None:
        return None
    gen = request.generator
    if gen is None or gen.device != device:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed % (1 << 64))
        request.generator = gen
    return gen


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and nucleus. logits [S, V] float32,
    top_k [S] int64 (0 = off), top_p [S] float32 (1 = off) -> [S, V]."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks.unsqueeze(0) >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    threshold = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, 2.0))
    drop = mass_before >= threshold.unsqueeze(1)
    # Explicitly: a top_p that rounds to 0 in float32 (e.g. 1e-50) would otherwise drop even the
    # first token and leave an all -inf row.
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Turns the [B, vocab] logits of one iteration into one token per request."""

    def __call__(self, logits: torch.Tensor, requests: Sequence) -> SampleResult:
        n = len(requests)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [B={n}, vocab], got {tuple(logits.shape)}")
        logits = logits.float()
        # One pass over [B, V] gives the greedy tokens and the health check: the max propagates
        # NaN and +inf, so a row whose max is not finite is unusable (an all -inf row is caught
        # too). On the CPU one kernel call does it (ops.row_argmax says why).
        greedy_tok, best = ops.row_argmax(logits)
        if logits.is_cpu:
            tokens: list[Optional[int]] = greedy_tok.tolist()
            maxima = best.tolist()
        else:  # one device->host transfer for both (token ids are exact in float64)
            ids, maxima = torch.stack([greedy_tok.double(), best.double()]).tolist()
            tokens = [int(t) for t in ids]
        finite = [math.isfinite(m) for m in maxima]
        errors: list[Optional[str]] = [None] * n
        sampled: list[int] = []
        for i, req in enumerate(requests):
            if not getattr(req, "emits_token", True):
                # A prompt chunk that is not the last: no token, and no draw from its generator,
                # so a seeded request samples the same stream however its prompt was split.
                # (Parallel workers' rows carry the same flag, SamplingRow.emits_token.)
                tokens[i] = None
            elif not finite[i]:
                tokens[i] = None
                errors[i] = NON_FINITE_LOGITS
            elif not req.params.greedy:
                sampled.append(i)
        if sampled:
            try:
                self._sample_rows(logits, best, requests, sampled, tokens, errors)
            except Exception:
                # Some row's values broke the batched path: redo the rows one at a time so that
                # only the request that causes the failure fails.
                for i in sampled:
                    try:
                        self._sample_rows(logits, best, requests, [i], tokens, errors)
                    except Exception as exc:
                        tokens[i] = None
                        errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
        return SampleResult(tokens, errors)

    def _sample_rows(self, logits, best, requests, rows, tokens, errors) -> None:
        device = logits.device
        vocab = logits.shape[-1]
        params = [requests[i].params for i in rows]
        index = torch.tensor(rows, device=device)
        # Shift each row so its maximum is exactly 0 before dividing: the scaled logits are then
        # in [-inf, 0] for any temperature, so nothing overflows to +inf and softmax has a 1.
        sub = logits[index] - best[index].unsqueeze(1)
        # Clamped to float32's range: a huge temperature would otherwise become inf, and
        # -inf / inf is NaN. (Greedy rows never get here, so the lower end is >= GREEDY_TEMPERATURE.)
        temps = torch.tensor([min(p.temperature, _FLOAT32_MAX) for p in params],
                             device=device, dtype=torch.float32)
        sub = sub / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            # top_k >= vocab keeps everything: clamping makes any accepted integer fit in int64.
            top_k = torch.tensor([min(p.top_k, vocab) for p in params], device=device, dtype=torch.int64)
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
            sub = filter_logits(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p. Each row's noise
        # comes from its own generator, so batch-mates never shift a seeded request's stream.
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            noise[j].exponential_(generator=_generator_for(requests[i], device))
        # A zero draw would turn a masked (p = 0) token into 0/0 = NaN, which argmax would pick.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        picked = (probs / noise).argmax(dim=-1)
        # Defence in depth: a row whose probabilities are not all finite would yield an arbitrary
        # token; it fails instead of returning garbage with success.
        healthy = torch.isfinite(probs).all(dim=-1)
        packed = torch.stack([picked, healthy.long()]).tolist()
        for j, i in enumerate(rows):
            if packed[1][j]:
                tokens[i] = packed[0][j]
            else:
                tokens[i] = None
                errors[i] = "sampling produced non-finite probabilities"
