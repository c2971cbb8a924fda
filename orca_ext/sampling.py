"""The batched sampler; its per-request settings are sampling_params.SamplingParams.

Greedy rows are served by one argmax over the whole batch; only rows with temperature >=
GREEDY_TEMPERATURE take the sampled path. A sampled row draws its randomness from its own request's
torch.Generator, so a seeded request produces the same tokens whatever else shares its batch.

Client-supplied numbers are hostile: SamplingParams validates every field, and the sampler clamps each
value to what its float32/int64 tensors can hold (top_k to the vocabulary, temperature to the
float32 range), so no accepted value can raise inside the batched sampler. Should a row still fail
there, only that row's request fails: the batch is re-run row by row to find it.

Rows that ask for penalties, logit_bias or min_tokens get them first, in one batched pass
(logits_controls.py); every later step reads the controlled logits. Rows that ask for logprobs
get them of the distribution they drew from (logprobs.py), in one more batched pass.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from . import ops
from .guided import masks as guided_masks
# SamplingParams and its limits: orca_ext.sampling is their public import path too.
from .logits_controls import apply_controls
from .logprobs import token_logprobs
from .request import TokenLogprob
from .sampling_params import (GREEDY_TEMPERATURE, MAX_LOGPROBS, MAX_SEED, MAX_STOP_STRING_CHARS,  # noqa: F401
                              MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_SEED, SamplingParams)

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

NON_FINITE_LOGITS = "non-finite logits (NaN or Inf) in the model output"


class SampleResult:
    """Per-row outcome of one sampling call: a token id, or an error message for that row only.
    Both are None for a row that emits no token (a prompt chunk that is not the last).
    `logprobs[i]`: the sampled token's TokenLogprob for a row whose params ask for logprobs
    (None elsewhere; the list is None when no row asks). `prompt_logprobs[i]`: the TokenLogprobs
    of the prompt tokens this row's chunk predicts, for a row that asks for prompt logprobs."""

    __slots__ = ("tokens", "errors", "logprobs", "prompt_logprobs")

    def __init__(self, tokens: list[Optional[int]], errors: list[Optional[str]],
                 logprobs: Optional[list[Optional[TokenLogprob]]] = None,
                 prompt_logprobs: Optional[list[Optional[list[TokenLogprob]]]] = None):
        self.tokens = tokens
        self.errors = errors
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs


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


