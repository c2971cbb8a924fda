"""`python -m orca_ext serve`: the OpenAI-compatible HTTP server.

The CLI (orca_ext/cli.py) declares the subcommand and calls `add_arguments(parser)` and
`main(args)` here. Engine options (device, dtype, batch size, KV slots, scheduler, ...) come
from `orca_ext.cli.add_engine_arguments` / `engine_kwargs`, shared with the other subcommands.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

API_KEY_ENV = "ORCA_EXT_API_KEY"


def _has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions  # argparse keeps no public lookup


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from orca_ext.cli import add_engine_arguments

    add_engine_arguments(parser)
    if not _has_option(parser, "--model"):
        parser.add_argument("--model", default=None,
                            help="Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)")
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


def _model_limits(server: Any, model_dir: str) -> tuple[int | None, int | None]:
    """(max_model_len, vocab_size) for /v1/models and chat defaults: what the Server reports,
    else the model's config.json."""
    max_len = getattr(server, "max_model_len", None)
    vocab = getattr(server, "vocab_size", None)
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        max_len = max_len or config.get("max_position_embeddings")
        vocab = vocab or config.get("vocab_size")
    except OSError:
        logger.warning("no config.json in %s: /v1/models will not report limits", model_dir)
    return max_len, vocab


def build_app(args: argparse.Namespace) -> tuple[Any, Any]:
    """(server, app) from parsed arguments; the caller shuts the server down."""
    from orca_ext import Server
    from orca_ext.cli import engine_kwargs

    from .app import create_app

    model_dir = args.model
    if model_dir is None:
        from orca_ext.default_model import default_model_path

        model_dir = str(default_model_path())
    kwargs = dict(engine_kwargs(args))
    kwargs["model"] = model_dir
    logger.info("loading %s with %s", model_dir, {k: v for k, v in kwargs.items() if k != "model"})
    server = Server(**kwargs)
    tokenizer = getattr(server, "tokenizer", None)
    if tokenizer is None:
        from orca_ext.models.loader import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
    max_model_len, vocab_size = _model_limits(server, model_dir)
    model_name = args.served_model_name or os.path.basename(os.path.normpath(model_dir))
    app = create_app(server, model_name=model_name, max_queue=args.max_queue, api_key=args.api_key,
                     tokenizer=tokenizer, max_body_bytes=args.max_body_bytes,
                     default_max_tokens=args.default_max_tokens, max_model_len=max_model_len,
                     vocab_size=vocab_size)
    return server, app


def main(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in (("--max-queue", args.max_queue), ("--max-body-bytes", args.max_body_bytes),
                        ("--default-max-tokens", args.default_max_tokens)):
        if value < 1:
            logger.error("%s must be >= 1 (got %d)", name, value)
            return 2
    server, app = build_app(args)
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
