"""Tensor x pipeline parallel execution on torch.distributed (see docs/DISTRIBUTED.md).

`DistributedExecutor` (driver.py) is the engine's executor when tensor_parallel_size or
pipeline_parallel_size is above 1; `worker.py` is the worker process; `messages.py` the
control-plane tensors; `groups.py` the process groups and their helpers; `launch.py` starts the
workers for a Server. Names are imported lazily: the command line checks `is_torchrun_worker`
before anything heavy is imported.
"""
from __future__ import annotations

import importlib
import os

__all__ = ["DistributedExecutor", "WorkerFailedError", "is_torchrun_worker"]


def is_torchrun_worker() -> bool:
    """True in a process torchrun started with RANK > 0: it serves as a worker, whatever command
    line it was given (every node may run the same command; rank 0 is the driver)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("RANK", "0") != "0"


def __getattr__(name: str):
    if name in ("DistributedExecutor", "WorkerFailedError"):
        value = getattr(importlib.import_module(".driver", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
