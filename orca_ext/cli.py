"""Command line: `python -m orca_ext generate|bench|serve` (console script `orca-ext`).

    generate "prompt"   stream one answer to the terminal (chat template applied by default)
    bench [...]         the throughput benchmark (orca_ext/benchmarks/throughput.py): orca vs
                        static vs transformers
    serve [...]         the OpenAI-compatible HTTP server (needs fastapi/uvicorn)
    simulate [...]      serve a trace on simulated hardware, or plan a deployment (orca_ext/sim/)

Engine options are shared by all subcommands through orca_ext/options.py.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Optional, Sequence

from .http import serve
from .config import EngineConfig
from .options import add_engine_arguments

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orca-ext", description="Orca-style LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream the answer to one prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the tokenizer's chat template (default: when it has one)")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("-v", "--verbose", action="store_true", help="log engine progress and print stats")
    add_engine_arguments(gen)

    # Handled before parsing (its options belong to the benchmark's own parser); listed for --help.
    sub.add_parser("bench", add_help=False,
                   help="throughput benchmark: orca vs static vs transformers (see `bench --help`)")

    serve.add_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    sub.add_parser("simulate", add_help=False,
                   help="simulated serving and deployment planning (see `simulate --help`)")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from .errors import InvalidRequestError
    from .sampling import SamplingParams
    from .server import Server

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        server = Server(args.model, config=EngineConfig.from_args(args))
    except (ValueError, FileNotFoundError) as exc:  # a bad option or model folder: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with server:
        tok = server.tokenizer
        prompt: object = args.prompt
        use_chat = args.chat if args.chat is not None else bool(getattr(tok, "chat_template", None))
        if use_chat:
            from .models import apply_chat_template

            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            try:
                text = apply_chat_template(tok, messages)
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            # The rendered template already holds its special tokens: add none.
            prompt = tok.encode(text, add_special_tokens=False)
        t0 = time.perf_counter()
        try:
            rid = server.submit(prompt, params)
        except InvalidRequestError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        shown = ""
        out = None
        for out in server.stream(rid):
            sys.stdout.write(out.text[len(shown):])
            sys.stdout.flush()
            shown = out.text
        sys.stdout.write("\n")
        elapsed = time.perf_counter() - t0
        if out is not None and out.finish_reason == "error":
            print(f"error: {out.error}", file=sys.stderr)
            return 1
        if args.verbose and out is not None:
            print(f"[{len(out.token_ids)} tokens in {elapsed:.2f}s, {len(out.token_ids) / elapsed:.1f} tok/s, "
                  f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .distributed import is_torchrun_worker

    if is_torchrun_worker():  # under torchrun every rank but 0 (the driver) is a worker
        from .distributed.worker import torchrun_main

        torchrun_main()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from .benchmarks.throughput import main as bench_main

        return int(bench_main(argv[1:]) or 0)
    if argv and argv[0] == "simulate":
        from .sim.cli import main as simulate_main

        return simulate_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return int(serve.main(args) or 0)
    raise AssertionError(args.command)  # pragma: no cover - argparse enforces the choices
