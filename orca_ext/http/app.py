"""FastAPI application: OpenAI-compatible completions and chat completions over orca_ext.Server.

Request path of one completion (`_handle`):
  Host allow-list (400, guards.py) -> the client's budget for rejected requests (a connection
  already rejected while its client is in debt: 429 after a delay, body unread; rejections.py)
  -> auth (401) -> Content-Type application/json (415)
  -> body read with a size limit (413) and a time limit (408) -> strict parse (400)
  -> model name (404) -> unsupported options (400) -> admission against --max-queue and the
  client's --max-queue-per-client, one place per prompt (429 + Retry-After; 503 while draining)
  -> chat template and prompt encoding (chat), SamplingParams + Server.submit
  (InvalidRequestError -> 400, its param in the endpoint's field names, errors.request_rejected)
  -> stream or collect.
A rejection (4xx other than 429) is charged to the client (clients.py's key) by the body bytes
actually read; one from a client already in debt is answered after the debt's delay, with
Connection: close.
/metrics serves a snapshot at most `metrics_interval` seconds old (metrics_snapshot.py), behind
the API key when one is set unless `public_metrics`. /health and /metrics together take at most
`probe_rate` requests per second from one client (burst 5x). A probe past that rate waits for its
turn (a sleeping coroutine costs nothing), so a client probing in a loop is paced to the rate
instead of being answered as fast as it asks; one that would wait longer than PROBE_MAX_WAIT (it
keeps more probes in flight than the rate serves in that time) gets a 429 that counts against its
rejection budget, and is then held back like a client sending bad requests. A monitor or load
balancer probing every few seconds never notices.
Nothing reaches the engine before admission (service.py). Snapshots come from
`Server.stream_async`; a client that goes away gets its request aborted, which frees its KV slab
at once. A client that goes away while still sending its body is a disconnect (INFO, outcome
"abort"), not a server error. Streaming responses are built in sse.py.

Every client-supplied string that reaches a log line (model names, field names, paths) is logged
with %r, so newlines and terminal escapes cannot forge log records.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import InvalidRequestError
from ..server import Server
from . import protocol, sse, tool_calls
from .buckets import ClientBuckets
from .clients import ClientKeys, client_key
from .errors import APIError, bad_request, engine_error, internal_error, request_rejected, shutdown_error
from .guards import Guards, allowed_hosts
from .metrics_snapshot import MetricsSnapshot
from .prompt_workers import DEFAULT_PROMPT_JOBS_PER_CLIENT, DEFAULT_PROMPT_THREADS
from .rejections import IN_DEBT_MESSAGE, MAX_CLIENTS, RejectionBudget
from .service import Admission, Service, validation_error
from .settings import (DEFAULT_BODY_TIMEOUT, DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_BODY_BYTES,
                       DEFAULT_METRICS_INTERVAL, DEFAULT_PROBE_RATE, PROBE_MAX_WAIT)

logger = logging.getLogger(__name__)

Runner = Callable[[Service, Request, Any, Admission], Awaitable[Response]]


def create_app(server: Server, *, model_name: str, max_queue: int = 256, max_queue_per_client: int | None = None,
               api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, body_timeout: float = DEFAULT_BODY_TIMEOUT,
               bind_host: str | None = None, trusted_hosts: list[str] | None = None,
               cors_origins: list[str] | None = None, enable_docs: bool = False,
               rejections: RejectionBudget | None = None, trusted_proxies: list[str] | None = None,
               public_metrics: bool = False, metrics_interval: float = DEFAULT_METRICS_INTERVAL,
               prompt_threads: int = DEFAULT_PROMPT_THREADS,
               prompt_jobs_per_client: int = DEFAULT_PROMPT_JOBS_PER_CLIENT,
               probe_rate: float = DEFAULT_PROBE_RATE) -> FastAPI:
    """The HTTP app over a running ``orca_ext.Server`` (which the caller owns and shuts down).

    model_name: the only name accepted in the "model" field (others get 404).
    max_queue: most requests admitted and not finished (waiting + running); more get 429. A
    completions batch counts one per prompt.
    max_queue_per_client: the most of those one client (clients.py's key) may hold; more get 429
    (None: three quarters of max_queue, so that one client never fills the queue).
    api_key: when set, /v1/* (and the docs, when enabled) require ``Authorization: Bearer <api_key>``.
    body_timeout: seconds for a whole request body to arrive (408 after that).
    bind_host / trusted_hosts: the Host allow-list (guards.py). With bind_host None the app does
    not know where it is served and checks no Host, unless trusted_hosts is given.
    cors_origins: origins allowed by CORS (None: no CORS headers, so browsers refuse cross-origin calls).
    enable_docs: serve /docs, /redoc and /openapi.json (off by default).
    rejections: the per-client budget for rejected requests (default: rejections.py's limits).
    trusted_proxies: addresses / CIDR networks whose X-Forwarded-For names the client (clients.py);
    the app's ClientKeys is `app.state.client_keys`, and `clients.client_key(request)` is the
    key every per-client limit uses.
    public_metrics: serve /metrics without the API key even when one is set.
    metrics_interval: the most seconds a /metrics snapshot is served for (0: every scrape
    renders, concurrent scrapes still share one rendering).
    prompt_threads / prompt_jobs_per_client: the threads that render chat templates and encode
    text prompts, and the most of them one client holds at once (prompt_workers.py).
    probe_rate: /health + /metrics requests per second one client may send (burst 5x); more wait
    their turn, up to PROBE_MAX_WAIT seconds, and get 429 beyond that.
    The chat template, the context limit and the vocabulary size are the server's.
    """
    svc = Service(server, model_name=model_name, max_queue=max_queue, max_queue_per_client=max_queue_per_client,
                  api_key=api_key,
                  max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens,
                  body_timeout=body_timeout, rejections=rejections, prompt_threads=prompt_threads,
                  prompt_jobs_per_client=prompt_jobs_per_client)
    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="orca_ext", summary="OpenAI-compatible serving with iteration-level scheduling", **docs)
    app.state.service = svc
    app.state.client_keys = ClientKeys(trusted_proxies or ())
    scrapes = MetricsSnapshot(svc.metrics.render, metrics_interval)
    if not probe_rate > 0:
        raise ValueError(f"probe_rate must be > 0 requests per second (got {probe_rate})")
    probes = ClientBuckets(probe_rate, 5 * probe_rate, MAX_CLIENTS)

    async def check_probe(request: Request) -> None:
        """Pace a client's /health or /metrics requests to its probe rate: one past it waits for
        its turn, one that would wait too long is refused (and charged)."""
        client, connection = client_key(request), _connection(request)
        await _hold_back(svc.rejections, client, connection)
        wait = probes.reserve(client, 1.0, PROBE_MAX_WAIT)
        if wait is None:
            svc.rejections.charge(client, 0, connection)
            raise APIError(429, f"Too many /health and /metrics requests from this client in flight (limit "
                           f"{probe_rate:g} per second, waits up to {PROBE_MAX_WAIT:g} s)",
                           code="too_many_probes", headers={"Retry-After": "1"})
        if wait > 0:
            await asyncio.sleep(wait)
    _add_error_handlers(app)
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    hosts = (allowed_hosts(bind_host or "0.0.0.0", trusted_hosts)
             if bind_host is not None or trusted_hosts else None)
    # Added last, so outermost: a foreign Host is refused before CORS and the routes see it.
    app.add_middleware(Guards, allowed=hosts, api_key=api_key if enable_docs else None)

    @app.get("/health")
    async def health(request: Request) -> Response:
        await check_probe(request)
        problem = server.health()  # no engine lock: a probe never waits for an iteration
        if problem is not None:
            return JSONResponse({"status": "unavailable", "detail": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        await check_probe(request)
        if not public_metrics:
            svc.check_auth(request)
        return Response(await scrapes.get(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        svc.check_auth(request)
        return {"object": "list", "data": [svc.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict:
        svc.check_auth(request)
        svc.check_model(name)
        return svc.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(svc, request, "completions", _run_completion, protocol.CompletionRequest, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(svc, request, "chat", _run_chat, protocol.ChatCompletionRequest, "chatcmpl")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error response in OpenAI's shape, whoever raised it."""

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
        logger.error("internal error on %s %r (request %s)", request.method, request.url.path, rid, exc_info=exc)
        return internal_error(rid).response()


async def _handle(svc: Service, request: Request, endpoint: str, run: Runner, model_cls: type,
                  prefix: str) -> Response:
    """The checks and admission every completion request goes through, then `run`; every error
    becomes a response that carries the request id."""
    rid = f"{prefix}-{uuid.uuid4().hex}"
    request.state.rid = rid
    client = client_key(request)
    connection = _connection(request)
    adm: Admission | None = None
    try:
        await _hold_back(svc.rejections, client, connection)
        svc.check_auth(request)
        svc.check_content_type(request)
        raw = await svc.read_body(request)
        try:
            body = protocol.parse_request(model_cls, raw, svc.parse_bounds)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        except InvalidRequestError as exc:  # a list past the server's bound, refused before validation
            raise request_rejected(exc) from exc
        svc.check_model(body.model)
        body.check_unsupported()
        adm = svc.admit(rid, endpoint, client, body.num_prompts)
        try:
            response = await run(svc, request, body, adm)
        except InvalidRequestError as exc:  # refused by the engine's checks, before any engine work
            raise request_rejected(exc, body.field_names) from exc
    except APIError as exc:
        if adm is not None:
            adm.close()
        outcome = {401: "unauthorized", 429: "rejected_queue_full", 503: "shutdown"}.get(exc.status, "invalid")
        if exc.code == "too_many_rejected_requests":
            outcome = "rejected_too_many_errors"
        elif exc.status >= 500 and exc.status != 503:
            outcome = "internal_error"
        elif 400 <= exc.status < 500 and exc.status != 429:
            wait = svc.rejections.delay(client)  # in debt already: this answer waits, then closes
            svc.rejections.charge(client, getattr(request.state, "body_bytes", 0), connection)
            if wait > 0:
                exc.headers = {**exc.headers, "Connection": "close"}
                await asyncio.sleep(wait)
        svc.metrics.observe_rejected(endpoint, outcome)
        # %r: the message quotes client strings (model names, field names).
        svc.logs.rejected.log("request %s from %r: %d %r", rid, client, exc.status, exc.message)
        response = exc.response()
    except ClientDisconnect:  # gone while sending its body: the client's doing, not ours
        if adm is not None:
            adm.close()
        svc.metrics.observe_rejected(endpoint, "abort")
        svc.logs.hung_up.log("request %s: client disconnected while sending its body", rid)
        response = Response(status_code=499)
    except asyncio.CancelledError:
        if adm is not None:
            adm.close()
        raise
    except Exception:  # a bug: log it with the request id, answer 500, keep serving
        logger.exception("internal error in request %s", rid)
        if adm is not None:
            adm.close()
        svc.metrics.observe_rejected(endpoint, "internal_error")
        response = internal_error(rid).response()
    response.headers["X-Request-Id"] = rid
    return response


def _connection(request: Request) -> str:
    """The request's connection as the rejection budget names it ("host:port")."""
    return f"{request.client.host}:{request.client.port}" if request.client else ""


async def _hold_back(budget: RejectionBudget, client: str, connection: str) -> None:
    """429 (after a delay, body unread, Connection: close) for a request on a connection that was
    rejected before while its client is in debt (rejections.py)."""
    wait = budget.hold_back(client, connection)
    if wait > 0:
        await asyncio.sleep(wait)  # a client that retries at once is slowed to the budget's pace
        raise APIError(429, IN_DEBT_MESSAGE, code="too_many_rejected_requests",
                       headers={"Retry-After": str(max(1, round(wait))), "Connection": "close"})


async def _respond(svc: Service, request: Request, body: Any, adm: Admission,
                   events: Callable[[], AsyncIterator[str]], make_body: Callable[[Any], dict]) -> Response:
    """The shared tail of both endpoints: an SSE stream of `events()`, or wait for the final
    output and answer `make_body(out)` as JSON."""
    if body.stream:
        return sse.sse_response(adm, events())
    try:
        out = await svc.collect(adm, request)
    finally:
        adm.close()
    if out is None:  # nobody to answer; 499 is nginx's "client closed request"
        return Response(status_code=499)
    if out.finish_reason == "error":
        raise engine_error(adm.rid, out.error)
    if out.finish_reason == "abort" and adm.shutdown:
        raise shutdown_error()
    return JSONResponse(make_body(out))


async def _run_completion(svc: Service, request: Request, body: protocol.CompletionRequest,
                          adm: Admission) -> Response:
    max_tokens = body.max_tokens if body.max_tokens is not None else protocol.COMPLETIONS_DEFAULT_MAX_TOKENS
    await svc.submit(adm, body.prompts, body, max_tokens, client=client_key(request))
    created = protocol.now()
    return await _respond(
        svc, request, body, adm, lambda: sse.completion_events(adm, body, created),
        lambda out: svc.completion_json(adm, created, body))


async def _run_chat(svc: Service, request: Request, body: protocol.ChatCompletionRequest,
                    adm: Admission) -> Response:
    prompt_ids = await svc.chat_prompt_ids(client_key(request), body.message_dicts(), body.tool_dicts())
    max_tokens = body.requested_max_tokens
    if max_tokens is None:
        max_tokens = svc.chat_default_max_tokens(len(prompt_ids))
    await svc.submit(adm, [prompt_ids], body, max_tokens, client=client_key(request))
    created = protocol.now()
    return await _respond(
        svc, request, body, adm, lambda: sse.chat_events(adm, body, created),
        lambda out: tool_calls.with_tool_calls(body, svc.chat_json(adm, created, body)))
