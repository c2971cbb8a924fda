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
control is a sparse gather/scatter over all the controlled rows' affected entries (never a pass
over [rows, vocab]); the per-row work in Python is only flattening each row's token lists into
one index list, and a logit_bias map (up to a thousand entries) is converted to tensors once and
reused on the request's later steps. The controls change the sampler's logits in place. A row
whose controls fail is given -inf logits and an error, so only its request fails.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import NamedTuple, Optional, Sequence

import torch


def apply_controls(logits: torch.Tensor, requests: Sequence, errors: list[Optional[str]]) -> None:
    """Apply each controlled row's controls to logits [B, V] float32 (contiguous), in place: the
    sampler consumes its logits. `errors[i]` is set, and row i set to -inf, for a row whose
    controls failed. Only the controlled rows are copied, to restore them should the batched
    pass fail part way: a fresh copy of the whole [B, V] each step (page faults and all) cost
    more than the controls themselves."""
    rows = [i for i, r in enumerate(requests) if r.params.controls_logits and r.emits_token]
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    backup = logits.index_select(0, index)  # [R, V]
    try:
        apply_to_rows(logits, rows, [requests[i] for i in rows])
    except Exception:
        logits.index_copy_(0, index, backup)
        for i in rows:  # find the failing row: only its request fails
            try:
                apply_to_rows(logits, [i], [requests[i]])
            except Exception as exc:
                logits[i] = float("-inf")
                errors[i] = f"logits controls failed: {type(exc).__name__}: {exc}"


def _flat(rows: Sequence[int], lists: Sequence[Sequence[int]], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat index row * vocab + token id, position in `rows`) int64 tensors of the entries of
    `lists`, list j belonging to row rows[j]. An id outside [0, vocab) raises."""
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise IndexError(f"token id outside the vocabulary [0, {vocab})")
    owner = torch.repeat_interleave(torch.arange(len(lists)), lengths)
    flat = torch.tensor(rows, dtype=torch.int64)[owner] * vocab + ids
    return flat.to(device), owner.to(device)


# The tensors of a logit_bias map, kept for the maps of the rows of recent steps: a request
# reads the same map every step. Keyed by the map's id, with the map itself kept alive beside its
# tensors, so an id is never reused while its entry stays. Samplers of several servers (or a
# driver's listener thread) may share it: the lock keeps lookup, reordering and eviction whole.
_BIAS_PAIRS: "OrderedDict[int, tuple[tuple, BiasTensors]]" = OrderedDict()
_BIAS_PAIRS_LOCK = threading.Lock()
BIAS_PAIRS_KEPT = 256


class BiasTensors(NamedTuple):
    """One logit_bias map as tensors: ids [n] int64, values [n] float32, and the largest id
    (SamplingParams sorts the map by id and checks ids >= 0; the vocabulary bound is checked
    against `top` each step, since one map may meet models of different vocabularies)."""
    ids: torch.Tensor
    values: torch.Tensor
    top: int


def _bias_pairs(bias: tuple) -> BiasTensors:
    """bias ((id, value), ...) -> its BiasTensors, converted once per map. The values go through
    float64 (exact for ids below 2**53 and for any Python float) to float32, as a Python float
    would convert."""
    key = id(bias)
    with _BIAS_PAIRS_LOCK:
        entry = _BIAS_PAIRS.get(key)
        if entry is not None and entry[0] is bias:
            _BIAS_PAIRS.move_to_end(key)
            return entry[1]
    pairs = torch.tensor(bias, dtype=torch.float64).view(-1, 2)
    tensors = BiasTensors(pairs[:, 0].to(torch.int64), pairs[:, 1].to(torch.float32),
                          int(bias[-1][0]) if bias else -1)
    with _BIAS_PAIRS_LOCK:
        _BIAS_PAIRS[key] = (bias, tensors)
        if len(_BIAS_PAIRS) > BIAS_PAIRS_KEPT:
            _BIAS_PAIRS.popitem(last=False)
    return tensors


def _bias_entries(rows: Sequence[int], params: Sequence, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat index row * vocab + token id int64, bias float32) of every row's logit_bias: per row
    one offset added to its cached ids, not a Python pass per entry (a map may have a thousand
    entries and this runs every step)."""
    maps = [(row, _bias_pairs(p.logit_bias)) for row, p in zip(rows, params) if p.logit_bias]
    if max(m.top for _, m in maps) >= vocab:
        raise IndexError(f"token id outside the vocabulary [0, {vocab})")
    return (torch.cat([m.ids + row * vocab for row, m in maps]), torch.cat([m.values for _, m in maps]))


def apply_to_rows(x: torch.Tensor, rows: Sequence[int], requests: Sequence) -> None:
    """Apply each request's controls to its row of x [B, V] float32, in place. Every control
    touches only the entries of the tokens it concerns (sparse gathers and scatters over the flat
    view), never a whole [rows, V] pass."""
    vocab = x.shape[1]
    flat_x = x.view(-1)
    device = x.device
    params = [r.params for r in requests]
    if any(p.logit_bias for p in params):
        flat, values = _bias_entries(rows, params, vocab)
        flat_x.index_put_((flat.to(device),), values.to(device=device, dtype=x.dtype), accumulate=True)
    if any(p.repetition_penalty != 1.0 for p in params):
        flat, owner = _flat(rows, [r.prompt_token_ids + r.output_token_ids if r.params.repetition_penalty != 1.0
                                   else () for r in requests], vocab, device)
        flat, first = _unique(flat)
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=device)[owner[first]]
        values = flat_x[flat]
        flat_x[flat] = torch.where(values > 0, values / penalty, values * penalty)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        flat, owner = _flat(rows, [r.output_token_ids if r.params.frequency_penalty or r.params.presence_penalty
                                   else () for r in requests], vocab, device)
        flat, first, counts = _unique(flat, counts=True)
        owner = owner[first]
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=device)[owner]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=device)[owner]
        flat_x[flat] -= freq * counts.to(x.dtype) + pres
    early = [sorted(r.stop_token_ids) if len(r.output_token_ids) < r.params.min_tokens else ()
             for r in requests]
    if any(early):
        flat, _ = _flat(rows, early, vocab, device)
        flat_x[flat] = float("-inf")


def _unique(flat: torch.Tensor, counts: bool = False):
    """The distinct values of flat, the position of one occurrence of each, and (with counts)
    how often each occurs."""
    values, inverse, n = torch.unique(flat, return_inverse=True, return_counts=True)
    first = torch.empty_like(values).scatter_(0, inverse, torch.arange(flat.numel(), device=flat.device))
    return (values, first, n) if counts else (values, first)