def draw(probs: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
    """One token per row of probs [S, V] (rows sum to ~1; masked tokens are 0) -> [S] int64, -1
    for a row whose probabilities are not all finite (their sum is then not finite either).

    Inverse-CDF sampling: one uniform u per row, from the row's own generator (None: the global
    RNG), so batch-mates never shift a seeded request's stream, and the token is the first whose
    cumulative probability exceeds u times the row's total. The sums are float64, so every token
    with p > 0 keeps its width p (to float64 rounding) and a masked token has width 0: it is never
    drawn.
    One random number per row, not one per vocabulary entry: with 49,152 entries, per-entry noise
    from a CPU generator took ~1 ms a row."""
    uniforms = torch.empty(len(generators), dtype=torch.float64, device=probs.device)
    for j, gen in enumerate(generators):
        uniforms[j:j + 1].uniform_(generator=gen)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [S, V]
    total = cdf[:, -1]
    # u * total can round up to total itself, which no token exceeds: cap it just below.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)  # first cdf > target
    return torch.where(torch.isfinite(total), picked, torch.full_like(picked, -1))


NUCLEUS_CANDIDATES = 1024  # tokens ranked first for a top_p without top_k


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and nucleus. logits [S, V] float32,
    top_k [S] int64 (0 = off; k >= V keeps everything too), top_p [S] float32 (1 = off) -> [S, V]
    (`logits` itself when no row filters anything; never changed in place).

    Ranking a whole row is a sort: ~3.6 ms for one 49k-entry row on a CPU core. So only the
    largest logits of each row are ranked (topk, ~20x cheaper): a row's top k, and for a top_p
    without top_k its NUCLEUS_CANDIDATES largest, which hold the whole nucleus whenever their
    mass reaches top_p. Only when some row's candidates fall short is the batch sorted whole."""
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    has_k, has_p = k < vocab, top_p < 1.0
    active = has_k | has_p
    if not bool(active.any()):
        return logits
    if not bool(active.all()):  # filter the rows that ask for it, keep the others as they are
        rows = active.nonzero().squeeze(1)
        out = logits.clone()
        out[rows] = _filter_rows(logits[rows], k[rows], top_p[rows], has_k[rows], has_p[rows])
        return out
    return _filter_rows(logits, k, top_p, has_k, has_p)


def _filter_rows(logits, k, top_p, has_k, has_p) -> torch.Tensor:
    """filter_logits for rows that each have a top_k below V (has_k) or a top_p below 1 (has_p)."""
    vocab = logits.shape[-1]
    p_only = has_p & ~has_k  # nucleus over the whole row: the rows that may need it sorted whole
    wanted = max(int(k[has_k].max()) if bool(has_k.any()) else 0,
                 NUCLEUS_CANDIDATES if bool((~has_k).any()) else 0)
    n = min(wanted, vocab)
    lse = logits.logsumexp(dim=-1, keepdim=True) if bool(p_only.any()) else None
    if n < vocab and lse is not None:
        # n candidates hold at most n times the largest probability: when that is short of top_p
        # (a flat row), the candidates cannot hold the nucleus and ranking them is wasted.
        bound = n * (logits.amax(dim=-1, keepdim=True) - lse).exp().squeeze(1)
        if bool((p_only & (bound < top_p)).any()):
            n = vocab
    ranked, order = _rank(logits, n, k)
    share = None if lse is None else (ranked - lse).exp()  # each candidate's share of its whole row
    if n < vocab and share is not None and bool((p_only & (share.sum(dim=-1) < top_p)).any()):
        ranked, order = _rank(logits, vocab, k)  # some nucleus reaches past the candidates
        share = (ranked - lse).exp()
    if bool(has_p.any()):
        # A top-k row's nucleus is taken within its top k (renormalised); a row without top_k
        # weighs each candidate by its share of the whole row.
        if share is None:
            probs = ranked.softmax(dim=-1)
        elif not bool(has_k.any()):
            probs = share
        else:
            probs = torch.where(has_k.unsqueeze(1), ranked.softmax(dim=-1), share)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        threshold = torch.where(has_p, top_p, torch.full_like(top_p, 2.0))
        drop = mass_before >= threshold.unsqueeze(1)
        # Explicitly: a top_p that rounds to 0 in float32 (e.g. 1e-50) would otherwise drop even
        # the first token and leave an all -inf row.
        drop[:, 0] = False
        ranked = ranked.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, ranked)


