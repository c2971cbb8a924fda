"""Device, dtype and KV-memory decisions, made once before a Server starts.

`plan_kv_cache` is pure arithmetic (no environment, no device queries) so every sizing rule is
tested directly; `requested_kv_bytes` and `kv_budget` are the impure steps that read the environment
and the device.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Union

import torch

KV_MEMORY_ENV = "ORCA_EXT_KV_CACHE_MEMORY"
CPU_KV_MEMORY_CAP = 2 << 30      # bytes: CPU default is min(2 GiB, 25% of available RAM)
GPU_KV_MEMORY_FRACTION = 0.9     # GPU default: 90% of the memory free after loading the weights

# The dtype names accepted everywhere (Server, load_model, the command line).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: Union[str, torch.device], *, parallel: bool = False) -> torch.device:
    """'auto' (CUDA when available), 'cpu', 'cuda' or 'cuda:N' -> a torch.device that exists.
    parallel=True (tensor x pipeline parallel workers): the device type every worker uses, since
    worker w takes cuda:w on its node; a single GPU ('cuda:N') cannot hold several workers."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    allowed = "'auto', 'cpu' or 'cuda'" if parallel else "'auto', 'cpu', 'cuda' or 'cuda:N'"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be {allowed}, got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be {allowed}, got {device!r}")
    if parallel and dev.index is not None:
        raise ValueError(f"with tensor or pipeline parallelism device must be {allowed} "
                         f"(worker w uses cuda:w on its node), got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu'")
        if not parallel:
            index = 0 if dev.index is None else dev.index
            if index >= torch.cuda.device_count():
                raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
            dev = torch.device("cuda", index)
    return dev


def resolve_dtype(dtype: Union[str, torch.dtype, None], device: torch.device) -> torch.dtype:
    """A name of DTYPES, a torch dtype among them, or 'auto'/None (bfloat16 on CUDA, float32
    elsewhere). float16 is CUDA only: the CPU kernels have no float16 path."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        resolved = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if resolved not in DTYPES.values():
        raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, DTYPES))}; got {dtype!r}")
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


def requested_kv_bytes(kv_cache_memory: Union[int, str, None]) -> Optional[int]:
    """Bytes of KV cache the user asked for: `kv_cache_memory`, else $ORCA_EXT_KV_CACHE_MEMORY,
    else None (the device default applies). A bad value raises ValueError naming its source."""
    source = "kv_cache_memory"
    if kv_cache_memory is None and os.environ.get(KV_MEMORY_ENV):
        kv_cache_memory, source = os.environ[KV_MEMORY_ENV], f"${KV_MEMORY_ENV}"
    if kv_cache_memory is None:
        return None
    try:
        return parse_bytes(kv_cache_memory)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def kv_budget(kv_cache_memory: Union[int, str, None], device: torch.device) -> int:
    """Bytes for the KV cache: what the user asked for (requested_kv_bytes), else the device
    default."""
    requested = requested_kv_bytes(kv_cache_memory)
    return requested if requested is not None else default_kv_memory(device)


@dataclass(frozen=True)
class KVPlan:
    n_slots: int          # KV cache capacity in tokens
    max_model_len: int    # longest prompt + output a request may have


def plan_kv_cache(*, model_context: int, bytes_per_slot: int, max_batch_size: int,
                  n_slots: Optional[int] = None, max_model_len: Optional[int] = None,
                  budget_bytes: Optional[int] = None) -> KVPlan:
    """KV capacity and context limit from the user's choices and the model.

    model_context: the model's max_position_embeddings. n_slots, when given, is used as is;
    otherwise budget_bytes // bytes_per_slot, but never more than max_batch_size requests of the
    longest allowed length could use at once. max_model_len defaults to min(model_context,
    n_slots); a larger explicit one is kept (submit then names n_slots as the limit).
    """
    if max_model_len is not None and max_model_len > model_context:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={model_context}")
    if n_slots is None:
        if budget_bytes is None:
            raise ValueError("plan_kv_cache needs n_slots or budget_bytes")
        context_cap = max_model_len or model_context
        n_slots = min(budget_bytes // bytes_per_slot, max_batch_size * context_cap)
        if n_slots < 1:
            raise ValueError(f"kv_cache_memory={budget_bytes} bytes holds no KV slot "
                             f"({bytes_per_slot} bytes per slot); give more memory or n_slots")
    if max_model_len is None:
        max_model_len = min(model_context, n_slots)
    return KVPlan(n_slots=n_slots, max_model_len=max_model_len)
