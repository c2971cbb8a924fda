"""orca_ext: an Orca-style LLM serving engine (iteration-level scheduling + selective batching).

Public API (docs/DESIGN.md section 5): Server, EngineConfig, SamplingParams, RequestOutput, IterationRecord,
InvalidRequestError, ServerClosedError, EngineDeadError. Names are imported lazily so that `import orca_ext._C`
or the kernels alone do not pull in transformers.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import EngineDeadError, InvalidRequestError, ServerClosedError

__version__ = "0.1.0"

_LAZY = {
    "Server": "orca_ext.server",
    "EngineConfig": "orca_ext.config",
    "SamplingParams": "orca_ext.sampling",
    "RequestOutput": "orca_ext.request",
    "IterationRecord": "orca_ext.request",
}

__all__ = ["Server", "EngineConfig", "SamplingParams", "RequestOutput", "IterationRecord", "InvalidRequestError",
           "ServerClosedError", "EngineDeadError", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from .config import EngineConfig
    from .request import IterationRecord, RequestOutput
    from .sampling import SamplingParams
    from .server import Server


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'orca_ext' has no attribute {name!r}")
