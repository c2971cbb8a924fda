"""Command line: `python -m orca_ext generate|bench|serve` (console script `orca-ext`).

    generate "prompt"   stream one answer to the terminal (chat template applied by default)
    bench [...]         the throughput benchmark (bench/throughput.py): orca vs static vs transformers
    serve [...]         the OpenAI-compatible HTTP server (needs fastapi/uvicorn)

Engine options are shared by all subcommands through `add_engine_arguments` / `engine_kwargs`.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger(__name__)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The Server options every subcommand accepts (including --model)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default auto)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights/KV dtype (default auto: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--max-batch-size", type=int, default=32, help="requests per iteration (default 32)")
    g.add_argument("--n-slots", type=int, default=None,
                   help="KV cache capacity in tokens (default: derived from --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget, e.g. 2GiB (default $ORCA_EXT_KV_CACHE_MEMORY, else "
                        "min(2 GiB, 25%% of free RAM) on CPU, 90%% of free GPU memory on GPU)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context, capped to n_slots)")
    g.add_argument("--scheduler", default="orca", choices=["orca", "static"],
                   help="orca = iteration-level scheduling, static = request-level baseline")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Server(**engine_kwargs(args)) keyword arguments from parsed add_engine_arguments options."""
    return dict(model=getattr(args, "model", None), device=args.device, dtype=args.dtype,
                max_batch_size=args.max_batch_size, n_slots=args.n_slots,
                max_model_len=args.max_model_len, scheduler=args.scheduler,
                kv_cache_memory=args.kv_cache_memory)


def _bench_module():
    """bench/throughput.py of the source tree (the benchmark is not part of the installed package)."""
    path = Path(__file__).resolve().parent.parent / "bench" / "throughput.py"
    if not path.is_file():
        raise SystemExit(f"benchmark script not found at {path}; run from a source checkout")
    spec = importlib.util.spec_from_file_location("orca_ext_bench_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

    # Handled before parsing (its options belong to bench/throughput.py); listed for --help.
    sub.add_parser("bench", add_help=False,
                   help="throughput benchmark: orca vs static vs transformers (see `bench --help`)")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from .http.serve import add_arguments
    except ImportError as exc:  # fastapi/uvicorn missing: the other subcommands still work
        serve.set_defaults(serve_error=str(exc))
    else:
        add_arguments(serve)
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
    with Server(**engine_kwargs(args)) as server:
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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return int(_bench_module().main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        if getattr(args, "serve_error", None):
            print(f"error: `serve` needs the HTTP extras (fastapi, uvicorn): {args.serve_error}", file=sys.stderr)
            return 2
        from .http.serve import main as serve_main

        return int(serve_main(args) or 0)
    raise AssertionError(args.command)  # pragma: no cover - argparse enforces the choices
