"""Command-line options of the engine, shared by `generate`, `serve` and `bench`.

`add_engine_arguments(parser)` declares them (including --model) and `engine_kwargs(args)` turns
the parsed values into `Server(**kwargs)` keyword arguments, so every entry point spells each
option one way.
"""
from __future__ import annotations

import argparse

from .resources import DTYPES
from .scheduler import SCHEDULERS
from .server import DEFAULT_BATCH_INVARIANT, DEFAULT_MAX_NUM_BATCHED_TOKENS


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The Server options every subcommand accepts (including --model)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default auto)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights/KV dtype (default auto: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--max-batch-size", type=int, default=32, help="requests per iteration (default 32)")
    g.add_argument("--n-slots", type=int, default=None,
                   help="KV cache capacity in tokens (default: derived from --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget, e.g. 2GiB (default $ORCA_EXT_KV_CACHE_MEMORY, else "
                        "min(2 GiB, 25%% of free RAM) on CPU, 90%% of free GPU memory on GPU)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context, capped to n_slots)")
    g.add_argument("--scheduler", default="orca", choices=list(SCHEDULERS),
                   help="orca = iteration-level scheduling, static = request-level baseline")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (by default decode iterations replay them on CUDA)")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split every layer over this many worker processes, one GPU each (default 1)")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="split the layers into this many pipeline stages, one batch in flight per "
                        "stage (default 1)")
    g.add_argument("--max-num-batched-tokens", type=_budget, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help="tokens per iteration: decodes first, then prompt chunks (chunked prefill); "
                        "'none' runs whole prompts (default auto: 128 on CPU, 2048 on CUDA, at least "
                        "--max-batch-size)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=DEFAULT_BATCH_INVARIANT,
                   help="a request's tokens do not depend on its batch-mates (default: on for CPU, off for CUDA)")
    g.add_argument("--slab-compaction", action=argparse.BooleanOptionalAction, default=True,
                   help="slide live KV slabs together when the queue head only lacks a contiguous run "
                        "(default on)")


def _budget(value: str):
    """--max-num-batched-tokens: a positive integer, 'none' or 'auto'."""
    if value.lower() in ("none", "auto"):
        return None if value.lower() == "none" else "auto"
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, 'none' or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Server(**engine_kwargs(args)) keyword arguments from parsed add_engine_arguments options."""
    return dict(model=args.model, device=args.device, dtype=args.dtype,
                max_batch_size=args.max_batch_size, n_slots=args.n_slots,
                max_model_len=args.max_model_len, scheduler=args.scheduler,
                kv_cache_memory=args.kv_cache_memory, enforce_eager=args.enforce_eager,
                tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size,
                max_num_batched_tokens=args.max_num_batched_tokens,
                batch_invariant=args.batch_invariant, slab_compaction=args.slab_compaction)
