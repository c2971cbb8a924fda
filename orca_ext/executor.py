"""The executor seam: how the engine runs a scheduled batch.

An executor owns the model weights and KV pools (or the processes that own them) and turns one
ScheduledBatch into one token per request. `execute` returns a `BatchFuture` at once; the engine
keeps up to `n_workers` of them in flight (Algorithm 1's n_workers) and postprocesses a batch
when its future resolves, oldest first.

    executor.n_workers                  batches that may be in flight (pipeline stages)
    executor.allocate_kv_cache(n_slots) KV pools of n_slots slots (slot numbers are the driver's)
    executor.execute(batch) -> BatchFuture    resolves to a SampleResult, or to the exception
                                        that failed the whole batch
    executor.wait(future) -> SampleResult | BaseException   (never raises, never hangs forever)
    executor.request_finished(req)      the request will never be launched again
    executor.error                      None, or why the executor can no longer run anything
    executor.shutdown()

`LocalExecutor` is the single-process case: the model lives in this process and `execute` runs
the forward pass and the sampler before it returns (an already resolved future).
`orca_ext.distributed.DistributedExecutor` runs tensor x pipeline parallel worker processes.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Optional

import torch

from .models.batch import ForwardBatch
from .sampling import Sampler

log = logging.getLogger(__name__)


class BatchFuture(concurrent.futures.Future):
    """The result of one launched batch. `completed_at` (time.perf_counter) is when the result
    came back, which may be well before the engine gets to postprocess it."""

    def __init__(self) -> None:
        super().__init__()
        self.completed_at: Optional[float] = None
        self.logits: Optional[torch.Tensor] = None   # only when the logits were asked for

    def resolve(self, result) -> None:
        self.completed_at = time.perf_counter()
        if isinstance(result, BaseException):
            self.set_exception(result)
        else:
            self.set_result(result)


class LocalExecutor:
    """Model and KV pools in this process; a batch has finished when `execute` returns."""

    n_workers = 1
    error: Optional[str] = None

    def __init__(self, model, sampler: Optional[Sampler] = None):
        self.model = model
        self.sampler = sampler or Sampler()

    @property
    def spec(self):
        return self.model.spec

    def allocate_kv_cache(self, n_slots: int):
        return self.model.allocate_kv_cache(n_slots)

    def execute(self, batch) -> BatchFuture:
        future = BatchFuture()
        try:
            with torch.inference_mode():
                fb = ForwardBatch.build(batch.inputs, self.model.device)
                logits = self.model.forward(fb)
                result = self.sampler(logits, batch.requests)
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

    def request_finished(self, req) -> None:
        pass  # a request's sampling state lives on the request itself

    def shutdown(self) -> None:
        pass
