"""Server: the public entry point (docs/DESIGN.md section 5).

One background thread runs the engine loop; any number of user threads and asyncio tasks submit,
stream, wait and abort concurrently. All request state is guarded by one lock; the loop releases
it while the model runs. Device, dtype and KV sizing are decided by `resources`; prompts and
limits are checked by `validation`; waiting for outputs and the request-id lifecycle belong to
`delivery.OutputBroker`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, AsyncIterator, Iterator, Optional, Sequence, Union

import torch

from .checks import check_choice, check_positive_int
from .delivery import OutputBroker
from .detokenizer import IncrementalDetokenizer
from .encoding import PromptEncoder
from .engine import Engine
from .errors import EngineDeadError, InvalidRequestError, ServerClosedError
from .request import IterationRecord, Request, RequestOutput
from .resources import kv_budget, plan_kv_cache, resolve_device, resolve_dtype
from .sampling import SamplingParams
from .scheduler import SCHEDULERS, make_scheduler
from .validation import LockedTokenizer, Prompt, RequestValidator

log = logging.getLogger(__name__)

DEFAULT_MAX_UNDELIVERED = 4096   # finished outputs nobody has collected yet
SHUTDOWN_WAIT_S = 30.0           # how long shutdown() lets parallel workers finish the running step
# Chunked prefill's token budget. "auto" picks per device, raised to max_batch_size when that is
# larger (every running request decodes each iteration). CPU: the smallest chunk whose cost per
# token is within ~10% of a whole long prompt's (bench/chunked_prefill.py --cost, bench/RESULTS.md);
# a CPU forward costs in proportion to its tokens, so a smaller budget means shorter stalls for the
# running decodes. CUDA: a forward of a few thousand tokens costs little more than a decode step, so
# the budget is vLLM's online-serving default (not measured here yet).
DEFAULT_MAX_NUM_BATCHED_TOKENS = "auto"
CHUNK_BUDGET_BY_DEVICE = {"cpu": 128, "cuda": 2048}
# batch_invariant=None picks per device: on for CPU, where it costs no throughput
# (bench/batch_invariance.py); off for CUDA until bench/device_check.sh has measured its cost.
DEFAULT_BATCH_INVARIANT = None


def _weights_device_type(model: Any, device, parallel: bool) -> str:
    """'cpu' or 'cuda': where the weights will live. `device` is checked as the load or the
    parallel launch checks it, so a bad value gets the same error here."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        return torch.device(model.device).type
    if parallel:
        from .distributed.launch import parallel_device

        return parallel_device(device).type
    return resolve_device(device).type


