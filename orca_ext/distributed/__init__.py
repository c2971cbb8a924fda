"""Tensor x pipeline parallel execution on torch.distributed (see docs/DISTRIBUTED.md).

`DistributedExecutor` (driver.py) is the engine's executor when tensor_parallel_size or
pipeline_parallel_size is above 1: a facade over startup.py (store, processes, handshake),
channel.py (the control group), inflight.py and listener.py (answers), failures.py (root cause)
and stats.py. `worker.py` is the worker process; `messages.py` the control-plane tensors;
`groups.py` the process groups and their helpers; `torchrun.py` what a torchrun launch says about
this process; `launch.py` starts the workers for a Server.

`is_torchrun_worker` is imported eagerly and pulls in nothing but `os`: the command line asks it
before anything heavy is imported. The other names load their modules on first use.
"""
from __future__ import annotations

import importlib

from .torchrun import is_torchrun_worker

__all__ = ["DistributedExecutor", "WorkerFailedError", "is_torchrun_worker"]


def __getattr__(name: str):
    if name in ("DistributedExecutor", "WorkerFailedError"):
        value = getattr(importlib.import_module(".driver", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
