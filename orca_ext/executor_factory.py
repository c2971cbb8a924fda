"""The executor factory: from a model argument and a resolved EngineConfig to a running executor,
its tokenizer and its model's spec.

    model object            -> LocalExecutor(the object; CUDA graphs around a CausalLM on CUDA)
    folder, parallel_size 1 -> load it here -> LocalExecutor
    folder, parallel_size>1 -> parse its config here, start tp x pp workers -> DistributedExecutor
    None                    -> the embedded default model's folder, as above

The tokenizer is the one given, else the folder's (a model object has none of its own); without
one the server still serves token-id prompts.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from .config import EngineConfig
from .executor import Executor, LocalExecutor

log = logging.getLogger(__name__)


@dataclass
class Started:
    executor: Executor
    tokenizer: Any             # None: only token-id prompts, no text
    spec: Any                  # ModelSpec
    model_path: Optional[str]  # None for a model object


def is_model_object(model: Any) -> bool:
    return model is not None and not isinstance(model, (str, os.PathLike))


def model_folder(model: Any, quantization: str = "auto") -> str:
    """The folder or GGUF file to load: `model`, or the embedded default model's
    (default_model_source)."""
    if model is None:
        from .default_model import default_model_source

        model = default_model_source(quantization)
    return str(model)


def folder_tokenizer(path: str) -> Any:
    """The folder's tokenizer, or None (with a warning) when it has none."""
    from .models import load_tokenizer

    try:
        return load_tokenizer(path)
    except FileNotFoundError as exc:  # still usable with token-id prompts
        log.warning("%s; only token-id prompts will be accepted and no text is produced", exc)
        return None


def make_executor(model: Any, config: EngineConfig, tokenizer: Any = None) -> Started:
    """Start the executor `config` (resolved) asks for. Call after the process's kernel modes are
    set: CUDA graphs capture the forward, and workers take the modes with them."""
    assert config.is_resolved, "make_executor needs EngineConfig.resolve()'s result"
    if is_model_object(model):
        if config.parallel_size > 1:
            raise ValueError("tensor/pipeline parallelism needs the model folder (each worker loads its own "
                             "shard), not an already loaded model object")
        from .cuda_graphs import with_decode_graphs

        runner = with_decode_graphs(model, config.max_batch_size, enforce_eager=config.enforce_eager)
        return Started(LocalExecutor(runner), tokenizer, model.spec, None)
    path = model_folder(model, config.quantization)
    if config.parallel_size > 1:
        from .distributed.launch import start_workers

        executor, spec = start_workers(path, config)
    else:
        from .cuda_graphs import with_decode_graphs
        from .models import load_model

        log.info("loading %s on %s as %s", path, config.device, config.dtype)
        loaded = load_model(path, device=config.device, dtype=config.dtype, quantization=config.quantization)
        spec = loaded.spec
        executor = LocalExecutor(with_decode_graphs(loaded, config.max_batch_size,
                                                    enforce_eager=config.enforce_eager))
    try:
        if tokenizer is None:
            tokenizer = folder_tokenizer(path)
    except BaseException:
        executor.shutdown()
        raise
    return Started(executor, tokenizer, spec, path)
