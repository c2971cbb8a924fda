"""FastAPI application: OpenAI-compatible completions and chat completions over orca_ext.Server.

Request path of one completion:
  auth (401) -> body read with a size limit (413) -> strict parse (400) -> model name (404)
  -> unsupported options (400) -> admission against --max-queue (429 + Retry-After)
  -> SamplingParams + Server.submit (InvalidRequestError -> 400) -> stream or collect.
Nothing reaches the engine before admission, so malformed or oversize input never costs
engine work. Snapshots come from the Server's asyncio stream (bridge.snapshots); a client
that goes away gets its request aborted, which frees its KV slab at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol
from .bridge import snapshots
from .errors import APIError, bad_request, param_from_engine_message
from .metrics import Metrics

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_CHAT_MAX_TOKENS = 256


def _validation_error(exc: ValidationError) -> APIError:
    """First pydantic error as a 400 naming the field (dotted path, e.g. messages.0.role)."""
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    if err["type"] == "json_invalid":
        return bad_request(f"Malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}",
                           code="invalid_json")
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {loc}", param=loc)
    if err["type"] == "model_type" and not loc:
        return bad_request("The request body must be a JSON object", code="invalid_json")
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter: {loc}", param=loc)
    msg = err["msg"].removeprefix("Value error, ")
    return bad_request(msg if loc and msg.startswith(loc) else f"{loc}: {msg}", param=loc or None)


class _Admission:
    """One admitted request's hold on the queue; closing is idempotent (stream end, disconnect,
    error paths may all try)."""

    def __init__(self, service: "_Service", rid: str, endpoint: str) -> None:
        self.service = service
        self.rid = rid
        self.endpoint = endpoint
        self.submitted = False
        self.finished = False
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.service.inflight -= 1
        self.service.metrics.inflight.set(self.service.inflight)
        if self.service.inflight == 0:
            self.service.metrics.busy_clock.stop()
        if self.submitted and not self.finished:
            # The client is gone (or we failed): free the slab now, not when max_tokens is reached.
            server = self.service.server
            try:
                aborted = server.abort(self.rid)
                self.service.metrics.observe_rejected(self.endpoint, "abort")
                logger.info("request %s aborted (client disconnected or failed; was live: %s)", self.rid, aborted)
                # Collect the final output so the server releases the id now instead of keeping
                # an undelivered output around (abort() finishes the request synchronously).
                server.result(self.rid, timeout=0)
            except (KeyError, TimeoutError):
                pass
            except Exception:  # cleanup runs in finally blocks: never mask the original error
                logger.exception("request %s: abort failed", self.rid)


class _ClosingStreamingResponse(StreamingResponse):
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


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class _Service:
    def __init__(self, server: Any, *, model_name: str, max_queue: int, api_key: str | None,
                 tokenizer: Any, max_body_bytes: int, default_max_tokens: int,
                 max_model_len: int | None, vocab_size: int | None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1 (got {max_queue})")
        self.server = server
        self.model_name = model_name
        self.max_queue = max_queue
        self.api_key = api_key
        self.tokenizer = tokenizer
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.created = protocol.now()
        self.inflight = 0
        self.metrics = Metrics(server.stats)

    # -- checks before admission -------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        too_big = APIError(413, f"Request body over the limit of {limit} bytes", code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # chunked uploads declare no length
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def admit(self, rid: str, endpoint: str) -> _Admission:
        if self.inflight >= self.max_queue:
            raise APIError(429, f"Server busy: {self.inflight} requests in flight (limit --max-queue "
                           f"{self.max_queue}); retry later", code="queue_full", headers={"Retry-After": "1"})
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        if self.inflight == 1:
            self.metrics.busy_clock.start()
        return _Admission(self, rid, endpoint)

    # -- prompts --------------------------------------------------------------------------------

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None:
            raise APIError(500, "chat completions need a tokenizer and this server has none")
        try:
            try:
                from orca_ext.models.loader import apply_chat_template
            except ImportError:
                apply_chat_template = None
            if apply_chat_template is not None:
                rendered = apply_chat_template(self.tokenizer, messages)
            else:
                rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except (ValueError, TypeError, KeyError) as exc:
            raise bad_request(f"messages: the chat template rejected them: {exc}", "messages") from exc
        except Exception as exc:  # jinja2.TemplateError (e.g. "roles must alternate") is the client's
            if type(exc).__module__.startswith("jinja2"):
                raise bad_request(f"messages: the chat template rejected them: {exc}", "messages") from exc
            raise
        if isinstance(rendered, str):
            # The template already wrote the special tokens (BOS, role markers) as text.
            return list(self.tokenizer.encode(rendered, add_special_tokens=False))
        return [int(t) for t in rendered]

    def chat_default_max_tokens(self, prompt_len: int) -> int:
        room = [self.default_max_tokens]
        for limit in (self.max_model_len, getattr(self.server, "n_slots", None)):
            if limit:
                room.append(int(limit) - prompt_len)
        return max(1, min(room))

    # -- engine ---------------------------------------------------------------------------------

    async def submit(self, adm: _Admission, prompt: str | list[int], body: protocol._SamplingFields,
                     max_tokens: int, max_tokens_field: str, prompt_field: str) -> None:
        from orca_ext import InvalidRequestError, SamplingParams, ServerClosedError

        try:
            params = SamplingParams(**body.sampling_kwargs(max_tokens))
            # submit tokenizes string prompts: keep that off the event loop.
            await asyncio.to_thread(self.server.submit, prompt, params, request_id=adm.rid)
        except ServerClosedError as exc:
            raise APIError(503, "The server is shutting down", code="server_closed",
                           headers={"Retry-After": "5"}) from exc
        except InvalidRequestError as exc:
            message = str(exc)
            if max_tokens_field != "max_tokens":  # say it in the client's words
                message = message.replace("max_tokens", max_tokens_field)
            raise bad_request(message, param_from_engine_message(
                str(exc), max_tokens_name=max_tokens_field, prompt_name=prompt_field)) from exc
        adm.submitted = True

    async def collect(self, adm: _Admission, request: Request) -> Any:
        """The final output, or None when the client disconnected first (the caller's
        admission.close() then aborts the request)."""
        stream = snapshots(self.server, adm.rid)

        async def last() -> Any:
            final = None
            async for out in stream:
                final = out
            return final

        result_task = asyncio.ensure_future(last())
        watch_task = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({result_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if result_task not in done:
                logger.info("request %s: client disconnected before the result", adm.rid)
                return None
            final = result_task.result()
        finally:
            watch_task.cancel()
            if not result_task.done():
                result_task.cancel()
        if final is not None and final.finished:
            adm.finished = True
            self.metrics.observe_finished(adm.endpoint, final)
        return final


async def _wait_disconnect(request: Request) -> None:
    # After the body is read, the only message left for this request is http.disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _engine_error(rid: str, out: Any) -> APIError:
    logger.error("request %s failed inside the engine: %s", rid, out.error)
    return APIError(500, f"The engine failed on this request ({rid}): {out.error}", code="engine_error")


def create_app(server: Any, *, model_name: str, max_queue: int = 256, api_key: str | None = None,
               tokenizer: Any = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, max_model_len: int | None = None,
               vocab_size: int | None = None) -> FastAPI:
    """The HTTP app over a running ``orca_ext.Server`` (which the caller owns and shuts down).

    model_name: the only name accepted in the "model" field (others get 404).
    max_queue: most requests admitted and not finished (waiting + running); more get 429.
    api_key: when set, /v1/* require ``Authorization: Bearer <api_key>``.
    tokenizer: for the chat template (default: ``server.tokenizer`` if it has one).
    """
    if tokenizer is None:
        tokenizer = getattr(server, "tokenizer", None)
    if max_model_len is None:
        max_model_len = getattr(server, "max_model_len", None)
    if vocab_size is None:
        vocab_size = getattr(server, "vocab_size", None)
    svc = _Service(server, model_name=model_name, max_queue=max_queue, api_key=api_key, tokenizer=tokenizer,
                   max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens,
                   max_model_len=max_model_len, vocab_size=vocab_size)
    app = FastAPI(title="orca_ext", summary="OpenAI-compatible serving with iteration-level scheduling")
    app.state.service = svc

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        return bad_request(f"{loc}: {err.get('msg', 'invalid request')}", loc or None).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        rid = getattr(request.state, "rid", None)
        logger.error("internal error on %s %s (request %s)", request.method, request.url.path, rid, exc_info=exc)
        return APIError(500, f"Internal server error (request {rid})", code="internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        try:
            stats = await asyncio.to_thread(server.stats)
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "detail": str(exc)}, status_code=503)
        if stats.get("closed"):
            return JSONResponse({"status": "unavailable", "detail": "server closed"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await asyncio.to_thread(svc.metrics.render), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict:
        return protocol.model_card(model_name, svc.created, max_model_len, vocab_size)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        svc.check_auth(request)
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict:
        svc.check_auth(request)
        svc.check_model(name)
        return card()

    async def handle(request: Request, endpoint: str,
                     run: Callable[[Request, Any, _Admission], Awaitable[Response]],
                     model_cls: type, prefix: str) -> Response:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        request.state.rid = rid
        adm: _Admission | None = None
        try:
            svc.check_auth(request)
            raw = await svc.read_body(request)
            try:
                body = model_cls.model_validate_json(raw)
            except ValidationError as exc:
                raise _validation_error(exc) from exc
            svc.check_model(body.model)
            body.check_unsupported()
            adm = svc.admit(rid, endpoint)
            response = await run(request, body, adm)
        except APIError as exc:
            if adm is not None:
                adm.close()
            outcome = {401: "unauthorized", 429: "rejected_queue_full"}.get(exc.status, "invalid")
            if exc.status >= 500:
                outcome = "internal_error"
            svc.metrics.observe_rejected(endpoint, outcome)
            logger.info("request %s: %d %s", rid, exc.status, exc.message)
            response = exc.response()
            response.headers["X-Request-Id"] = rid
            return response
        except asyncio.CancelledError:
            if adm is not None:
                adm.close()
            raise
        except Exception:  # a bug: log it with the request id, answer 500, keep serving
            logger.exception("internal error in request %s", rid)
            if adm is not None:
                adm.close()
            svc.metrics.observe_rejected(endpoint, "internal_error")
            response = APIError(500, f"Internal server error (request {rid})", code="internal_error").response()
        response.headers["X-Request-Id"] = rid
        return response

    async def respond(request: Request, body, adm: _Admission, events, make_body) -> Response:
        """The shared tail of both endpoints: an SSE stream of `events()`, or wait for the final
        output and answer `make_body(out)` as JSON."""
        if body.stream:
            return _ClosingStreamingResponse(_sse_stream(adm, events()), adm.close,
                                             media_type="text/event-stream")
        try:
            out = await svc.collect(adm, request)
        finally:
            adm.close()
        if out is None:  # nobody to answer; 499 is nginx's "client closed request"
            return Response(status_code=499)
        if out.finish_reason == "error":
            raise _engine_error(adm.rid, out)
        return JSONResponse(make_body(out))

    # -- /v1/completions ------------------------------------------------------------------------

    async def run_completion(request: Request, body: protocol.CompletionRequest, adm: _Admission) -> Response:
        max_tokens = body.max_tokens if body.max_tokens is not None else protocol.COMPLETIONS_DEFAULT_MAX_TOKENS
        await svc.submit(adm, body.prompt, body, max_tokens, "max_tokens", "prompt")
        created = protocol.now()
        return await respond(
            request, body, adm, lambda: _completion_events(svc, adm, body, created),
            lambda out: protocol.completion_body(
                adm.rid, created, model_name, out.text, out.finish_reason,
                protocol.usage(len(out.prompt_token_ids), len(out.token_ids)), chunk=False))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completions", run_completion, protocol.CompletionRequest, "cmpl")

    # -- /v1/chat/completions -------------------------------------------------------------------

    async def run_chat(request: Request, body: protocol.ChatCompletionRequest, adm: _Admission) -> Response:
        prompt_ids = await asyncio.to_thread(svc.chat_prompt_ids, body.message_dicts())
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            max_tokens = svc.chat_default_max_tokens(len(prompt_ids))
        await svc.submit(adm, prompt_ids, body, max_tokens, body.max_tokens_field, "messages")
        created = protocol.now()
        return await respond(
            request, body, adm, lambda: _chat_events(svc, adm, body, created),
            lambda out: protocol.chat_body(
                adm.rid, created, model_name, out.text, out.finish_reason,
                protocol.usage(len(out.prompt_token_ids), len(out.token_ids))))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat", run_chat, protocol.ChatCompletionRequest, "chatcmpl")

    return app


# -- server-sent events -------------------------------------------------------------------------

async def _deltas(svc: _Service, adm: _Admission) -> AsyncIterator[tuple[str, Any]]:
    """(new text, snapshot) for every snapshot of the request; marks the admission finished."""
    sent = ""
    async for out in snapshots(svc.server, adm.rid):
        text = out.text
        if text.startswith(sent):
            delta, sent = text[len(sent):], text
        else:  # the engine promises never to take text back; keep what the client has
            logger.warning("request %s: engine text is not an extension of what was streamed", adm.rid)
            delta = ""
        if out.finished:
            adm.finished = True
            svc.metrics.observe_finished(adm.endpoint, out)
        yield delta, out


def _stream_error(adm: _Admission, out: Any) -> str:
    return _sse(_engine_error(adm.rid, out).body())


async def _sse_stream(adm: _Admission, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE events of one request, then `[DONE]`. Headers are already sent, so a bug is reported
    in-band before the stream ends; the admission closes however the stream ends."""
    try:
        async for event in events:
            yield event
        yield _sse("[DONE]")
    except Exception:
        logger.exception("internal error while streaming request %s", adm.rid)
        yield _sse(APIError(500, f"Internal server error (request {adm.rid})", code="internal_error").body())
        yield _sse("[DONE]")
    finally:
        adm.close()


async def _completion_events(svc: _Service, adm: _Admission, body: protocol.CompletionRequest,
                             created: int) -> AsyncIterator[str]:
    model, rid, with_usage = svc.model_name, adm.rid, body.include_usage
    usage_field = {"usage": None} if with_usage else {}
    async for delta, out in _deltas(svc, adm):
        if out.finished and out.finish_reason == "error":
            yield _stream_error(adm, out)
            return
        if delta or out.finished:
            chunk = protocol.completion_body(rid, created, model, delta,
                                             out.finish_reason if out.finished else None, None, chunk=True)
            yield _sse({**chunk, **usage_field})
        if out.finished and with_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": protocol.usage(len(out.prompt_token_ids), len(out.token_ids))})


async def _chat_events(svc: _Service, adm: _Admission, body: protocol.ChatCompletionRequest,
                       created: int) -> AsyncIterator[str]:
    model, rid, with_usage = svc.model_name, adm.rid, body.include_usage
    yield _sse(protocol.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None,
                                   with_usage_field=with_usage))
    async for delta, out in _deltas(svc, adm):
        if out.finished and out.finish_reason == "error":
            yield _stream_error(adm, out)
            return
        if delta:
            yield _sse(protocol.chat_chunk(rid, created, model, {"content": delta}, None,
                                           with_usage_field=with_usage))
        if out.finished:
            yield _sse(protocol.chat_chunk(rid, created, model, {}, out.finish_reason,
                                           with_usage_field=with_usage))
            if with_usage:
                yield _sse(protocol.chat_chunk(rid, created, model, None, None, protocol.usage(
                    len(out.prompt_token_ids), len(out.token_ids)), with_usage_field=True))