def _load(model: Any, device, dtype, tokenizer: Any) -> tuple[Any, Any, Optional[str]]:
    """(model object, tokenizer or None, model folder or None) from Server's arguments."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        # An already loaded model object: it decides device and dtype.
        return model, tokenizer if tokenizer is not None else getattr(model, "tokenizer", None), None
    from .models import load_model, load_tokenizer

    if model is None:
        from .default_model import default_model_path

        model = default_model_path()
    path = str(model)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    log.info("loading %s on %s as %s", path, dev, dt)
    loaded = load_model(path, device=dev, dtype=dt)
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(path)
        except FileNotFoundError as exc:  # still usable with token-id prompts
            log.warning("%s; only token-id prompts will be accepted and no text is produced", exc)
    return loaded, tokenizer, path


def _is_token_list(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


class Server:
    """An Orca serving engine with a background loop thread. See docs/DESIGN.md section 5.

    Extensions beyond the contract: `model` may also be an already loaded model object (with the
    models seam interface), `tokenizer` overrides the folder's tokenizer, `kv_cache_memory`
    (bytes or '2GiB'; default $ORCA_EXT_KV_CACHE_MEMORY, else min(2 GiB, 25% of available RAM) on
    CPU and 90% of the free GPU memory after loading the weights) sizes `n_slots` when it is None,
    `max_undelivered_outputs` bounds the finished outputs kept for callers, and `enforce_eager`
    turns off the CUDA graphs that decode iterations replay on CUDA (orca_ext/cuda_graphs.py).

    `tensor_parallel_size` x `pipeline_parallel_size` > 1 runs the model on that many worker
    processes (orca_ext.distributed, docs/DISTRIBUTED.md; `model` must then be a folder):
    `kv_cache_memory` is then each worker's budget, and pipeline_parallel_size batches are in
    flight (Algorithm 1's n_workers). The workers run every iteration eagerly.

    Beyond Algorithm 1 (docs/DESIGN.md section 3): `max_num_batched_tokens` is the per-iteration
    token budget of chunked prefill ("auto": CHUNK_BUDGET_BY_DEVICE, at least max_batch_size; None:
    whole prompts, plain Orca; orca policy only),
    `batch_invariant` makes each request's tokens independent of its batch-mates (None: on for
    CPU, off for CUDA), and
    `slab_compaction` slides live slabs together when the queue head only lacks a contiguous run
    (single process only: with parallel workers it is off, see docs/DESIGN.md).
    """

    def __init__(self, model: Any = None, *, device: Union[str, torch.device] = "auto",
                 dtype: Union[str, torch.dtype] = "auto", max_batch_size: int = 32,
                 n_slots: Optional[int] = None, max_model_len: Optional[int] = None,
                 scheduler: str = "orca", record_iterations: bool = False,
                 tokenizer: Any = None, kv_cache_memory: Union[int, str, None] = None,
                 max_undelivered_outputs: int = DEFAULT_MAX_UNDELIVERED,
                 enforce_eager: bool = False,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 max_num_batched_tokens: Union[int, str, None] = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 batch_invariant: Optional[bool] = DEFAULT_BATCH_INVARIANT, slab_compaction: bool = True):
        check_positive_int("max_batch_size", max_batch_size)
        check_positive_int("tensor_parallel_size", tensor_parallel_size)
        check_positive_int("pipeline_parallel_size", pipeline_parallel_size)
        check_positive_int("max_undelivered_outputs", max_undelivered_outputs)
        if n_slots is not None:
            check_positive_int("n_slots", n_slots)
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len)
        check_choice("scheduler", scheduler, SCHEDULERS)
        if not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {enforce_eager!r}")
        device_type = _weights_device_type(model, device, tensor_parallel_size * pipeline_parallel_size > 1)
        if isinstance(max_num_batched_tokens, str) and max_num_batched_tokens == "auto":
            max_num_batched_tokens = max(CHUNK_BUDGET_BY_DEVICE[device_type], max_batch_size)
        elif max_num_batched_tokens is not None:
            check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
            if scheduler == "orca" and max_num_batched_tokens < max_batch_size:
                raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_batch_size "
                                 f"({max_batch_size}): every running request decodes one token per iteration")
        if batch_invariant is not None and not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True, False or None (per device), got {batch_invariant!r}")
        if not isinstance(slab_compaction, bool):
            raise ValueError(f"slab_compaction must be True or False, got {slab_compaction!r}")
        if batch_invariant is None:  # per device, see DEFAULT_BATCH_INVARIANT
            batch_invariant = device_type == "cpu"

        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        executor = None
        if tensor_parallel_size * pipeline_parallel_size > 1:
            from .distributed.launch import start_parallel

            started = start_parallel(model, device=device, dtype=dtype, tokenizer=tokenizer,
                                     tensor_parallel_size=tensor_parallel_size,
                                     pipeline_parallel_size=pipeline_parallel_size, kv_cache_memory=kv_cache_memory,
                                     batch_invariant=batch_invariant)
            executor, tokenizer = started.executor, started.tokenizer
            self.model, self.model_path = None, started.model_path  # the weights live in the workers
            spec, self.device, self.dtype = started.spec, started.device, started.dtype
        else:
            self.model, tokenizer, self.model_path = _load(model, device, dtype, tokenizer)
            spec = self.model.spec
            self.device: torch.device = torch.device(self.model.device)
            self.dtype: torch.dtype = self.model.dtype
        self.tokenizer = tokenizer
        self._tok = LockedTokenizer(tokenizer) if tokenizer is not None else None
        self.vocab_size: int = int(spec.vocab_size)
        eos = set(spec.eos_token_ids or ())
        tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if isinstance(tok_eos, int):
            eos.add(tok_eos)
        self.eos_token_ids = frozenset(eos)

        bytes_per_slot = self._bytes_per_slot = int((executor or self.model).kv_bytes_per_slot())
        if executor is not None:  # every worker sized its own pools: n_slots is what all of them hold
            budget = executor.max_slots * bytes_per_slot
        else:
            budget = None if n_slots is not None else kv_budget(kv_cache_memory, self.device)
        try:
            plan = plan_kv_cache(model_context=int(spec.max_position_embeddings), bytes_per_slot=bytes_per_slot,
                                 max_batch_size=max_batch_size, n_slots=n_slots, max_model_len=max_model_len,
                                 budget_bytes=budget)
        except BaseException:
            if executor is not None:
                executor.shutdown()
            raise
        if n_slots is None:
            log.info("KV cache: %d slots x %d bytes = %.1f MiB", plan.n_slots, bytes_per_slot,
                     plan.n_slots * bytes_per_slot / 2**20)
        if plan.max_model_len > plan.n_slots:
            log.warning("max_model_len=%d is larger than n_slots=%d; requests are limited to %d tokens",
                        plan.max_model_len, plan.n_slots, plan.n_slots)
        self.n_slots = plan.n_slots
        self.max_model_len = plan.max_model_len
        self.max_batch_size = max_batch_size
        self.scheduler_policy = scheduler
        self.record_iterations = record_iterations
        # The one prompt encoder: Server.submit and the HTTP layer's chat prompts share its pool.
        self.prompt_encoder: Optional[PromptEncoder] = (
            PromptEncoder(tokenizer, max_tokens=min(self.max_model_len, self.n_slots), fallback_lock=self._tok.lock)
            if tokenizer is not None else None)
        self._validator = RequestValidator(self.prompt_encoder, self.vocab_size, self.max_model_len, self.n_slots)

        # The static baseline runs whole prompts; the budget belongs to iteration-level scheduling.
        self.max_num_batched_tokens = max_num_batched_tokens if scheduler == "orca" else None
        self.batch_invariant = batch_invariant
        if self.model is not None:
            self.model.batch_invariant = batch_invariant  # before the CUDA graphs capture its forward
        if slab_compaction and executor is not None:
            # A slab move would have to run in every worker's pools, between pipeline stages'
            # batches; not implemented, so parallel runs keep their slabs where they are.
            log.info("slab compaction is off with tensor_parallel_size x pipeline_parallel_size = %d > 1 "
                     "(KV slabs live in the workers' pools)", tensor_parallel_size * pipeline_parallel_size)
            slab_compaction = False
        self.slab_compaction = slab_compaction
        sched = make_scheduler(scheduler, max_batch_size, self.n_slots, executor.n_workers if executor else 1,
                               max_num_batched_tokens=self.max_num_batched_tokens)
        if executor is None:
            from .cuda_graphs import with_decode_graphs

            runner = with_decode_graphs(self.model, max_batch_size, enforce_eager=enforce_eager)
        try:
            self._engine = Engine(executor or runner, sched, record_iterations=record_iterations,
                                  slab_compaction=slab_compaction)
        except BaseException:
            if executor is not None:
                executor.shutdown()
            raise

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)   # the loop sleeps here when idle
        self._outputs = OutputBroker(self._lock, max_undelivered_outputs)
        self._closed = False
        self._busy_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="orca-engine-loop", daemon=True)
        self._thread.start()

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- submission -------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None, *,
               request_id: Optional[str] = None) -> str:
        """Queue a request; returns its id. Invalid input raises InvalidRequestError here."""
        if self._closed:
            raise ServerClosedError("the server is shut down; no new requests are accepted")
        self._check_engine()
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt_ids = self._validator.prompt_ids(prompt)
        self._validator.check(prompt_ids, params)
        detok = (IncrementalDetokenizer(self._tok, prompt_ids) if self._tok is not None else None)
        with self._lock:
            if self._closed:
                raise ServerClosedError("the server is shut down; no new requests are accepted")
            self._check_engine()
            if request_id is None:
                request_id = self._outputs.unused_id()
            req = Request(request_id, prompt_ids, params, detok, self.eos_token_ids)
            self._outputs.add(req)  # raises if the id is in use
            self._engine.add_request(req)
            self._work.notify()
        return request_id

    def _check_engine(self) -> None:
        error = self._engine.executor.error
        if error is not None:
            raise EngineDeadError(f"the engine cannot run requests any more: {error}; "
                                  f"shut this server down and start a new one")

    # -- results ----------------------------------------------------------------------------------
    def result(self, request_id: str, timeout: Optional[float] = None) -> RequestOutput:
        """Block until the request finishes; return its final output (and release its id).
        Raises KeyError for an unknown id, TimeoutError when `timeout` seconds pass first."""
        return self._outputs.result(request_id, timeout)

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """Snapshots of the request as it progresses (the full text so far each time); the last one
        has finished=True. Unknown ids raise KeyError here, not at the first iteration."""
        return self._outputs.stream(request_id)

    def stream_async(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """asyncio twin of stream(): an async iterator of snapshots, woken by the engine thread
        (never polling, never holding an executor thread)."""
        return self._outputs.stream_async(request_id)

    async def generate_async(self, prompt: Prompt, params: Optional[SamplingParams] = None, *,
                             request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Submit and stream one request from asyncio. Unlike stream(), leaving this iterator
        early (break, cancellation) aborts the request: nobody else holds its id."""
        rid = self.submit(prompt, params, request_id=request_id)
        outputs = self.stream_async(rid)
        finished = False
        try:
            async for out in outputs:
                finished = out.finished
                yield out
        finally:
            await outputs.aclose()  # unregister its wake-up now, not whenever it is collected
            if not finished:
                self.abort(rid)
                self._outputs.discard(rid)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. `params` is one SamplingParams for
        all prompts or one per prompt. A bare string or token-id list counts as one prompt."""
        if isinstance(prompts, str) or _is_token_list(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            per_prompt = [params] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise InvalidRequestError(f"params has {len(per_prompt)} entries for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, per_prompt):
                ids.append(self.submit(prompt, p))
            return [self.result(rid) for rid in ids]
        except BaseException:
            for rid in ids:  # nothing of a failed generate() call keeps running or holds an id
                self.abort(rid)
                self._outputs.discard(rid)
            raise

    def abort(self, request_id: str) -> bool:
        """Stop a waiting or running request: True if it was unfinished. Its slab is freed now
        (or, if its batch is executing, as soon as that batch returns)."""
        with self._lock:
            req = self._outputs.find(request_id)
            if req is None or req.finished:
                return False
            self._engine.abort_request(req)
            self._outputs.publish([req])
            self._work.notify()  # a freed slab may let a waiting request in
            return True

    # -- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters and configuration. `busy_seconds` is the wall time spent in engine steps
        (busy_seconds / iterations is the mean iteration time)."""
        with self._lock:
            eng = self._engine
            sched = eng.scheduler
            return {
                "iterations": eng.num_iterations,
                "waiting": sched.num_waiting,
                "running": sched.num_running,
                "finished": eng.num_finished,
                "n_slots": self.n_slots,
                "slots_reserved": sched.n_rsrv,
                "slots_used": eng.slots_used,
                "slots_allocated": sched.allocator.n_used,
                "max_model_len": self.max_model_len,
                "max_batch_size": self.max_batch_size,
                "scheduler": self.scheduler_policy,
                "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""),
                "kv_cache_bytes": self.n_slots * self._bytes_per_slot,  # over all workers
                "prompt_tokens": eng.num_prompt_tokens,
                "generated_tokens": eng.num_generated_tokens,
                "undelivered_outputs": self._outputs.n_undelivered,
                "dropped_outputs": self._outputs.n_dropped,
                "closed": self._closed,
                "busy_seconds": self._busy_seconds,
                "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "healthy": eng.executor.error is None,  # False once a worker died or raised
                "error": eng.executor.error,
                "workers": eng.executor.describe_workers() if hasattr(eng.executor, "describe_workers") else [],
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "batch_invariant": self.batch_invariant,
                "compactions": eng.num_compactions,
                "compaction_moved_bytes": eng.compaction_moved_bytes,
            }

    def iterations(self) -> list[IterationRecord]:
        """Per-iteration records (only kept with record_iterations=True)."""
        with self._lock:
            return list(self._engine.records)

    # -- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the loop; every unfinished request ends with finish_reason='abort'. Idempotent."""
        with self._lock:
            self._closed = True
            self._work.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # The loop ends after its current step. Parallel workers that stopped answering would
            # hold that step up to their timeout: after a while they are stopped, which fails it.
            self._thread.join(None if self.model is not None else SHUTDOWN_WAIT_S)
            if self._thread.is_alive():
                self._engine.shutdown()
                self._thread.join()
        with self._lock:
            self._outputs.publish(self._engine.abort_all("abort"))
            self._outputs.report_drops()
        self._engine.shutdown()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- engine loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._engine.has_work():
                    self._work.wait()
                if self._closed:
                    break
            try:
                started = time.perf_counter()
                self._engine.step(self._lock, self._outputs.publish)
                self._busy_seconds += time.perf_counter() - started  # only the loop thread writes it
                if self._engine.last_step_idle:
                    # Work exists but none can be scheduled (cannot happen with n_workers=1, where
                    # an empty KV cache always fits the validated head request). Sleep until a
                    # submit/abort/shutdown changes the pool instead of spinning.
                    log.warning("no request could be scheduled; waiting for the pool to change")
                    with self._lock:
                        if not self._closed:
                            self._work.wait()
            except Exception as exc:  # a bug must not leave callers waiting forever
                log.exception("engine loop error; failing all unfinished requests")
                with self._lock:
                    self._outputs.publish(self._engine.abort_all("error", f"engine error: {type(exc).__name__}: {exc}"))
        log.debug("engine loop stopped")
