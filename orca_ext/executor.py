"""The executor seam: the one interface through which the engine runs batches.

An executor owns the model weights and KV pools (or the processes that own them) and turns one
ScheduledBatch into one token per request. `execute` returns a `BatchFuture` at once; the engine
keeps up to `n_workers` of them in flight (Algorithm 1's n_workers) and postprocesses a batch
when its future resolves, oldest first. The engine uses nothing of an executor beyond `Executor`.

`LocalExecutor` is the single-process case: the model lives in this process and `execute` runs
the forward pass and the sampler before it returns (an already resolved future).
`orca_ext.distributed.DistributedExecutor` runs tensor x pipeline parallel worker processes.
`make_executor` (executor_factory.py) builds the one a config asks for.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from . import ops
from .logprobs import split_logits
from .models.batch import ForwardBatch
from .sampling import Sampler, SampleResult

log = logging.getLogger(__name__)


class BatchFuture(concurrent.futures.Future):
    """The result of one launched batch. `completed_at` (time.perf_counter) is when the result
    came back, which may be well before the engine gets to postprocess it."""

    def __init__(self) -> None:
        super().__init__()
        self.completed_at: Optional[float] = None

    def resolve(self, result) -> None:
        self.completed_at = time.perf_counter()
        if isinstance(result, BaseException):
            self.set_exception(result)
        else:
            self.set_result(result)


@runtime_checkable
class Executor(Protocol):
    """What the engine needs of whatever runs its batches."""

    n_workers: int  # batches that may be in flight at once (pipeline stages)

    @property
    def spec(self):
        """The model's ModelSpec."""

    @property
    def error(self) -> Optional[str]:
        """None, or why this executor can no longer run anything (a worker died or raised)."""

    @property
    def wait_timeout(self) -> Optional[float]:
        """The longest the engine may wait for one batch's result (None: no bound needed)."""

    @property
    def max_slots(self) -> Optional[int]:
        """KV slots the executor can hold within its own memory budget, or None when the server
        sizes the cache (from kv_cache_memory or the device's free memory)."""

    def kv_bytes_per_slot(self) -> int:
        """Bytes one KV slot takes, over every process that holds a share of it."""

    def allocate_kv_cache(self, n_slots: int) -> None:
        """KV pools of n_slots slots (slot numbers are the scheduler's)."""

    def execute(self, batch) -> BatchFuture:
        """Launch one ScheduledBatch; the future resolves to a SampleResult, or to the exception
        that failed the whole batch."""

    def wait(self, future: BatchFuture) -> Union[SampleResult, BaseException]:
        """The batch's result; never raises and never waits forever."""

    def move_slabs(self, moves: Sequence[tuple[int, int, int]]) -> None:
        """Rows (src, dst, n): KV rows [src, src+n) of every pool go to [dst, dst+n), move after
        move, each as if through a temporary (ops.slab_move; the source keeps its rows unless
        the ranges overlap). The moves take effect after every batch launched before the call
        and before every batch launched after it, so they may be issued while batches are in
        flight as long as no in-flight batch writes the rows involved: slab compaction (no batch
        in flight) and prefix cache copies (from a cache entry, or from rows a request has
        already computed, into a slab whose first batch is not launched yet)."""

    def request_finished(self, req) -> None:
        """The request will never be launched again (its sampling state may go)."""

    def describe_workers(self) -> list[dict]:
        """One dict per worker process (empty in a single process)."""

    def shutdown(self) -> None:
        """Release the model and any worker processes. Idempotent."""


def sample_logits(sampler: Sampler, logits: torch.Tensor, logit_rows: Optional[Sequence[int]], requests: Sequence,
                  inputs: Sequence[tuple]) -> SampleResult:
    """The tokens, logprobs and prompt logprobs of `requests` from the logits [R, V] a forward
    returned for them (`logit_rows` as ForwardBatch.logit_rows: None for one row each). The one
    sampling path of LocalExecutor and of the rows a DistributedExecutor samples on its driver,
    so that both give the same results."""
    logits, prompt_logprobs = split_logits(logits, logit_rows, requests, inputs)
    result = sampler(logits, requests)
    result.prompt_logprobs = prompt_logprobs
    return result


class LocalExecutor:
    """Model and KV pools in this process; a batch has finished when `execute` returns.

    `model` is the models seam (docs/INTERNALS.md): a CausalLM, a DecodeGraphRunner around one,
    or any object with spec, device, kv_bytes_per_slot(), allocate_kv_cache(n), kv_pools and
    forward(ForwardBatch) -> [B, V] logits."""

    n_workers = 1
    error: Optional[str] = None
    wait_timeout: Optional[float] = None   # execute() has finished the batch already
    max_slots: Optional[int] = None

    def __init__(self, model, sampler: Optional[Sampler] = None):
        self.model = model
        self.sampler = sampler or Sampler()

    @property
    def spec(self):
        return self.model.spec

    def kv_bytes_per_slot(self) -> int:
        return int(self.model.kv_bytes_per_slot())

    def allocate_kv_cache(self, n_slots: int) -> None:
        self.model.allocate_kv_cache(n_slots)

    def execute(self, batch) -> BatchFuture:
        future = BatchFuture()
        try:
            with torch.inference_mode():
                fb = ForwardBatch.build(batch.inputs, self.model.device, batch.logit_rows)
                result = sample_logits(self.sampler, self.model.forward(fb), fb.logit_rows, batch.requests,
                                       batch.inputs)
        except Exception as exc:  # one bad batch must not kill the loop
            log.exception("iteration %d failed; failing its %d requests", batch.index, len(batch.requests))
            result = exc
        future.resolve(result)
        return future

    def wait(self, future: BatchFuture):
        try:
            return future.result()
        except Exception as exc:
            return exc

    def move_slabs(self, moves: Sequence[tuple[int, int, int]]) -> None:
        if moves:
            ops.slab_move(self.model.kv_pools, torch.tensor(list(moves), dtype=torch.int64))

    def request_finished(self, req) -> None:
        pass  # a request's sampling state lives on the request itself

    def describe_workers(self) -> list[dict]:
        return []

    def shutdown(self) -> None:
        pass
