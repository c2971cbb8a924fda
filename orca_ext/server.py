"""Server: the public entry point (docs/DESIGN.md section 5).

One background thread runs the engine loop; any number of user threads and asyncio tasks submit,
stream, wait and abort concurrently. All request state is guarded by one lock; the loop releases
it while the model runs. Waiters sleep on per-request conditions (threads) or are woken through
`loop.call_soon_threadsafe` (asyncio), so nothing ever polls.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import threading
import time
import uuid
from typing import Any, AsyncIterator, Iterator, Optional, Sequence, Union

import torch

from .detokenizer import IncrementalDetokenizer
from .engine import Engine
from .errors import InvalidRequestError, ServerClosedError
from .request import IterationRecord, Request, RequestOutput
from .sampling import SamplingParams
from .scheduler import make_scheduler

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]

KV_MEMORY_ENV = "ORCA_EXT_KV_CACHE_MEMORY"
CPU_KV_MEMORY_CAP = 2 << 30      # bytes: CPU default is min(2 GiB, 25% of available RAM)
GPU_KV_MEMORY_FRACTION = 0.9     # GPU default: 90% of the memory free after loading the weights
DEFAULT_MAX_UNDELIVERED = 4096   # finished outputs nobody has collected yet

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- configuration helpers -----------------------------------------------------------------------
def resolve_device(device: Union[str, torch.device]) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu'")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


def resolve_dtype(dtype: Union[str, torch.dtype], device: torch.device) -> torch.dtype:
    if isinstance(dtype, str) and dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str) and dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, _DTYPES))}; got {dtype!r}")
    if resolved not in _DTYPES.values():
        raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, _DTYPES))}; got {dtype!r}")
    if device.type == "cpu" and resolved == torch.float16:
        raise ValueError("dtype='float16' is not supported on cpu; use 'float32' or 'bfloat16'")
    return resolved


def parse_bytes(value: Union[str, int]) -> int:
    """'2GiB', '512M', '1e9' or an int -> bytes."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(i?[bB]?)\s*", str(value))
        if not m:
            raise ValueError(f"cannot parse a memory size from {value!r} (e.g. '2GiB', '512M', 1000000)")
        unit = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
        n = int(float(m.group(1)) * unit)
    if n < 1:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return n


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_memory(device: torch.device) -> int:
    """KV budget when neither kv_cache_memory nor $ORCA_EXT_KV_CACHE_MEMORY is given."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_KV_MEMORY_FRACTION)
    return min(CPU_KV_MEMORY_CAP, available_ram() // 4)


class _LockedTokenizer:
    """Serialises tokenizer calls: HF fast tokenizers may raise 'Already borrowed' when encode
    (which resets truncation/padding state) runs concurrently with another call."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer.encode(text))

    def decode(self, ids, **kwargs) -> str:
        with self._lock:
            return self.tokenizer.decode(ids, **kwargs)


