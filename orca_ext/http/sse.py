"""Server-sent events of the two streaming endpoints.

Each request's stream is `data: {json}` events built from the Server's snapshots (which carry
the full text so far; the client gets only the new part), then `data: [DONE]`. The response
headers are already sent when streaming starts, so a failure, or the end of a request by the
server's drain at shutdown, is reported in-band as an error event in OpenAI's shape, followed by
[DONE].
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from . import protocol, tool_calls
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


async def _sequence_deltas(adm: Admission, rid: str) -> AsyncIterator[tuple[str, Any]]:
    """(new text, snapshot) for every snapshot of one sequence of the request."""
    sent = ""
    async for out in adm.service.server.stream_async(rid):
        text = out.text
        if text.startswith(sent):
            delta, sent = text[len(sent):], text
        else:  # the engine promises never to take text back; keep what the client has
            logger.warning("request %s: engine text is not an extension of what was streamed", rid)
            delta = ""
        yield delta, out


async def _deltas(adm: Admission) -> AsyncIterator[tuple[int, str, Any]]:
    """(choice index, new text, snapshot) for every snapshot of each of the request's sequences,
    as they come; marks the admission finished when all are."""
    svc = adm.service
    rids = adm.seq_rids
    if len(rids) == 1:
        async for delta, out in _sequence_deltas(adm, rids[0]):
            if out.finished:
                adm.finished = True
                svc.observe_finished(adm, [out])
            yield 0, delta, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, rid: str) -> None:
        try:
            async for delta, out in _sequence_deltas(adm, rid):
                await queue.put((index, delta, out, None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, None, None, exc))
        else:
            await queue.put((index, None, None, None))

    tasks = [asyncio.ensure_future(pump(i, rid)) for i, rid in enumerate(rids)]
    open_streams, finals = len(rids), {}
    try:
        while open_streams:
            index, delta, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                open_streams -= 1
                continue
            if out.finished:
                finals[index] = out
                if len(finals) == len(rids):
                    adm.finished = True
                    svc.observe_finished(adm, [finals[i] for i in range(len(rids))])
            yield index, delta, out
    finally:
        for t in tasks:
            t.cancel()


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
    svc = adm.service
    n = len(adm.seq_rids)
    echo_pending = [bool(body.echo)] * n   # a choice's first chunk carries the prompt (and its logprobs)
    sent_tokens = [0] * n                  # generated tokens whose logprobs were sent
    offset = [0] * n                       # text_offset of the next token
    last: list[Any] = [None] * n           # each sequence's latest snapshot, for the usage
    async for i, delta, out in _deltas(adm):
        if (error := _ended_early(adm, out)) is not None:
            yield error
            return
        if delta or out.finished or echo_pending[i]:
            prompt = body.prompts[adm.prompt_index(i)]
            text = svc.echo_text(prompt, out) + delta if echo_pending[i] else delta
            chunk = protocol.completion_body(rid, created, model, text,
                                             out.finish_reason if out.finished else None, None, chunk=True)
            chunk["choices"][0]["index"] = i
            logprobs = svc.completion_choice_logprobs(body, out, start=sent_tokens[i], prompt=echo_pending[i],
                                                      text_offset=offset[i])
            if logprobs is not None:
                chunk["choices"][0]["logprobs"] = logprobs
                offset[i] += sum(len(t) for t in logprobs["tokens"])
            sent_tokens[i], echo_pending[i] = len(out.token_ids), False
            yield event({**chunk, **usage_field})
        last[i] = out
        if adm.finished and with_usage:
            yield event({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": [], "usage": svc.usage_of(last, adm.per_prompt)})


async def chat_events(adm: Admission, body: protocol.ChatCompletionRequest, created: int) -> AsyncIterator[str]:
    model, rid, with_usage = adm.service.model_name, adm.rid, body.include_usage
    svc = adm.service
    n = len(adm.seq_rids)
    for i in range(n):
        first = protocol.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None,
                                    with_usage_field=with_usage)
        first["choices"][0]["index"] = i
        yield event(first)
    sent_tokens = [0] * n  # generated tokens whose logprobs were sent
    last: list[Any] = [None] * n  # each sequence's latest snapshot, for the usage
    calls = [tool_calls.delta_stream(body) for _ in range(n)]  # None: no tool calls to parse out

    def choice(i: int, chunk: dict, out: Any) -> dict:
        chunk["choices"][0]["index"] = i
        logprobs = svc.chat_choice_logprobs(body, out, sent_tokens[i])
        if logprobs is not None and logprobs["content"]:
            chunk["choices"][0]["logprobs"] = logprobs
        sent_tokens[i] = len(out.token_ids)
        return chunk

    async for i, delta, out in _deltas(adm):
        if (error := _ended_early(adm, out)) is not None:
            yield error
            return
        parser = calls[i]
        deltas = parser.feed(delta, out.finished) if parser is not None else ([{"content": delta}] if delta else [])
        for d in deltas:
            yield event(choice(i, protocol.chat_chunk(rid, created, model, d, None, with_usage_field=with_usage), out))
        last[i] = out
        if out.finished:
            reason = (out.finish_reason if parser is None
                      else tool_calls.finish_reason(out.finish_reason, parser.calls > 0))
            yield event(choice(i, protocol.chat_chunk(rid, created, model, {}, reason,
                                                      with_usage_field=with_usage), out))
        if adm.finished and with_usage:
            yield event(protocol.chat_chunk(rid, created, model, None, None, svc.usage_of(last, adm.per_prompt),
                                            with_usage_field=True))