def _rank(logits, n: int, k) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest logits of each row, largest first, those past the row's k set to -inf; and
    their token ids. [S, n] each."""
    ranked, order = logits.topk(n, dim=-1) if n < logits.shape[-1] else logits.sort(dim=-1, descending=True)
    ranks = torch.arange(n, device=logits.device)
    return ranked.masked_fill(ranks.unsqueeze(0) >= k.unsqueeze(1), float("-inf")), order


class Sampler:
    """Turns the [B, vocab] logits of one iteration into one token per request. It consumes the
    logits: logits controls and guided masks change them in place (a caller that needs them
    afterwards passes a copy)."""

    def __call__(self, logits: torch.Tensor, requests: Sequence) -> SampleResult:
        n = len(requests)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [B={n}, vocab], got {tuple(logits.shape)}")
        logits = logits.float().contiguous()  # controls and masks write it in place, through flat views
        errors: list[Optional[str]] = [None] * n
        if any(req.params.controls_logits for req in requests):
            # Penalties, logit_bias and min_tokens change the logits every later step reads
            # (greedy argmax, sampling, logprobs): a failing row gets -inf logits and its error.
            apply_controls(logits, requests, errors)
        # Guided rows: disallowed tokens -> -inf before anything is drawn (guided/masks.py), after
        # the controls, so that no logit_bias can bring back a token the grammar forbids.
        guided = guided_masks.guided_rows(requests)
        guided_errors = guided_masks.apply_token_masks(logits, guided)
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
        sampled: list[int] = []
        for i, req in enumerate(requests):
            if not req.emits_token:
                # A prompt chunk that is not the last: no token, and no draw from its generator,
                # so a seeded request samples the same stream however its prompt was split.
                # (Parallel workers' rows carry the same flag, SamplingRow.emits_token.)
                tokens[i] = None
            elif errors[i] is not None:
                tokens[i] = None
            elif i in guided_errors:
                tokens[i] = None
                errors[i] = guided_errors[i]
            elif not finite[i]:
                tokens[i] = None
                errors[i] = NON_FINITE_LOGITS
            elif not req.params.greedy:
                sampled.append(i)
        # Rows that report logprobs, and the processed logits each drew from: greedy rows' are
        # the (controlled) logits themselves, sampled rows' are filled in by _sample_rows.
        wanted = [i for i in range(n) if tokens[i] is not None and requests[i].params.logprobs is not None]
        drawn: dict[int, torch.Tensor] = {}
        if sampled:
            try:
                self._sample_rows(logits, best, requests, sampled, tokens, errors, drawn)
            except Exception:
                # Some row's values broke the batched path: redo the rows one at a time so that
                # only the request that causes the failure fails.
                for i in sampled:
                    try:
                        self._sample_rows(logits, best, requests, [i], tokens, errors, drawn)
                    except Exception as exc:
                        tokens[i] = None
                        errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
        for i, err in guided_masks.accept_tokens(guided, tokens).items():
            tokens[i] = None
            errors[i] = err
        wanted = [i for i in wanted if tokens[i] is not None]
        logprobs = self._logprobs(logits, requests, wanted, tokens, errors, drawn) if wanted else None
        return SampleResult(tokens, errors, logprobs)

    @staticmethod
    def _logprobs(logits, requests, wanted, tokens, errors, drawn) -> list[Optional[TokenLogprob]]:
        """TokenLogprobs of the rows in `wanted`, batched; should that fail, row by row, so that
        only a failing row's request fails."""
        out: list[Optional[TokenLogprob]] = [None] * len(requests)

        def fill(rows: list[int]) -> None:
            processed = torch.stack([drawn[i] if i in drawn else logits[i] for i in rows])
            chosen = torch.tensor([tokens[i] for i in rows], device=logits.device)
            k = max(requests[i].params.logprobs for i in rows)
            for i, entry in zip(rows, token_logprobs(processed, chosen, k)):
                keep = requests[i].params.logprobs
                out[i] = entry if keep == k else TokenLogprob(entry.token_id, entry.logprob, entry.top[:keep])

        rows = [i for i in wanted if tokens[i] is not None]
        if not rows:
            return out
        try:
            fill(rows)
        except Exception:
            for i in rows:
                try:
                    fill([i])
                except Exception as exc:
                    tokens[i] = None
                    errors[i] = f"logprobs failed: {type(exc).__name__}: {exc}"
        return out

    def _sample_rows(self, logits, best, requests, rows, tokens, errors, drawn) -> None:
        device = logits.device
        vocab = logits.shape[-1]
        params = [requests[i].params for i in rows]
        index = torch.tensor(rows, device=device)
        # Shift each row so its maximum is exactly 0 before dividing: the scaled logits are then
        # in [-inf, 0] for any temperature, so nothing overflows to +inf and softmax has a 1.
        # (In place on the gathered copy: each fresh [S, V] buffer costs page faults.)
        sub = logits[index]
        sub.sub_(best[index].unsqueeze(1))
        # Clamped to float32's range: a huge temperature would otherwise become inf, and
        # -inf / inf is NaN. (Greedy rows never get here, so the lower end is >= GREEDY_TEMPERATURE.)
        temps = torch.tensor([min(p.temperature, _FLOAT32_MAX) for p in params],
                             device=device, dtype=torch.float32)
        sub.div_(temps.unsqueeze(1))
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            # top_k >= vocab keeps everything: clamping makes any accepted integer fit in int64.
            top_k = torch.tensor([min(p.top_k, vocab) for p in params], device=device, dtype=torch.int64)
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
            sub = filter_logits(sub, top_k, top_p)
        for j, i in enumerate(rows):
            if requests[i].params.logprobs is not None:
                drawn[i] = sub[j]  # the distribution row i draws from, as logits
        probs = sub.softmax(dim=-1)
        # Defence in depth: a row whose probabilities are not all finite would yield an arbitrary
        # token; draw marks it -1 and it fails instead of returning garbage with success.
        picked = draw(probs, [_generator_for(requests[i], device) for i in rows]).tolist()
        for j, i in enumerate(rows):
            if picked[j] >= 0:
                tokens[i] = picked[j]
            else:
                tokens[i] = None
                errors[i] = "sampling produced non-finite probabilities"
