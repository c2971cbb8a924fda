"""Server: the public entry point (docs/DESIGN.md section 5).

One background thread runs the engine loop; any number of user threads and asyncio tasks submit,
stream, wait and abort concurrently. All request state is guarded by one lock (the engine's);
the loop releases it while the model runs. The wiring, top to bottom:

    EngineConfig (config.py)             every option, validated, then resolved for this machine
    modes.update(...)                    the process's kernel modes, before anything captures a forward
    make_executor (executor_factory.py)  the model here, or tp x pp worker processes
    plan_kv_cache (resources.py)         n_slots and max_model_len from the budget and the model
    make_scheduler, Engine               Algorithm 1 over that KV cache
    RequestValidator, OutputBroker       checks at submit; waiting for outputs and the id lifecycle
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, AsyncIterator, Iterator, Optional, Sequence, Union

import torch

from . import modes
from .config import EngineConfig
from .delivery import OutputBroker
from .detokenizer import IncrementalDetokenizer
from .encoding import PromptEncoder
from .engine import Engine
from .errors import EngineDeadError, InvalidRequestError, ServerClosedError
from .request import IterationRecord, Request, RequestOutput
from .resources import default_kv_memory, plan_kv_cache
from .sampling import SamplingParams
from .prefix_cache import PrefixCache
from .quant.formats import resolve_quant_activations
from .scheduler import make_scheduler
from .executor_factory import is_model_object, make_executor
from .kernel_thread import KernelThread
from .validation import LockedTokenizer, Prompt, RequestValidator

log = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 30.0           # how long shutdown() lets parallel workers finish the running step


def _now(fn):
    """fn() on the calling thread (KernelThread.call's signature)."""
    return fn()


def _engine_config(config: Optional[EngineConfig], options: dict) -> EngineConfig:
    """`config`, or one built from Server's keyword options (EngineConfig's fields)."""
    if config is None:
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise TypeError(f"Server got unknown option(s) {unknown}; the options are EngineConfig's fields")
        return EngineConfig(**options)
    if options:
        raise TypeError(f"pass either config or options, not both (got config and {sorted(options)})")
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    return config


def _eos_token_ids(spec, tokenizer) -> frozenset:
    """The model's EOS ids and the tokenizer's."""
    eos = set(spec.eos_token_ids or ())
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(tok_eos, int):
        eos.add(tok_eos)
    return frozenset(eos)


def _is_token_list(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


class Server:
    """An Orca serving engine with a background loop thread. See docs/DESIGN.md section 5.

    `model`: a Hugging Face folder (default: the embedded SmolLM2-135M-Instruct), or an already
    loaded model object (the models seam; single process only). `config` is an EngineConfig;
    `options` are EngineConfig fields, for `Server(path, max_batch_size=8)` (not both).
    `tokenizer` overrides the folder's tokenizer.
    """

    def __init__(self, model: Any = None, *, config: Optional[EngineConfig] = None, tokenizer: Any = None,
                 **options: Any):
        config = _engine_config(config, options)
        config = self.config = config.resolve(model if is_model_object(model) else None)
        # Set before the executor starts: CUDA graphs capture the forward under these modes, and
        # parallel workers take them with them. Shutdown puts back the modes these replaced.
        self._modes_before = modes.current()
        self._modes = modes.update(batch_invariant=config.batch_invariant,
                                   quant_activations=config.quant_activations)

        # One thread loads, sizes the cache and runs the loop (kernel_thread.py says why). Parallel
        # workers run the kernels in their own processes: their start-up stays on this thread.
        kernels = KernelThread("orca-engine-loop")
        on_kernels = kernels.call if config.tensor_parallel_size * config.pipeline_parallel_size == 1 else _now
        try:
            started = on_kernels(lambda: make_executor(model, config, tokenizer))
        except BaseException:
            kernels.stop()
            self._restore_modes()
            raise
        executor, spec, tokenizer = started.executor, started.spec, started.tokenizer
        try:
            # quant_activations="auto" is decided per model, from the block formats its matrices
            # are stored in (parallel workers decide the same from the same spec); no forward has
            # run yet, and the mode reaches only CPU products of blocks.
            config = self.config = dataclasses.replace(config, quant_activations=resolve_quant_activations(
                config.quant_activations, dict(spec.block_bytes)))
            self._modes = modes.update(quant_activations=config.quant_activations)
            self._plan_kv(executor, spec)
            lock = threading.RLock()
            self._outputs = OutputBroker(lock, config.max_undelivered_outputs)
            prefix_cache = (PrefixCache(self.n_slots, config.prefix_cache_block_size)
                            if config.prefix_caching else None)
            scheduler = make_scheduler(config, self.n_slots, executor.n_workers)
            self._engine = on_kernels(lambda: Engine(  # allocates the KV cache
                executor, scheduler, record_iterations=config.record_iterations,
                slab_compaction=config.slab_compaction, lock=lock, publish=self._outputs.publish,
                prefix_cache=prefix_cache))
        except BaseException:
            executor.shutdown()
            kernels.stop()
            self._restore_modes()
            raise
        self._lock = lock
        self.model_path = started.model_path
        self.device: torch.device = config.device
        self.dtype: torch.dtype = config.dtype
        self.tokenizer = tokenizer
        self._tok = LockedTokenizer(tokenizer) if tokenizer is not None else None
        self.vocab_size: int = int(spec.vocab_size)
        self.eos_token_ids = _eos_token_ids(spec, tokenizer)
        # The one prompt encoder: Server.submit and the HTTP layer's chat prompts share its pool.
        self.prompt_encoder: Optional[PromptEncoder] = (
            PromptEncoder(tokenizer, max_tokens=min(self.max_model_len, self.n_slots), fallback_lock=self._tok.lock)
            if tokenizer is not None else None)
        self._validator = RequestValidator(self.prompt_encoder, self.vocab_size, self.max_model_len, self.n_slots)
        self._closed = False
        self._busy_seconds = 0.0
        self._thread = kernels.thread
        kernels.run_forever(self._loop)

    def _plan_kv(self, executor, spec) -> None:
        """n_slots and max_model_len: the config's, else from the KV budget (each worker's own,
        with parallel workers; else kv_cache_memory or the device default) and the model."""
        config = self.config
        bytes_per_slot = self._bytes_per_slot = executor.kv_bytes_per_slot()
        if executor.max_slots is not None:  # every worker sized its own pools
            budget = executor.max_slots * bytes_per_slot
        elif config.n_slots is not None:
            budget = None
        else:
            budget = config.kv_cache_memory or default_kv_memory(config.device)
        plan = plan_kv_cache(model_context=int(spec.max_position_embeddings), bytes_per_slot=bytes_per_slot,
                             max_batch_size=config.max_batch_size, n_slots=config.n_slots,
                             max_model_len=config.max_model_len, budget_bytes=budget)
        if config.n_slots is None:
            log.info("KV cache: %d slots x %d bytes = %.1f MiB", plan.n_slots, bytes_per_slot,
                     plan.n_slots * bytes_per_slot / 2**20)
        if plan.max_model_len > plan.n_slots:
            log.warning("max_model_len=%d is larger than n_slots=%d; requests are limited to %d tokens",
                        plan.max_model_len, plan.n_slots, plan.n_slots)
        self.n_slots = plan.n_slots
        self.max_model_len = plan.max_model_len

    @property
    def executor(self):
        """What runs this server's batches (executor.Executor): the model in this process or the
        parallel workers. For benchmarks and diagnostics; requests go through submit()."""
        return self._engine.executor

    # Read-only views of the resolved configuration.
    max_batch_size = property(lambda self: self.config.max_batch_size)
    max_num_batched_tokens = property(lambda self: self.config.max_num_batched_tokens)
    prefill_only_tokens = property(lambda self: self.config.prefill_only_tokens)
    batch_invariant = property(lambda self: self.config.batch_invariant)
    slab_compaction = property(lambda self: self.config.slab_compaction)
    scheduler_policy = property(lambda self: self.config.scheduler)
    record_iterations = property(lambda self: self.config.record_iterations)
    tensor_parallel_size = property(lambda self: self.config.tensor_parallel_size)
    pipeline_parallel_size = property(lambda self: self.config.pipeline_parallel_size)

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- submission -------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None, *,
               request_id: Optional[str] = None, client: Optional[str] = None,
               share_prefill_with: Optional[str] = None) -> str:
        """Queue a request; returns its id. Invalid input raises InvalidRequestError here.
        `client` keys fair admission (an API key's identity or an address; None: anonymous).
        `share_prefill_with`: the id of a live request whose prompt starts the same way (n > 1:
        the same prompt; a batch's prompts: the same context): this one waits until that prompt
        is cached, copies the KV of the tokens they share instead of prefilling them again, and
        prefills the rest."""
        if self._closed:
            raise ServerClosedError("the server is shut down; no new requests are accepted")
        self._check_engine()
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}",
                                      param="params")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}",
                                      param="request_id")
        if client is not None and not isinstance(client, str):
            raise InvalidRequestError(f"client must be a string or None, got {type(client).__name__}",
                                      param="client")
        prompt_ids = self.check(prompt, params)
        detok = (IncrementalDetokenizer(self._tok, prompt_ids) if self._tok is not None else None)
        with self._lock:
            if self._closed:
                raise ServerClosedError("the server is shut down; no new requests are accepted")
            self._check_engine()
            if request_id is None:
                request_id = self._outputs.unused_id()
            req = Request(request_id, prompt_ids, params, detok, self.eos_token_ids, client)
            if share_prefill_with is not None:
                parent = self._outputs.find(share_prefill_with)
                if parent is not None and parent.prompt_token_ids[:1] == prompt_ids[:1]:
                    req.fork_of = parent
            self._outputs.add(req)  # raises if the id is in use
            self._engine.add_request(req)
        return request_id

    def check(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids when submit(prompt, params) would accept them; otherwise the
        InvalidRequestError submit would raise. Lets a caller check a batch whole before any of it
        is queued."""
        prompt_ids = self._validator.prompt_ids(prompt)
        self._validator.check(prompt_ids, params)
        return prompt_ids

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
                raise InvalidRequestError(f"params has {len(per_prompt)} entries for {len(prompts)} prompts",
                                          param="params")
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
            self._engine.abort_request(req)  # wakes the loop: a freed slab may let a request in
            self._outputs.publish([req])
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
                "waiting": sched.num_waiting + eng.num_held,
                "running": sched.num_running,
                "finished": eng.num_finished,
                "n_slots": self.n_slots,
                "slots_reserved": sched.n_rsrv,
                "slots_used": eng.slots_used,
                "slots_allocated": sched.slots_allocated,  # prefix cache entries: prefix_cache.cached_tokens
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
                "workers": eng.executor.describe_workers(),
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "prefill_only_tokens": self.prefill_only_tokens,
                "batch_invariant": self.batch_invariant,
                "compactions": eng.num_compactions,
                "compaction_moved_bytes": eng.compaction_moved_bytes,
                "prefix_cache": self._prefix_cache_stats(),
            }

    def health(self) -> Optional[str]:
        """None while the server can serve; otherwise why not (closed, or a worker failed). Reads
        two fields without the engine lock, so a health probe never waits for an iteration."""
        if self._closed:
            return "server closed"
        return self._engine.executor.error

    def _prefix_cache_stats(self) -> Optional[dict]:
        """The prefix cache's counters (None when prefix caching is off); lock held."""
        cache = self._engine.scheduler.prefix_cache
        if cache is None:
            return None
        return {**dataclasses.asdict(cache.stats), "entries": len(cache),
                "cached_tokens": cache.cached_slots, "cached_bytes": cache.cached_slots * self._bytes_per_slot,
                "copied_bytes": self._engine.prefix_copied_bytes, "block_size": cache.block_size}

    def iterations(self) -> list[IterationRecord]:
        """Per-iteration records (only kept with record_iterations=True)."""
        with self._lock:
            return list(self._engine.records)

    # -- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the loop; every unfinished request ends with finish_reason='abort'. Idempotent."""
        with self._lock:
            self._closed = True
            self._engine.signal()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # The loop ends after its current step. Parallel workers that stopped answering would
            # hold that step up to their timeout: after a while they are stopped, which fails it.
            self._thread.join(SHUTDOWN_WAIT_S if self._engine.executor.wait_timeout is not None else None)
            if self._thread.is_alive():
                self._engine.shutdown()
                self._thread.join()
        with self._lock:
            self._outputs.publish(self._engine.abort_all("abort"))
            self._outputs.report_drops()
        self._engine.shutdown()
        self._restore_modes()

    def _restore_modes(self) -> None:
        """Put back the kernel modes this server replaced, unless a later server (or a caller)
        has set modes since (even equal ones): those stay in force."""
        if modes.current() is self._modes:
            modes.set_modes(self._modes_before)
        self._modes = None   # once: a second shutdown leaves the modes alone

    @property
    def closed(self) -> bool:
        return self._closed

    # -- engine loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self._engine
        while True:
            with self._lock:
                while not self._closed and not engine.has_work():
                    engine.wakeup.wait()
                if self._closed:
                    break
            try:
                started = time.perf_counter()
                engine.step()  # publishes what changed, under the lock
                self._busy_seconds += time.perf_counter() - started  # only the loop thread writes it
            except Exception as exc:  # a bug must not leave callers waiting forever
                log.exception("engine loop error; failing all unfinished requests")
                with self._lock:
                    self._outputs.publish(engine.abort_all("error", f"engine error: {type(exc).__name__}: {exc}"))
        log.debug("engine loop stopped")
