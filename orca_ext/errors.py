"""Public exception types (docs/DESIGN.md section 5)."""


class InvalidRequestError(ValueError):
    """A request was rejected at submit; the message names the field and the limit."""


class ServerClosedError(RuntimeError):
    """The server was shut down; no new request is accepted."""


class EngineDeadError(ServerClosedError):
    """A worker process of a parallel server died or raised: the server cannot run requests any
    more (shut it down and start a new one). The message names the worker."""
