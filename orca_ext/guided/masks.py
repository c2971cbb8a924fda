"""The batched side of guided decoding: one bitmask per guided row, applied to the logits at once.

`apply_token_masks(logits [B, V], rows)` writes each guided row's allowed tokens into one int32
bitmask [R, ceil(V_tok / 32)] (llguidance computes each row's mask in native code), unpacks it
to a [R, V] additive bias (0 or -inf) and adds it to those rows of the logits in place, with one
index_add_. Ids the tokenizer does not have (a model vocabulary padded past the
tokenizer's) are never allowed. `accept_tokens` then advances each row's matcher past the token
sampled for it. A row whose grammar fails fails only its own request: both functions return an
error per row and leave the others untouched.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .matcher import GuidedMatcher

_BITS = torch.arange(32, dtype=torch.int32)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def guided_rows(requests: Sequence) -> list[tuple[int, GuidedMatcher]]:
    """(row index, matcher) of the rows that sample a token under a grammar."""
    return [(i, r.guided) for i, r in enumerate(requests) if r.guided is not None and r.emits_token]


def apply_token_masks(logits: torch.Tensor, rows: Sequence[tuple[int, GuidedMatcher]]) -> dict[int, str]:
    """Mask logits [B, V] (float, in place) to each listed row's allowed tokens. Returns
    {row index: error} for the rows whose grammar failed (their logits are left as they were)."""
    errors: dict[int, str] = {}
    if not rows:
        return errors
    vocab = logits.shape[-1]
    tok_vocab = max(m.vocab_size for _, m in rows)
    words = (tok_vocab + 31) // 32
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
    base = bitmask.data_ptr()
    for j, (i, matcher) in enumerate(rows):
        # Each matcher writes its own tokenizer's width; the rest of its row stays 0 (disallowed).
        err = matcher.fill_mask(base + j * words * 4, (matcher.vocab_size + 31) // 32 * 4)
        if err is not None:
            errors[i] = err
    keep = [j for j, (i, _) in enumerate(rows) if i not in errors]
    if not keep:
        return errors
    # [R, W] int32 -> [R, W * 32] additive bias (bit b of word w is token 32 w + b): 0 where
    # allowed, -inf where not ((bit - 1) * FLT_MAX * FLT_MAX; no NaN on either side). An add is
    # several times faster on the CPU than a masked_fill with a bool mask of the same shape.
    bias = ((bitmask[keep].unsqueeze(-1) >> _BITS) & 1).to(torch.float32)
    bias = bias.sub_(1).mul_(_FLOAT32_MAX).mul_(_FLOAT32_MAX).reshape(len(keep), words * 32)
    if bias.shape[1] >= vocab:
        bias = bias[:, :vocab]
    else:
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    index = torch.tensor([rows[j][0] for j in keep], device=logits.device)
    logits.index_add_(0, index, bias.to(logits.device, non_blocking=True))
    return errors


def accept_tokens(rows: Sequence[tuple[int, GuidedMatcher]], tokens: list[Optional[int]]) -> dict[int, str]:
    """Advance each row's matcher past its sampled token (rows without a token are skipped).
    Returns {row index: error} for the rows whose grammar refused their token."""
    errors: dict[int, str] = {}
    for i, matcher in rows:
        if tokens[i] is not None:
            err = matcher.accept(tokens[i])
            if err is not None:
                errors[i] = err
    return errors
