"""`python -m orca_ext serve`: the OpenAI-compatible HTTP server.

The CLI (orca_ext/cli.py) declares the subcommand and calls `add_arguments(parser)` and
`main(args)` here. Engine options (device, dtype, batch size, KV slots, scheduler, ...) come
from orca_ext/options.py, shared with the other subcommands. FastAPI and uvicorn are imported
only when the server starts, so the rest of the command line works without the HTTP extras.
The protections and limits are described in transport.py, guards.py and README's server section.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from typing import Any

from ..config import EngineConfig
from ..options import add_engine_arguments
from . import settings
from .prompt_workers import DEFAULT_PROMPT_JOBS_PER_CLIENT, DEFAULT_PROMPT_THREADS

logger = logging.getLogger(__name__)

API_KEY_ENV = "ORCA_EXT_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: loopback only; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="most requests admitted and unfinished (waiting + running); more get 429 (default 256). "
                        "A completions batch counts one per prompt")
    g.add_argument("--max-queue-per-client", type=int, default=None, metavar="N",
                   help="the most of those one client may hold; more get 429 (default: 3/4 of --max-queue, so "
                        "that one client never fills the queue)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none). "
                        f"Prefer ${API_KEY_ENV}: a command-line key is visible to every user in `ps`")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model folder's or GGUF file's name; "
                        "SmolLM2-135M-Instruct for the default model)")
    g.add_argument("--default-max-tokens", type=int, default=settings.DEFAULT_CHAT_MAX_TOKENS,
                   help="max_tokens of a chat request that gives none (default %(default)d)")
    g.add_argument("--max-body-bytes", type=int, default=settings.DEFAULT_MAX_BODY_BYTES,
                   help="largest accepted request body; larger get 413 (default 1 MiB)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="logging level (default info)")
    g.add_argument("--access-log", action="store_true",
                   help="log a line per request (uvicorn's access log; off by default: refusals and "
                        "rejections are summarised instead, at most one line per 10 s of each kind)")
    g.add_argument("--event-loop", default="auto", choices=settings.EVENT_LOOPS,
                   help="the HTTP event loop: uvloop (libuv) when installed, else asyncio's own (default auto)")
    p = parser.add_argument_group("HTTP protections and limits")
    p.add_argument("--trusted-hosts", type=_names, default=None, metavar="NAMES",
                   help="comma-separated Host names to answer besides loopback ones ('*' = any; "
                        "'*.example.com' = subdomains). Default: a loopback --host answers loopback "
                        "names only (against DNS rebinding), any other --host answers any name")
    p.add_argument("--cors-origins", type=_names, default=None, metavar="ORIGINS",
                   help="comma-separated origins allowed by CORS, e.g. https://app.example.com "
                        "(default: none; browsers then refuse cross-origin calls)")
    p.add_argument("--enable-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (default off; behind --api-key when one is set)")
    p.add_argument("--header-timeout", type=float, default=settings.DEFAULT_HEADER_TIMEOUT, metavar="S",
                   help="seconds a connection gets to send complete request headers (default %(default)g)")
    p.add_argument("--body-timeout", type=float, default=settings.DEFAULT_BODY_TIMEOUT, metavar="S",
                   help="seconds a request gets to send its whole body; then 408 (default %(default)g)")
    p.add_argument("--keep-alive-timeout", type=float, default=settings.DEFAULT_KEEP_ALIVE_TIMEOUT, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default %(default)g)")
    p.add_argument("--max-connections", type=int, default=settings.DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open connections (or running requests) beyond which requests get 503 "
                        "(default %(default)d)")
    p.add_argument("--max-connections-per-client", type=int, default=settings.DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                   metavar="N", help="open connections one client (address, or its /64 for IPv6) may hold; "
                                     "more are refused with 429 (default %(default)d; trusted proxies are exempt)")
    p.add_argument("--unproven-connection-rate", type=float, default=settings.DEFAULT_UNPROVEN_CONNECTION_RATE,
                   metavar="N", help="new connections per second a client may open once it has "
                                     "--max-connections-per-client connections that carried no successful "
                                     "request; the rest wait their turn unread (default %(default)g)")
    p.add_argument("--trusted-proxies", type=_names, default=None, metavar="ADDRESSES",
                   help="comma-separated proxy addresses or CIDR networks, e.g. 10.0.0.0/8,::1: only from "
                        "these peers is X-Forwarded-For used to tell clients apart (its right-most address "
                        "that is not a trusted proxy). Default: none; X-Forwarded-For is ignored")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key (default: behind --api-key when one is set)")
    p.add_argument("--metrics-interval", type=float, default=settings.DEFAULT_METRICS_INTERVAL, metavar="S",
                   help="/metrics is rendered at most once per this many seconds; scrapes in between get "
                        "that snapshot (default %(default)g; 0: every scrape renders)")
    p.add_argument("--probe-rate", type=float, default=settings.DEFAULT_PROBE_RATE, metavar="N",
                   help="/health and /metrics requests per second one client may send (burst 5x); more get "
                        "429 and count against its rejection budget (default %(default)g)")
    p.add_argument("--prompt-threads", type=int, default=DEFAULT_PROMPT_THREADS, metavar="N",
                   help="threads that render chat templates and encode text prompts, off the event loop "
                        "and the engine (default %(default)d)")
    p.add_argument("--prompt-jobs-per-client", type=int, default=DEFAULT_PROMPT_JOBS_PER_CLIENT, metavar="N",
                   help="of those threads, the most one client holds at once; its other prompts wait "
                        "without a thread (default %(default)d)")
    p.add_argument("--shutdown-grace", type=float, default=settings.DEFAULT_SHUTDOWN_GRACE, metavar="S",
                   help="on SIGINT/SIGTERM: seconds running requests get to finish before they are "
                        "ended with an error event (default %(default)g)")


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def build_app(args: argparse.Namespace) -> tuple[Any, Any]:
    """(server, app) from parsed arguments; the caller shuts the server down."""
    from ..server import Server
    from .app import create_app

    config = EngineConfig.from_args(args)
    logger.info("starting the engine for %s with %s", args.model or "the default model", config)
    server = Server(args.model, config=config)
    model_name = args.served_model_name or served_name(args.model, server.model_path)
    try:
        app = create_app(server, model_name=model_name, max_queue=args.max_queue,
                         max_queue_per_client=args.max_queue_per_client, api_key=args.api_key,
                         max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                         body_timeout=args.body_timeout, bind_host=args.host, trusted_hosts=args.trusted_hosts,
                         cors_origins=args.cors_origins, enable_docs=args.enable_docs,
                         trusted_proxies=args.trusted_proxies, public_metrics=args.public_metrics,
                         metrics_interval=args.metrics_interval, probe_rate=args.probe_rate,
                         prompt_threads=args.prompt_threads,
                         prompt_jobs_per_client=args.prompt_jobs_per_client)
    except BaseException:
        server.shutdown()
        raise
    return server, app


def served_name(model: str | None, path: str) -> str:
    """The default `model` name of the API: the default model's name (whichever of its files
    serves it), else the folder's or the GGUF file's name."""
    if model is None:
        from ..default_model import MODEL_NAME

        return MODEL_NAME
    return os.path.basename(os.path.normpath(path))


def main(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"error: `serve` needs the HTTP extras (pip install 'orca_ext[serve]'): {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    per_client = args.max_queue_per_client
    for name, value in (("--max-queue", args.max_queue), ("--max-body-bytes", args.max_body_bytes),
                        ("--max-queue-per-client", 1 if per_client is None else per_client),
                        ("--default-max-tokens", args.default_max_tokens),
                        ("--max-connections", args.max_connections),
                        ("--max-connections-per-client", args.max_connections_per_client)):
        if value < 1:
            logger.error("%s must be >= 1 (got %d)", name, value)
            return 2
    for name, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                        ("--keep-alive-timeout", args.keep_alive_timeout), ("--probe-rate", args.probe_rate),
                        ("--unproven-connection-rate", args.unproven_connection_rate)):
        if not value > 0:
            logger.error("%s must be > 0 (got %g)", name, value)
            return 2
    for name, value in (("--shutdown-grace", args.shutdown_grace), ("--metrics-interval", args.metrics_interval)):
        if not value >= 0:
            logger.error("%s must be >= 0 seconds (got %g)", name, value)
            return 2
    if args.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        logger.error("--event-loop uvloop needs the uvloop package (pip install uvloop), or --event-loop asyncio")
        return 2
    try:
        from .clients import parse_networks

        parse_networks(args.trusted_proxies or ())  # before the model loads: a typo fails at once
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:
        server, app = build_app(args)
    except (ValueError, FileNotFoundError) as exc:  # a bad option or model folder: one line, no traceback
        logger.error("%s", exc)
        return 2
    service = app.state.service
    try:
        from . import transport

        logger.info("serving %r on http://%s:%d/v1 (max queue %d, api key %s)", service.model_name, args.host,
                    args.port, args.max_queue, "required" if args.api_key else "off")
        config = transport.make_config(app, host=args.host, port=args.port, log_level=args.log_level,
                                       header_timeout=args.header_timeout,
                                       keep_alive_timeout=args.keep_alive_timeout,
                                       max_connections=args.max_connections,
                                       max_connections_per_client=args.max_connections_per_client,
                                       unproven_connection_rate=args.unproven_connection_rate,
                                       client_keys=app.state.client_keys,
                                       rejections=service.rejections, access_log=args.access_log,
                                       event_loop=args.event_loop)
        # SIGINT/SIGTERM: drain (stop admitting, a bounded grace, end the rest in-band), then exit 0.
        transport.DrainingServer(config, lambda hurry: service.drain(args.shutdown_grace, hurry)).run()
    finally:
        server.shutdown()
    logger.info("stopped")
    return 0
