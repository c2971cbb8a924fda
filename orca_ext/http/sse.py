"""Server-sent events of the two streaming endpoints.

Each request's stream is `data: {json}` events built from the Server's snapshots (which carry
the full text so far; the client gets only the new part), then `data: [DONE]`. The response
headers are already sent when streaming starts, so a failure, or the end of a request by the
server's drain at shutdown, is reported in-band as an error event in OpenAI's shape, followed by
[DONE].
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from . import protocol
from .errors import engine_error, internal_error, shutdown_error
from .service import Admission

logger = logging.getLogger(__name__)


def event(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """StreamingResponse that runs a cleanup however the response ends, including a
    disconnect before the body generator was ever started (then its finally never runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_response(adm: Admission, events: AsyncIterator[str]) -> StreamingResponse:
    """The SSE response of one admitted request; the admission closes however it ends."""
    return ClosingStreamingResponse(_with_done(adm, events), adm.close, media_type="text/event-stream")


async def _with_done(adm: Admission, events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for e in events:
            yield e
        yield event("[DONE]")
    except Exception:
        logger.exception("internal error while streaming request %s", adm.rid)
        yield event(internal_error(adm.rid).body())
        yield event("[DONE]")
    finally:
        adm.close()


async def _deltas(adm: Admission) -> AsyncIterator[tuple[str, Any]]:
    """(new text, snapshot) for every snapshot of the request; marks the admission finished."""
    svc = adm.service
    sent = ""
    async for out in svc.server.stream_async(adm.rid):
        text = out.text
        if text.startswith(sent):
            delta, sent = text[len(sent):], text
        else:  # the engine promises never to take text back; keep what the client has
            logger.warning("request %s: engine text is not an extension of what was streamed", adm.rid)
            delta = ""
        if out.finished:
            adm.finished = True
            svc.observe_finished(adm, out)
        yield delta, out


def _ended_early(adm: Admission, out: Any) -> str | None:
    """The error event that ends a stream the engine or the server's drain ended, else None."""
    if out.finished and out.finish_reason == "error":
        return event(engine_error(adm.rid, out.error).body())
    if out.finished and out.finish_reason == "abort" and adm.shutdown:
        return event(shutdown_error().body())
    return None


async def completion_events(adm: Admission, body: protocol.CompletionRequest, created: int) -> AsyncIterator[str]:
    model, rid, with_usage = adm.service.model_name, adm.rid, body.include_usage
    usage_field = {"usage": None} if with_usage else {}
    async for delta, out in _deltas(adm):
        if (error := _ended_early(adm, out)) is not None:
            yield error
            return
        if delta or out.finished:
            chunk = protocol.completion_body(rid, created, model, delta,
                                             out.finish_reason if out.finished else None, None, chunk=True)
            yield event({**chunk, **usage_field})
        if out.finished and with_usage:
            yield event({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": [], "usage": protocol.usage(len(out.prompt_token_ids), len(out.token_ids),
                                                                 out.num_cached_tokens)})


async def chat_events(adm: Admission, body: protocol.ChatCompletionRequest, created: int) -> AsyncIterator[str]:
    model, rid, with_usage = adm.service.model_name, adm.rid, body.include_usage
    yield event(protocol.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None,
                                    with_usage_field=with_usage))
    async for delta, out in _deltas(adm):
        if (error := _ended_early(adm, out)) is not None:
            yield error
            return
        if delta:
            yield event(protocol.chat_chunk(rid, created, model, {"content": delta}, None,
                                            with_usage_field=with_usage))
        if out.finished:
            yield event(protocol.chat_chunk(rid, created, model, {}, out.finish_reason,
                                            with_usage_field=with_usage))
            if with_usage:
                yield event(protocol.chat_chunk(rid, created, model, None, None, protocol.usage(
                    len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens), with_usage_field=True))
