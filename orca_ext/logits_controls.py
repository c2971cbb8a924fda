"""Penalties, logit_bias and min_tokens: per-request changes to the logits, batched.

Applied to the raw logits of the rows whose params ask for any of them, in this order:
    logit_bias            logits[t] += bias[t]
    repetition_penalty    for every token t of the prompt or the output so far: logits[t] / r
                          if logits[t] > 0, else logits[t] * r (r > 1 discourages repeats)
    frequency_penalty     logits[t] -= f * (times t occurs in the output so far)
    presence_penalty      logits[t] -= p * (1 if t occurs in the output so far)
    min_tokens            stop tokens (EOS unless ignore_eos, stop_token_ids) -> -inf while
                          fewer than min_tokens tokens were generated
Temperature, top-k and top-p then work on the result, and reported logprobs are of it. Each
control is one or two tensor ops over all the controlled rows; the per-row work in Python is only
flattening each row's token lists into one index list. A row whose controls fail is given -inf
logits and an error, so only its request fails.
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch


def apply_controls(logits: torch.Tensor, requests: Sequence, errors: list[Optional[str]]) -> torch.Tensor:
    """logits [B, V] float32 -> a copy with each controlled row's controls applied. `errors[i]`
    is set for a row whose controls failed."""
    rows = [i for i, r in enumerate(requests) if r.params.controls_logits and getattr(r, "emits_token", True)]
    if not rows:
        return logits
    out = logits.clone()
    try:
        index = torch.tensor(rows, device=logits.device)
        out[index] = controlled(logits[index], [requests[i] for i in rows])
    except Exception:
        for i in rows:  # find the failing row: only its request fails
            try:
                out[i:i + 1] = controlled(logits[i:i + 1], [requests[i]])
            except Exception as exc:
                out[i] = float("-inf")
                errors[i] = f"logits controls failed: {type(exc).__name__}: {exc}"
    return out


def _flat(lists: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) int64 tensors of the entries of `lists`, list i giving row i."""
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(lists)), lengths)
    return rows.to(device), ids.to(device)


def controlled(x: torch.Tensor, requests: Sequence) -> torch.Tensor:
    """x [S, V] float32, one row per request -> [S, V] with every request's controls applied."""
    x = x.clone()
    device = x.device
    params = [r.params for r in requests]
    if any(p.logit_bias for p in params):
        rows, ids = _flat([[t for t, _ in p.logit_bias] for p in params], device)
        values = torch.tensor([v for p in params for _, v in p.logit_bias], dtype=x.dtype, device=device)
        x.index_put_((rows, ids), values, accumulate=True)
    if any(p.repetition_penalty != 1.0 for p in params):
        rows, ids = _flat([r.prompt_token_ids + r.output_token_ids if r.params.repetition_penalty != 1.0 else ()
                           for r in requests], device)
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[rows, ids] = True
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=device).unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        rows, ids = _flat([r.output_token_ids if r.params.frequency_penalty or r.params.presence_penalty else ()
                           for r in requests], device)
        counts = torch.zeros_like(x)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=x.dtype), accumulate=True)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=device).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=device).unsqueeze(1)
        x = x - freq * counts - pres * (counts > 0).to(x.dtype)
    early = [sorted(r.stop_token_ids) if len(r.output_token_ids) < r.params.min_tokens else ()
             for r in requests]
    if any(early):
        rows, ids = _flat(early, device)
        x[rows, ids] = float("-inf")
    return x
