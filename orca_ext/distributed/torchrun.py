"""The one place that reads torchrun's environment: was this process launched by torchrun, and as
which rank. Rank 0 of a torchrun launch is the driver; every other rank is a worker.

Only `os` is imported at module level: the command line asks `is_torchrun_worker()` before
anything heavy is loaded.
"""
from __future__ import annotations

import os
from typing import Mapping

# torchrun's agent sets this for every process it starts; plain torch.distributed jobs do not.
_RUN_ID = "TORCHELASTIC_RUN_ID"
_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TorchrunEnv:
    """The variables torchrun sets for each process it starts."""

    def __init__(self, env: Mapping[str, str] = os.environ):
        self.rank = int(env["RANK"])
        self.world_size = int(env["WORLD_SIZE"])
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
        self.node_rank = int(env.get("GROUP_RANK", "0"))


def launched_by_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    """This process is a rank of a torchrun launch (its agent's run id and rendezvous variables
    are all set)."""
    return _RUN_ID in env and all(k in env for k in _REQUIRED)


def torchrun_env(env: Mapping[str, str] = os.environ) -> TorchrunEnv | None:
    """This process's torchrun rank and world, or None when torchrun did not launch it."""
    return TorchrunEnv(env) if launched_by_torchrun(env) else None


def is_torchrun_worker(env: Mapping[str, str] = os.environ) -> bool:
    """True in a process torchrun started with RANK > 0: it serves as a worker, whatever command
    line it was given (every node may run the same command; rank 0 is the driver)."""
    launch = torchrun_env(env)
    return launch is not None and launch.rank != 0


def torchrun_store(timeout):
    """The store of a torchrun launch (the agent's, or one rank 0 hosts); `timeout` a timedelta."""
    import torch.distributed as dist

    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return store
