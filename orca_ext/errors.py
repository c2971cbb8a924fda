"""Public exception types (docs/DESIGN.md section 5)."""
from __future__ import annotations

from typing import Optional


class InvalidRequestError(ValueError):
    """A request was rejected at submit.

    `str(exc)` is the message, which names the field and the limit. `param` is the top-level
    request field the rejection is about, in the Python API's names ("max_tokens", "prompt",
    "stop", "stop_token_ids", "params", "request_id", ...), or None when no one field is at fault.
    A front end (the HTTP server) reports `param` in its own field names.
    """

    def __init__(self, message: str, *, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class ServerClosedError(RuntimeError):
    """The server was shut down; no new request is accepted."""


class EngineDeadError(ServerClosedError):
    """A worker process of a parallel server died or raised: the server cannot run requests any
    more (shut it down and start a new one). The message names the worker."""
