"""Errors of the HTTP layer, rendered in OpenAI's JSON error shape.

Every error response of the server has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``
so that the official ``openai`` client raises its typed exceptions (BadRequestError, ...).
``param`` is the request field at fault, in the endpoint's names; for a request the engine
refused it comes from ``InvalidRequestError.param`` (request_rejected).
"""

from __future__ import annotations

import logging
from typing import Mapping

from fastapi.responses import JSONResponse

from ..errors import InvalidRequestError

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


def request_rejected(exc: InvalidRequestError, field_names: Mapping[str, str] | None = None) -> APIError:
    """400 for a request the engine refused (SamplingParams, the prompt encoder, Server.submit).

    `param` is the engine's field, ``exc.param``, in the endpoint's names: `field_names` maps an
    engine name to the name the client sent (chat: prompt -> messages, and max_tokens ->
    max_completion_tokens when the client sent that). The message keeps the engine's words, whose
    arithmetic is in the engine's names; a renamed field is put in front ("messages: prompt has
    ... tokens"), so the message also names the field of the client's request.
    """
    message = str(exc)
    param = exc.param
    renamed = (field_names or {}).get(param, param)
    if renamed != param and not message.startswith(renamed):
        message = f"{renamed}: {message}"
    return bad_request(message, renamed)
