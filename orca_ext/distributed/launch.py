"""Starting the workers for a Server with tensor_parallel_size x pipeline_parallel_size > 1."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .driver import DistributedExecutor

log = logging.getLogger(__name__)


@dataclass
class ParallelStart:
    executor: DistributedExecutor
    spec: Any
    tokenizer: Any
    model_path: str
    device: torch.device      # the workers' device type (each worker has its own GPU)
    dtype: torch.dtype


def parallel_device(device: Union[str, torch.device]) -> torch.device:
    """'auto' | 'cpu' | 'cuda' -> the device type every worker uses; a single GPU ('cuda:N')
    cannot hold several workers."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda") or dev.index is not None:
        raise ValueError(f"with tensor or pipeline parallelism device must be 'auto', 'cpu' or 'cuda' "
                         f"(worker w uses cuda:w on its node), got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu'")
    return dev


def explicit_kv_budget(kv_cache_memory: Union[int, str, None]) -> Optional[int]:
    """Bytes of KV cache per worker when the user set them (argument or environment), else None
    (each worker then sizes its pools from its own memory)."""
    from ..resources import KV_MEMORY_ENV, parse_bytes

    source = "kv_cache_memory"
    if kv_cache_memory is None and os.environ.get(KV_MEMORY_ENV):
        kv_cache_memory, source = os.environ[KV_MEMORY_ENV], f"${KV_MEMORY_ENV}"
    if kv_cache_memory is None:
        return None
    try:
        return parse_bytes(kv_cache_memory)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def start_parallel(model: Any, *, device, dtype, tokenizer: Any, tensor_parallel_size: int,
                   pipeline_parallel_size: int, kv_cache_memory=None, batch_invariant: bool = False) -> ParallelStart:
    """Parse the model folder here (the driver), check it can be split, start the workers."""
    from ..models import ModelSpec, load_tokenizer
    from ..models.sharding import check_shardable
    from ..resources import resolve_dtype

    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ValueError("tensor/pipeline parallelism needs the model folder (each worker loads its own "
                         "shard), not an already loaded model object")
    if model is None:
        from ..default_model import default_model_path

        model = default_model_path()
    path = str(model)
    spec = ModelSpec.from_pretrained(path)
    check_shardable(spec, tensor_parallel_size, pipeline_parallel_size)
    dev = parallel_device(device)
    dt = resolve_dtype(dtype, dev)
    budget = explicit_kv_budget(kv_cache_memory)
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(path)
        except FileNotFoundError as exc:
            log.warning("%s; only token-id prompts will be accepted and no text is produced", exc)
    log.info("starting %d workers (tensor_parallel_size=%d x pipeline_parallel_size=%d) for %s on %s as %s",
             tensor_parallel_size * pipeline_parallel_size, tensor_parallel_size, pipeline_parallel_size,
             path, dev, dt)
    from .. import modes

    with modes.using(batch_invariant=batch_invariant):  # the workers take the driver's modes
        executor = DistributedExecutor(path, spec, tensor_parallel_size=tensor_parallel_size,
                                       pipeline_parallel_size=pipeline_parallel_size, device=dev.type,
                                       dtype=str(dt).replace("torch.", ""), kv_cache_memory=budget)
    return ParallelStart(executor, spec, tokenizer, path, dev, dt)
