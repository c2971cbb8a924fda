"""The rows of a parallel batch that the driver samples, and how their results join the workers'.

The sampling worker holds a batch's logits but none of its requests' state. A request whose
sampling needs that state (logprobs, prompt logprobs, penalties / logit_bias / min_tokens with
their token history, a grammar matcher) is sampled here instead: the worker draws nothing for it
and sends its logits rows back in the batch's KIND_RESULT (messages.py), and the driver runs the
single-process sampling path on them (executor.sample_logits, with the requests' own generators
and matchers), so both give the same tokens and logprobs. Plain rows keep the worker's path: one
token id each.

A request is sampled in one place for its whole life (its generator's stream must not split
between two processes): on the driver for every iteration that draws a token or scores prompt
tokens, whenever its params or its grammar ask for request-side state.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch

from ..executor import sample_logits
from ..sampling import SampleResult, Sampler

log = logging.getLogger(__name__)


def needs_request_state(req) -> bool:
    """Whether sampling `req` reads state only the driver holds (then the driver samples it)."""
    p = req.params
    return (p.logprobs is not None or p.prompt_logprobs is not None or p.controls_logits
            or req.guided is not None)


def samples_on_driver(req, logit_rows: int) -> bool:
    """Whether this iteration's row of `req` goes to the driver: it needs request state and it
    either draws a token or returns prompt rows (a non-final prompt chunk without prompt
    logprobs needs no logits at all)."""
    return needs_request_state(req) and (req.emits_token or logit_rows > 1)


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """A KIND_RESULT as received: the plain rows' tokens and errors (a row the driver samples has
    a placeholder), and the float32 [R, V] logits rows of the rows the driver samples (R = 0:
    none)."""

    result: SampleResult
    logits: torch.Tensor


class DriverRows:
    """The rows of one batch that the driver samples (`indices`, in batch order)."""

    def __init__(self, requests: Sequence, inputs: Sequence[tuple], logit_rows: Optional[Sequence[int]],
                 indices: Sequence[int]):
        self.indices = list(indices)
        self.requests = [requests[i] for i in self.indices]
        self.inputs = [inputs[i] for i in self.indices]
        counts = [1 if logit_rows is None else int(logit_rows[i]) for i in self.indices]
        self.logit_rows = None if all(n == 1 for n in counts) else counts
        self.n_logits = sum(counts)

    def merge(self, sampler: Sampler, answer: WorkerResult) -> SampleResult:
        """The batch's result: the worker's rows, with these rows sampled from their logits. A
        failure here fails these rows' requests only."""
        result = answer.result
        if not self.indices:
            return result
        try:
            if tuple(answer.logits.shape[:1]) != (self.n_logits,):
                raise RuntimeError(f"the sampling worker sent {answer.logits.shape[0]} logits rows for "
                                   f"{self.n_logits} (control-plane protocol error)")
            mine = sample_logits(sampler, answer.logits, self.logit_rows, self.requests, self.inputs)
        except Exception as exc:
            log.exception("sampling %d rows on the driver failed", len(self.indices))
            for i in self.indices:
                result.tokens[i] = None
                result.errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
            return result
        for j, i in enumerate(self.indices):
            result.tokens[i] = mine.tokens[j]
            result.errors[i] = mine.errors[j]
        result.logprobs = _scatter(result.logprobs, mine.logprobs, self.indices, len(result.tokens))
        result.prompt_logprobs = _scatter(result.prompt_logprobs, mine.prompt_logprobs, self.indices,
                                          len(result.tokens))
        return result


def _scatter(into: Optional[list], mine: Optional[list], indices: list[int], n: int) -> Optional[list]:
    """`into` (a batch's per-row entries, or None for none) with mine[j] placed at row indices[j]
    where mine has one; the list is made when the first entry arrives."""
    for j, i in enumerate(indices):
        if mine is not None and mine[j] is not None:
            if into is None:
                into = [None] * n
            into[i] = mine[j]
    return into
