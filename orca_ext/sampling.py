"""Sampling parameters (validated at construction) and the batched sampler.

Greedy rows are served by one argmax over the whole batch; only rows with temperature > 0 take the
sampled path. A sampled row draws its randomness from its own request's torch.Generator, so a seeded
request produces the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .errors import InvalidRequestError


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings. Invalid values raise InvalidRequestError at construction."""

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
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        try:
            stop = tuple(stop)
        except TypeError:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop[{i}] must be a non-empty string, got {s!r}")
        stop_ids = self.stop_token_ids if self.stop_token_ids is not None else ()
        try:
            stop_ids = tuple(stop_ids)
        except TypeError:
            raise InvalidRequestError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}") from None
        for i, t in enumerate(stop_ids):
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(f"stop_token_ids[{i}] must be an integer >= 0, got {t!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        # Normalise to plain immutable values so params can be shared between requests.
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Turns the [B, vocab] logits of one iteration into one token per request."""

    def __call__(self, logits: torch.Tensor, requests: Sequence) -> SampleResult:
        n = len(requests)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [B={n}, vocab], got {tuple(logits.shape)}")
        logits = logits.float()
        # One pass over [B, V] gives the greedy tokens and the health check: max propagates NaN
        # and +inf, so a row whose max is not finite is unusable (an all -inf row is caught too).
        # One device->host transfer returns both.
        best, greedy_tok = logits.max(dim=-1)
        packed = torch.stack([greedy_tok, torch.isfinite(best).long()]).tolist()
        tokens: list[Optional[int]] = list(packed[0])
        errors: list[Optional[str]] = [None] * n
        sampled: list[int] = []
        for i, req in enumerate(requests):
            if not req.emits_token:
                # A prompt chunk that is not the last: no token, and no draw from its generator,
                # so a seeded request samples the same stream however its prompt was split.
                tokens[i] = None
            elif not packed[1][i]:
                tokens[i] = None
                errors[i] = "non-finite logits (NaN or Inf) in the model output"
            elif not req.params.greedy:
                sampled.append(i)
        if sampled:
            self._sample_rows(logits, requests, sampled, tokens)
        return SampleResult(tokens, errors)

    def _sample_rows(self, logits, requests, rows, tokens) -> None:
        device = logits.device
        params = [requests[i].params for i in rows]
        sub = logits[torch.tensor(rows, device=device)]
        temps = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
        sub = sub / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device, dtype=torch.int64)
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
        picked = (probs / noise).argmax(dim=-1).tolist()
        for j, i in enumerate(rows):
            tokens[i] = picked[j]
