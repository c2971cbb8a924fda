"""Errors of the HTTP layer, rendered in OpenAI's JSON error shape.

Every error response of the server has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``
so that the official ``openai`` client raises its typed exceptions (BadRequestError, ...).
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

# OpenAI's error "type" per status code (the client keys on the status, humans on the type).
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error that becomes one HTTP response in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error(rid: str) -> APIError:
    """A bug on our side while serving request `rid` (the details go to the log, not the client)."""
    return APIError(500, f"Internal server error (request {rid})", code="internal_error")


def engine_error(rid: str, error: str | None) -> APIError:
    """The engine finished request `rid` with finish_reason 'error'."""
    logger.error("request %s failed inside the engine: %r", rid, error)
    return APIError(500, f"The engine failed on this request ({rid}): {error}", code="engine_error")


def shutdown_error() -> APIError:
    """The server's drain ended this request before it finished."""
    return APIError(503, "The server shut down before this request finished", code="server_shutting_down")


# Field names the engine's InvalidRequestError messages may start with or mention, in the
# order we look for them; used to fill "param" for errors raised inside Server.submit.
_ENGINE_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "stop",
    "seed",
    "ignore_eos",
    "prompt",
    "request_id",
)


def param_from_engine_message(message: str, *, max_tokens_name: str = "max_tokens",
                              prompt_name: str = "prompt") -> str | None:
    """Best guess of the request field an engine validation message is about.

    The engine names the field in its message (docs/DESIGN.md section 5) but has no structured
    field attribute; the earliest mention wins ("prompt length + max_tokens ..." is about
    the prompt as much as max_tokens: max_tokens wins, being the one a client can change).
    """
    lowered = message.lower()
    if "max_tokens" in lowered:
        # Length limits mention both prompt and max_tokens; max_tokens is what a client can lower.
        return max_tokens_name
    best: tuple[int, str] | None = None
    for name in _ENGINE_FIELDS:
        pos = lowered.find(name)
        # "stop" also matches inside "stop_token_ids": the longer name comes first above and
        # an equal position keeps the first (longer) match.
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, name)
    if best is None:
        if "token id" in lowered or "empty" in lowered:
            return prompt_name
        return None
    name = best[1]
    if name == "max_tokens":
        return max_tokens_name
    if name == "prompt":
        return prompt_name
    return name
