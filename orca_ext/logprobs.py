"""Log probabilities of tokens: of generated tokens (the sampler passes the processed logits
each row drew from) and of prompt tokens (the model's raw logits of a prompt chunk's rows).

A forward pass returns logits only for the rows a request asks for (ForwardBatch.logit_rows): its
last token's, or every token of a prompt chunk when it asks for prompt logprobs. `split_logits`
separates those rows into the one row per request the sampler reads and the prompt rows, whose
logprobs are computed here in pieces of PROMPT_ROWS_PER_PASS rows so that a long prompt never
needs more than one piece's [rows, vocab] float32 copy at a time.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .request import TokenLogprob

PROMPT_ROWS_PER_PASS = 256


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprob]:
    """logits [S, V] (any shift), chosen [S] int64 -> one TokenLogprob per row: log_softmax at the
    chosen token, and the k most likely tokens."""
    lp = logits.float().log_softmax(dim=-1)
    picked = lp.gather(1, chosen.view(-1, 1)).squeeze(1)
    k = min(k, lp.shape[-1])
    if k > 0:
        top_v, top_i = lp.topk(k, dim=-1)
        values, ids = torch.cat([picked.view(-1, 1), top_v], dim=1).tolist(), top_i.tolist()
    else:
        values, ids = picked.view(-1, 1).tolist(), [[] for _ in range(lp.shape[0])]
    chosen_ids = chosen.tolist()
    return [TokenLogprob(int(t), v[0], tuple(zip(i, v[1:]))) for t, v, i in zip(chosen_ids, values, ids)]


def split_logits(logits: torch.Tensor, logit_rows: Optional[Sequence[int]], requests: Sequence,
                 inputs: Sequence[tuple]) -> tuple[torch.Tensor, Optional[list[Optional[list[TokenLogprob]]]]]:
    """logits [R, V] as returned for ForwardBatch.logit_rows -> (the [B, V] rows the sampler reads,
    each request's last; the prompt TokenLogprobs of each request that asked, else None).

    Row j of a request whose chunk starts at position s predicts token s + j + 1: a prompt token
    while that is inside the prompt (the last row of the prompt's final chunk predicts the first
    generated token, which the sampler draws)."""
    if logit_rows is None:
        return logits, None
    ends = torch.tensor(logit_rows, device=logits.device).cumsum(0) - 1
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[int, int, int]] = []   # (request index, first entry in rows, count)
    offset = 0
    for i, (count, req, (new_ids, start, _)) in enumerate(zip(logit_rows, requests, inputs)):
        if req.params.prompt_logprobs is not None:
            prompt = req.prompt_token_ids
            first = start + len(new_ids) - count   # position of this request's first logits row
            n = min(count, len(prompt) - 1 - first)   # <= 0 once it decodes
        else:
            n = 0
        if n > 0:
            owners.append((i, len(rows), n))
            rows.extend(range(offset, offset + n))
            targets.extend(prompt[first + 1:first + 1 + n])
        offset += count
    result: list[Optional[list[TokenLogprob]]] = [None] * len(requests)
    if not owners:
        return logits[ends], result
    k = max(requests[i].params.prompt_logprobs for i, _, _ in owners)
    entries: list[TokenLogprob] = []
    for lo in range(0, len(rows), PROMPT_ROWS_PER_PASS):
        index = torch.tensor(rows[lo:lo + PROMPT_ROWS_PER_PASS], device=logits.device)
        chosen = torch.tensor(targets[lo:lo + PROMPT_ROWS_PER_PASS], device=logits.device)
        entries.extend(token_logprobs(logits[index], chosen, k))
    for i, first, n in owners:
        keep = requests[i].params.prompt_logprobs
        part = entries[first:first + n]
        result[i] = part if keep == k else [TokenLogprob(e.token_id, e.logprob, e.top[:keep]) for e in part]
    return logits[ends], result
