"""Starting the workers for a Server with tensor_parallel_size x pipeline_parallel_size > 1."""
from __future__ import annotations

import logging

from ..config import EngineConfig
from .driver import DistributedExecutor

log = logging.getLogger(__name__)


def start_workers(path: str, config: EngineConfig):
    """Parse the model folder here (the driver), check that it can be split, start the workers.
    Returns (DistributedExecutor, ModelSpec). `config` is resolved; its kv_cache_memory, when
    set, is each worker's budget (else each worker sizes its pools from its own memory). The
    workers take this process's kernel modes (modes.py), which the Server has set."""
    from ..models import ModelSpec
    from ..models.sharding import check_shardable

    spec = ModelSpec.from_pretrained(path)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    check_shardable(spec, tp, pp)
    log.info("starting %d workers (tensor_parallel_size=%d x pipeline_parallel_size=%d) for %s on %s as %s",
             tp * pp, tp, pp, path, config.device, config.dtype)
    executor = DistributedExecutor(path, spec, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                   device=config.device.type, dtype=str(config.dtype).replace("torch.", ""),
                                   kv_cache_memory=config.kv_cache_memory, worker_timeout=config.worker_timeout,
                                   heartbeat_interval=config.heartbeat_interval,
                                   heartbeat_timeout=config.heartbeat_timeout,
                                   quantization=config.quantization)
    return executor, spec