def _is_token_list(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


# -- the server ---------------------------------------------------------------------------------
class Server:
    """An Orca serving engine with a background loop thread. See docs/DESIGN.md section 5.

    Extensions beyond the contract: `model` may also be an already loaded model object (with the
    models seam interface), `tokenizer` overrides the folder's tokenizer, `kv_cache_memory`
    (bytes or '2GiB'; default $ORCA_EXT_KV_CACHE_MEMORY, else min(2 GiB, 25% of available RAM) on
    CPU and 90% of the free GPU memory after loading the weights) sizes `n_slots` when it is None,
    and `max_undelivered_outputs` bounds the finished outputs kept for callers.
    """

    def __init__(self, model: Any = None, *, device: Union[str, torch.device] = "auto",
                 dtype: Union[str, torch.dtype] = "auto", max_batch_size: int = 32,
                 n_slots: Optional[int] = None, max_model_len: Optional[int] = None,
                 scheduler: str = "orca", record_iterations: bool = False,
                 tokenizer: Any = None, kv_cache_memory: Union[int, str, None] = None,
                 max_undelivered_outputs: int = DEFAULT_MAX_UNDELIVERED):
        _check_positive("max_batch_size", max_batch_size)
        _check_positive("max_undelivered_outputs", max_undelivered_outputs)
        if n_slots is not None:
            _check_positive("n_slots", n_slots)
        if max_model_len is not None:
            _check_positive("max_model_len", max_model_len)
        if scheduler not in ("orca", "static"):
            raise ValueError(f"scheduler must be 'orca' or 'static', got {scheduler!r}")

        self.model_path: Optional[str] = None
        if model is None or isinstance(model, (str, os.PathLike)):
            from .models import load_model, load_tokenizer

            if model is None:
                from .default_model import default_model_path

                model = default_model_path()
            self.model_path = str(model)
            dev = resolve_device(device)
            dt = resolve_dtype(dtype, dev)
            log.info("loading %s on %s as %s", self.model_path, dev, dt)
            self.model = load_model(self.model_path, device=dev, dtype=dt)
            if tokenizer is None:
                try:
                    tokenizer = load_tokenizer(self.model_path)
                except FileNotFoundError as exc:  # still usable with token-id prompts
                    log.warning("%s; only token-id prompts will be accepted and no text is produced", exc)
        else:  # an already loaded model object: it decides device and dtype
            self.model = model
            if tokenizer is None:
                tokenizer = getattr(model, "tokenizer", None)
        spec = self.model.spec
        self.device: torch.device = torch.device(self.model.device)
        self.dtype: torch.dtype = self.model.dtype
        self.tokenizer = tokenizer
        self._tok = _LockedTokenizer(tokenizer) if tokenizer is not None else None
        self.vocab_size: int = int(spec.vocab_size)
        eos = set(spec.eos_token_ids or ())
        tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if isinstance(tok_eos, int):
            eos.add(tok_eos)
        self.eos_token_ids = frozenset(eos)

        # KV capacity and context limit.
        max_pos = int(spec.max_position_embeddings)
        if max_model_len is not None and max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        context_cap = max_model_len or max_pos
        if n_slots is None:
            source = "kv_cache_memory"
            if kv_cache_memory is None and os.environ.get(KV_MEMORY_ENV):
                kv_cache_memory, source = os.environ[KV_MEMORY_ENV], f"${KV_MEMORY_ENV}"
            try:
                budget = (parse_bytes(kv_cache_memory) if kv_cache_memory is not None
                          else default_kv_memory(self.device))
            except ValueError as exc:
                raise ValueError(f"{source}: {exc}") from None
            per_slot = int(self.model.kv_bytes_per_slot())
            # More slots than max_batch_size full-length requests can never be used at once.
            n_slots = min(budget // per_slot, max_batch_size * context_cap)
            if n_slots < 1:
                raise ValueError(f"kv_cache_memory={budget} bytes holds no KV slot "
                                 f"({per_slot} bytes per slot); give more memory or n_slots")
            log.info("KV cache: %d slots x %d bytes = %.1f MiB", n_slots, per_slot,
                     n_slots * per_slot / 2**20)
        if max_model_len is None:
            max_model_len = min(max_pos, n_slots)
        elif max_model_len > n_slots:
            log.warning("max_model_len=%d is larger than n_slots=%d; requests are limited to %d tokens",
                        max_model_len, n_slots, n_slots)
        self.n_slots = n_slots
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.scheduler_policy = scheduler
        self.record_iterations = record_iterations
        self._max_undelivered = max_undelivered_outputs

        sched = make_scheduler(scheduler, max_batch_size, n_slots)
        self._engine = Engine(self.model, sched, record_iterations=record_iterations)

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)   # the loop sleeps here when idle
        self._requests: dict[str, Request] = {}        # ids in use
        self._undelivered: collections.OrderedDict[str, Request] = collections.OrderedDict()
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
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt_ids = self._prompt_ids(prompt)
        self._validate(prompt_ids, params)
        detok = (IncrementalDetokenizer(self._tok, prompt_ids) if self._tok is not None else None)
        with self._lock:
            if self._closed:
                raise ServerClosedError("the server is shut down; no new requests are accepted")
            if request_id is None:
                request_id = uuid.uuid4().hex
                while request_id in self._requests:  # pragma: no cover - astronomically unlikely
                    request_id = uuid.uuid4().hex
            elif request_id in self._requests:
                raise InvalidRequestError(f"request_id {request_id!r} is already in use")
            req = Request(request_id, prompt_ids, params, detok, self.eos_token_ids)
            self._requests[request_id] = req
            self._engine.add_request(req)
            self._work.notify()
        return request_id

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            if self._tok is None:
                raise InvalidRequestError("prompt: a text prompt needs a tokenizer; pass token ids")
            ids = self._tok.encode(prompt)
            if not ids:
                raise InvalidRequestError("prompt must not be empty (it encodes to no tokens)")
            return ids
        try:
            ids = list(prompt)
        except TypeError:
            raise InvalidRequestError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}") from None
        if not ids:
            raise InvalidRequestError("prompt must not be empty")
        for i, t in enumerate(ids):
            if hasattr(t, "item") and not isinstance(t, int):  # numpy / torch scalars
                t = t.item()
                ids[i] = t
            if not isinstance(t, int) or isinstance(t, bool):
                raise InvalidRequestError(f"prompt[{i}] must be an integer token id, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids) + params.max_tokens
        if n > self.max_model_len:
            raise InvalidRequestError(
                f"len(prompt) + max_tokens = {len(prompt_ids)} + {params.max_tokens} = {n} exceeds "
                f"max_model_len = {self.max_model_len}")
        if n > self.n_slots:
            raise InvalidRequestError(
                f"len(prompt) + max_tokens = {len(prompt_ids)} + {params.max_tokens} = {n} exceeds "
                f"n_slots = {self.n_slots} (the KV cache capacity)")
        for i, t in enumerate(params.stop_token_ids):
            if t >= self.vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self._tok is None:
            raise InvalidRequestError("stop: stop strings need a tokenizer, and this model has none")

    # -- results ----------------------------------------------------------------------------------
    def _get(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return req

    def result(self, request_id: str, timeout: Optional[float] = None) -> RequestOutput:
        """Block until the request finishes; return its final output (and release its id).
        Raises KeyError for an unknown id, TimeoutError when `timeout` seconds pass first."""
        with self._lock:
            req = self._get(request_id)
            self._consumer_enter(req)
            try:
                deadline = None if timeout is None else time.monotonic() + timeout
                while not req.finished:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"request {request_id!r} did not finish within {timeout} s")
                    self._cond(req).wait(remaining)
                out = req.snapshot()
                self._deliver(req)
                return out
            finally:
                self._consumer_exit(req)

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """Snapshots of the request as it progresses (the full text so far each time); the last one
        has finished=True. Unknown ids raise KeyError here, not at the first iteration."""
        with self._lock:
            req = self._get(request_id)
        return self._stream(req)

    def _stream(self, req: Request) -> Iterator[RequestOutput]:
        seen = 0
        with self._lock:
            self._consumer_enter(req)
        try:
            while True:
                with self._lock:
                    while req.version == seen:
                        self._cond(req).wait()
                    seen = req.version
                    out = req.snapshot()
                    if out.finished:
                        self._deliver(req)
                yield out
                if out.finished:
                    return
        finally:
            with self._lock:
                self._consumer_exit(req)

    def stream_async(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """asyncio twin of stream(): an async iterator of snapshots."""
        with self._lock:
            req = self._get(request_id)
        return self._stream_async(req)

    async def _stream_async(self, req: Request) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify() -> None:  # runs on the engine thread
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the event loop is closed; nobody is listening any more
                pass

        seen = 0
        with self._lock:
            self._consumer_enter(req)
            req.watchers.append(notify)
        try:
            while True:
                out = None
                with self._lock:
                    if req.version != seen:
                        seen = req.version
                        out = req.snapshot()
                        if out.finished:
                            self._deliver(req)
                if out is None:
                    await wake.wait()
                    wake.clear()
                    continue
                yield out
                if out.finished:
                    return
        finally:
            with self._lock:
                req.watchers.remove(notify)
                self._consumer_exit(req)

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
            await outputs.aclose()  # unregister its watcher now, not whenever it is collected
            if not finished:
                self.abort(rid)
                self._discard(rid)

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
                self._discard(rid)
            raise

    def abort(self, request_id: str) -> bool:
        """Stop a waiting or running request: True if it was unfinished. Its slab is freed now
        (or, if its batch is executing, as soon as that batch returns)."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                return False
            self._engine.abort_request(req)
            self._publish([req])
            self._work.notify()  # a freed slab may let a waiting request in
            return True

    # -- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict:
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
                "kv_cache_bytes": self.n_slots * int(self.model.kv_bytes_per_slot()),
                "prompt_tokens": eng.num_prompt_tokens,
                "generated_tokens": eng.num_generated_tokens,
                "undelivered_outputs": len(self._undelivered),
                "closed": self._closed,
                "busy_seconds": self._busy_seconds,  # time spent in engine steps (for iteration-time metrics)
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
            self._thread.join()
        with self._lock:
            self._publish(self._engine.abort_all("abort"))

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
                self._engine.step(self._lock, self._publish)
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
                    self._publish(self._engine.abort_all("error", f"engine error: {type(exc).__name__}: {exc}"))
        log.debug("engine loop stopped")

    # -- delivery bookkeeping (all under self._lock) -------------------------------------------------
    def _cond(self, req: Request) -> threading.Condition:
        if req.cond is None:
            req.cond = threading.Condition(self._lock)
        return req.cond

    def _publish(self, changed: list) -> None:
        for req in changed:
            if req.cond is not None:
                req.cond.notify_all()
            for wake in req.watchers:
                wake()
            if req.finished and req.consumers == 0:
                self._keep_undelivered(req)

    def _consumer_enter(self, req: Request) -> None:
        req.consumers += 1
        if self._undelivered.get(req.request_id) is req:
            del self._undelivered[req.request_id]

    def _consumer_exit(self, req: Request) -> None:
        req.consumers -= 1
        if req.consumers == 0 and req.finished:
            self._keep_undelivered(req)

    def _keep_undelivered(self, req: Request) -> None:
        if req.delivered or self._requests.get(req.request_id) is not req:
            return
        self._undelivered[req.request_id] = req
        while len(self._undelivered) > self._max_undelivered:
            rid, old = self._undelivered.popitem(last=False)
            del self._requests[rid]
            log.warning("dropping the undelivered output of request %r (more than %d finished "
                        "outputs are waiting to be collected)", rid, self._max_undelivered)

    def _deliver(self, req: Request) -> None:
        req.delivered = True
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]
        if self._undelivered.get(req.request_id) is req:
            del self._undelivered[req.request_id]

    def _discard(self, request_id: str) -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None and req.finished:
                self._deliver(req)


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
