"""EngineConfig: every engine option in one validated dataclass (docs/DESIGN.md section 5).

Built from Python arguments (`Server(model, **options)` or `EngineConfig(...)`) or from the
command line (`EngineConfig.from_args`), checked once at construction, and resolved once for the
machine by `resolve()`: 'auto' device and dtype, the chunked-prefill budget, decode-row sharing
and the batch-invariance default per device, and the KV budget from the argument or the environment.
The resolved config is what the Server, the scheduler, the executors and the parallel workers'
start-up message receive; below it no layer checks an option again.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional, Union

import torch

from .checks import check_choice, check_positive_int
from .fairness import ADMISSION_POLICIES, check_kv_cap
from .prefix_cache import DEFAULT_BLOCK_SIZE
from .quant.formats import QUANT_ACTIVATIONS, QUANTIZATION_MODES
from .resources import parse_bytes, requested_kv_bytes, resolve_device, resolve_dtype
from .scheduler import SCHEDULERS

DEFAULT_MAX_UNDELIVERED = 4096   # finished outputs nobody has collected yet
DEFAULT_WORKER_TIMEOUT_S = 600.0       # parallel workers: one batch's result
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0     # parallel workers: between two heartbeats
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0     # parallel workers: silence that fails the server
# Chunked prefill's token budget ("auto"), raised to max_batch_size when that is larger (every
# running request decodes each iteration). CPU: the smallest chunk whose cost per token is within
# ~10% of a whole long prompt's (bench/chunked_prefill.py --cost, bench/RESULTS.md); a CPU forward
# costs in proportion to its tokens, so a smaller budget means shorter stalls for the running
# decodes. CUDA: a forward of a few thousand tokens costs little more than a decode step, so the
# budget is vLLM's online-serving default (not measured here yet).
CHUNK_BUDGET_BY_DEVICE = {"cpu": 128, "cuda": 2048}
# The token budget of an iteration without decodes ("auto", FCFS admission): no request has begun
# generating, so a larger chunk stalls no stream, and it streams the weights fewer times per
# prompt. CPU: 512 (llama.cpp's default micro-batch) ran a lone 512-token prompt 1.10-1.17x as fast as
# chunks of 128 (bench/RESULTS.md); a request that arrives meanwhile waits for at most that chunk.
# CUDA: the chunk budget already is a few thousand tokens.
PREFILL_ONLY_BUDGET_BY_DEVICE = {"cpu": 512, "cuda": 2048}


def check_prefill_only_budget(prefill_only: int, budget: int) -> None:
    """An iteration without decodes may take more prompt tokens than one with them, never fewer."""
    if prefill_only < budget:
        raise ValueError(f"prefill_only_tokens ({prefill_only}) must be >= max_num_batched_tokens ({budget})")


def default_share_decode_rows(device_type: str) -> bool:
    """Fair admission holds a client that is ahead to the others' decode rows on CPU, where every
    row lengthens the iteration; not on CUDA, where a decode step's time hardly grows with its rows
    until the batch is large, so holding rows back would cost that client without helping others."""
    return device_type == "cpu"


def default_batch_invariant(device: torch.device) -> bool:
    """On for CPU, where it costs about 3% of throughput (bench/batch_invariance.py); off for
    CUDA until its cost there is measured."""
    return device.type == "cpu"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's options. Fields typed `X | 'auto' | None` are final after `resolve()`."""

    device: Union[str, torch.device] = "auto"           # 'auto' | 'cpu' | 'cuda' | 'cuda:N'
    dtype: Union[str, torch.dtype] = "auto"             # 'auto' | 'float32' | 'bfloat16' | 'float16'
    max_batch_size: int = 32                            # requests per iteration
    n_slots: Optional[int] = None                       # KV capacity in tokens (None: from the budget)
    max_model_len: Optional[int] = None                 # longest prompt + output (None: the model's)
    scheduler: str = "orca"                             # 'orca' (Algorithm 1) | 'static' (baseline)
    record_iterations: bool = False                     # keep an IterationRecord per iteration
    kv_cache_memory: Union[int, str, None] = None       # bytes or '2GiB'; resolved to bytes or None
    max_undelivered_outputs: int = DEFAULT_MAX_UNDELIVERED
    enforce_eager: bool = False                         # no CUDA graphs for decode iterations
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_num_batched_tokens: Union[int, str, None] = "auto"  # chunked prefill budget; None: whole prompts
    # the budget of an iteration without decodes (only prompts run); None: max_num_batched_tokens
    prefill_only_tokens: Union[int, str, None] = "auto"
    batch_invariant: Optional[bool] = None              # None: per device (default_batch_invariant)
    slab_compaction: bool = True                        # slide live slabs together when fragmented
    worker_timeout: float = DEFAULT_WORKER_TIMEOUT_S    # parallel workers: longest wait for one batch
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S  # parallel workers: seconds between heartbeats
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S    # parallel workers: silence that fails the server
    admission: str = "fcfs"                             # 'fcfs' (Algorithm 1) | 'fair' (per-client shares)
    # fair: the KV slots one client may reserve while another is present: a share of the slots
    # (float in (0, 1]), a count (int), 'auto' (fairness.DEFAULT_KV_SHARE) or None (no cap)
    max_kv_per_client: Union[int, float, str, None] = "auto"
    # fair: a client ahead of another takes decode rows worth no more per iteration than the others'
    # (None: per device, default_share_decode_rows)
    share_decode_rows: Optional[bool] = None
    prefix_caching: bool = True                         # reuse finished requests' KV for shared prompt prefixes
    prefix_cache_block_size: int = DEFAULT_BLOCK_SIZE   # tokens per key of the prefix index
    quantization: str = "auto"                          # GGUF weights: 'auto' (blocks as stored) | 'none' (dequantize)
    quant_activations: str = "auto"                     # CPU products of GGUF blocks: 'auto' | 'float32' | 'int8'

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_undelivered_outputs", "tensor_parallel_size",
                     "pipeline_parallel_size", "prefix_cache_block_size"):
            check_positive_int(name, getattr(self, name))
        for name in ("n_slots", "max_model_len"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_choice("scheduler", self.scheduler, SCHEDULERS)
        check_choice("admission", self.admission, ADMISSION_POLICIES)
        check_choice("quantization", self.quantization, QUANTIZATION_MODES)
        check_choice("quant_activations", self.quant_activations, QUANT_ACTIVATIONS)
        if self.admission == "fair" and self.scheduler != "orca":
            raise ValueError(f"admission='fair' needs scheduler='orca', got scheduler={self.scheduler!r}")
        check_kv_cap("max_kv_per_client", self.max_kv_per_client)
        if self.max_kv_per_client not in ("auto", None) and self.admission != "fair":
            raise ValueError(f"max_kv_per_client={self.max_kv_per_client!r} needs admission='fair' "
                             "(FCFS admits in arrival order only)")
        for name in ("record_iterations", "enforce_eager", "slab_compaction", "prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("batch_invariant", "share_decode_rows"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True, False or None (per device), got {getattr(self, name)!r}")
        if self.share_decode_rows and self.admission != "fair":
            raise ValueError("share_decode_rows=True needs admission='fair' (FCFS takes every running request)")
        budget = self.max_num_batched_tokens
        if budget is not None and budget != "auto":
            check_positive_int("max_num_batched_tokens", budget)
            if self.scheduler == "orca" and budget < self.max_batch_size:
                raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_batch_size "
                                 f"({self.max_batch_size}): every running request decodes one token per iteration")
        prefill_only = self.prefill_only_tokens
        if prefill_only is not None and prefill_only != "auto":
            check_positive_int("prefill_only_tokens", prefill_only)
            if isinstance(budget, int):
                check_prefill_only_budget(prefill_only, budget)
        for name in ("worker_timeout", "heartbeat_interval", "heartbeat_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError(f"heartbeat_interval ({self.heartbeat_interval}) must be below heartbeat_timeout "
                             f"({self.heartbeat_timeout})")
        if self.kv_cache_memory is not None:
            try:
                parse_bytes(self.kv_cache_memory)
            except ValueError as exc:
                raise ValueError(f"kv_cache_memory: {exc}") from None

    # -- derived -------------------------------------------------------------------------------
    @property
    def parallel_size(self) -> int:
        """Worker processes: tensor_parallel_size x pipeline_parallel_size (1: this process)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_resolved(self) -> bool:
        return (isinstance(self.device, torch.device) and isinstance(self.dtype, torch.dtype)
                and self.max_num_batched_tokens != "auto" and self.prefill_only_tokens != "auto"
                and self.batch_invariant is not None
                and self.share_decode_rows is not None
                and (self.kv_cache_memory is None or isinstance(self.kv_cache_memory, int)))

    def resolve(self, model: Any = None) -> "EngineConfig":
        """This config with every 'auto' and per-device default decided for this machine.
        `model`: an already loaded model object, whose device and dtype then win."""
        if model is not None:
            device, dtype = torch.device(model.device), model.dtype
        else:
            device = resolve_device(self.device, parallel=self.parallel_size > 1)
            dtype = resolve_dtype(self.dtype, device)
        invariant = default_batch_invariant(device) if self.batch_invariant is None else self.batch_invariant
        return dataclasses.replace(self.scheduling_for(device.type), device=device, dtype=dtype,
                                   batch_invariant=invariant, kv_cache_memory=requested_kv_bytes(self.kv_cache_memory))

    def scheduling_for(self, device_type: str) -> "EngineConfig":
        """This config with the scheduler's per-device defaults decided for `device_type` ('cpu' or
        'cuda'): the chunk budgets and decode-row sharing. Touches no device, so the simulator can
        price one that need not exist here."""
        budget = self.max_num_batched_tokens
        if self.scheduler != "orca":
            budget = None  # the static baseline runs whole prompts
        elif budget == "auto":
            budget = max(CHUNK_BUDGET_BY_DEVICE[device_type], self.max_batch_size)
        prefill_only = self.prefill_only_tokens
        if budget is None or prefill_only is None:
            prefill_only = budget
        elif prefill_only == "auto":
            # Fair admission keeps every chunk to the budget: a client's request that arrives
            # while another client's prompt runs alone waits for one chunk.
            fair = self.admission == "fair"
            prefill_only = budget if fair else max(PREFILL_ONLY_BUDGET_BY_DEVICE[device_type], budget)
        else:
            check_prefill_only_budget(prefill_only, budget)
        share_rows = self.share_decode_rows
        if share_rows is None:
            share_rows = self.admission == "fair" and default_share_decode_rows(device_type)
        return dataclasses.replace(self, max_num_batched_tokens=budget, prefill_only_tokens=prefill_only,
                                   share_decode_rows=share_rows)

    # -- the command line ----------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """From options declared by orca_ext.options.add_engine_arguments."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

