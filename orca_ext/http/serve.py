"""`python -m orca_ext serve`: the OpenAI-compatible HTTP server.

The CLI (orca_ext/cli.py) declares the subcommand and calls `add_arguments(parser)` and
`main(args)` here. Engine options (device, dtype, batch size, KV slots, scheduler, ...) come
from orca_ext/options.py, shared with the other subcommands. FastAPI and uvicorn are imported
only when the server starts, so the rest of the command line works without the HTTP extras.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from ..options import add_engine_arguments, engine_kwargs

logger = logging.getLogger(__name__)

API_KEY_ENV = "ORCA_EXT_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: loopback only; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="most requests admitted and unfinished (waiting + running); more get 429 (default 256)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none)")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model folder's name)")
    g.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a chat request that gives none (default 256)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest accepted request body; larger get 413 (default 1 MiB)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="logging level (default info)")


def build_app(args: argparse.Namespace) -> tuple[Any, Any]:
    """(server, app) from parsed arguments; the caller shuts the server down."""
    from ..server import Server
    from .app import create_app

    kwargs = engine_kwargs(args)
    logger.info("starting the engine with %s", kwargs)
    server = Server(**kwargs)
    model_name = args.served_model_name or os.path.basename(os.path.normpath(server.model_path))
    app = create_app(server, model_name=model_name, max_queue=args.max_queue, api_key=args.api_key,
                     max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens)
    return server, app


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def main(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        print(f"error: `serve` needs the HTTP extras (pip install 'orca_ext[serve]'): {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in (("--max-queue", args.max_queue), ("--max-body-bytes", args.max_body_bytes),
                        ("--default-max-tokens", args.default_max_tokens)):
        if value < 1:
            logger.error("%s must be >= 1 (got %d)", name, value)
            return 2
    server, app = build_app(args)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it; turn that into SystemExit so the
    # `finally` below still shuts the server (and any worker processes) down.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        logger.info("serving '%s' on http://%s:%d/v1 (max queue %d, api key %s)",
                    app.state.service.model_name, args.host, args.port, args.max_queue,
                    "required" if args.api_key else "off")
        # timeout_graceful_shutdown: streams still open at Ctrl-C are cut after a few seconds
        # instead of holding the process until they finish.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        server.shutdown()
    return 0
