"""Public exception types (docs/DESIGN.md section 5)."""


class InvalidRequestError(ValueError):
    """A request was rejected at submit; the message names the field and the limit."""


class ServerClosedError(RuntimeError):
    """The server was shut down; no new request is accepted."""
