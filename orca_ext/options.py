"""Command-line options of the engine, shared by `generate`, `serve` and `bench`.

`add_engine_arguments(parser)` declares them (including --model), with EngineConfig's defaults;
`EngineConfig.from_args(args)` turns the parsed values into the one config, so every entry
point spells each option one way and checks it one way.
"""
from __future__ import annotations

import argparse

from .config import EngineConfig
from .fairness import ADMISSION_POLICIES, DEFAULT_KV_SHARE
from .quant.formats import QUANT_ACTIVATIONS, QUANTIZATION_MODES
from .resources import DTYPES
from .scheduler import SCHEDULERS

_DEFAULTS = EngineConfig()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine options every subcommand accepts (including --model)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default=_DEFAULTS.device, help="cpu | cuda | cuda:N | auto (default auto)")
    g.add_argument("--dtype", default=_DEFAULTS.dtype, choices=["auto", *DTYPES],
                   help="activation/KV dtype, and the weights' unless they stay quantized "
                        "(default auto: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--quantization", default=_DEFAULTS.quantization, choices=list(QUANTIZATION_MODES),
                   help="GGUF weights: auto = Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K matrices stay as their blocks; "
                        "none = dequantize them to --dtype at load (default auto)")
    g.add_argument("--quant-activations", default=_DEFAULTS.quant_activations, choices=list(QUANT_ACTIVATIONS),
                   help="CPU products of GGUF blocks: float32 activations (the float path's "
                        "numbers), int8 (per 32-block; Q4_K/Q5_K/Q6_K per 256-block) with integer dot "
                        "products as llama.cpp does (faster; perplexity +0.06-0.6%%), or auto = int8 "
                        "for a file mostly of Q8_0 or K-quant blocks, and for a Q4_0/Q4_1 file int8 "
                        "for its Q4_K/Q5_K/Q6_K and float32 for its 32-element blocks (default auto)")
    g.add_argument("--max-batch-size", type=int, default=_DEFAULTS.max_batch_size,
                   help=f"requests per iteration (default {_DEFAULTS.max_batch_size})")
    g.add_argument("--n-slots", type=int, default=_DEFAULTS.n_slots,
                   help="KV cache capacity in tokens (default: derived from --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", default=_DEFAULTS.kv_cache_memory,
                   help="KV cache budget, e.g. 2GiB (default $ORCA_EXT_KV_CACHE_MEMORY, else "
                        "min(2 GiB, 25%% of free RAM) on CPU, 90%% of free GPU memory on GPU)")
    g.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len,
                   help="longest prompt + output in tokens (default: the model's context, capped to n_slots)")
    g.add_argument("--scheduler", default=_DEFAULTS.scheduler, choices=list(SCHEDULERS),
                   help="orca = iteration-level scheduling, static = request-level baseline")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (by default decode iterations replay them on CUDA)")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=_DEFAULTS.tensor_parallel_size,
                   help="split every layer over this many worker processes, one GPU each (default 1)")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=_DEFAULTS.pipeline_parallel_size,
                   help="split the layers into this many pipeline stages, one batch in flight per "
                        "stage (default 1)")
    g.add_argument("--max-num-batched-tokens", type=_budget, default=_DEFAULTS.max_num_batched_tokens,
                   help="tokens per iteration: decodes first, then prompt chunks (chunked prefill); "
                        "'none' runs whole prompts (default auto: 128 on CPU, 2048 on CUDA, at least "
                        "--max-batch-size)")
    g.add_argument("--prefill-only-tokens", type=_budget, default=_DEFAULTS.prefill_only_tokens,
                   help="tokens of an iteration without decodes (only prompts run, so no stream waits "
                        "on it); 'none': --max-num-batched-tokens (default auto: 512 on CPU, the chunk "
                        "budget on CUDA and under --admission fair)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=_DEFAULTS.batch_invariant,
                   help="a request's tokens do not depend on its batch-mates (default: on for CPU, off for CUDA)")
    g.add_argument("--slab-compaction", action=argparse.BooleanOptionalAction, default=_DEFAULTS.slab_compaction,
                   help="slide live KV slabs together when the queue head only lacks a contiguous run "
                        "(default on)")
    g.add_argument("--worker-timeout", type=float, default=_DEFAULTS.worker_timeout,
                   help="with -tp/-pp: seconds to wait for one batch's result before the workers are "
                        f"declared failed (default {_DEFAULTS.worker_timeout:.0f})")
    g.add_argument("--heartbeat-interval", type=float, default=_DEFAULTS.heartbeat_interval, metavar="S",
                   help=f"with -tp/-pp: seconds between worker heartbeats (default {_DEFAULTS.heartbeat_interval:g})")
    g.add_argument("--heartbeat-timeout", type=float, default=_DEFAULTS.heartbeat_timeout, metavar="S",
                   help="with -tp/-pp: a worker silent this long (stopped, hung) fails the server "
                        f"(default {_DEFAULTS.heartbeat_timeout:g})")
    g.add_argument("--admission", default=_DEFAULTS.admission, choices=list(ADMISSION_POLICIES),
                   help="fcfs = arrival order (Algorithm 1); fair = per-client fair shares of admission "
                        f"and prefill chunks (default {_DEFAULTS.admission})")
    g.add_argument("--max-kv-per-client", type=_kv_cap, default=_DEFAULTS.max_kv_per_client,
                   metavar="SHARE|N|auto|none",
                   help="with --admission fair: KV slots one client's admitted requests may reserve while "
                        "another client is present (alone, a client may use the whole cache): a share of "
                        "the slots such as 0.5, a slot count such as 4096, or 'none' (default auto: "
                        f"{DEFAULT_KV_SHARE:g} of the slots)")
    g.add_argument("--share-decode-rows", action=argparse.BooleanOptionalAction, default=_DEFAULTS.share_decode_rows,
                   help="with --admission fair: a client ahead of the others takes decode rows worth no more "
                        "per iteration than theirs, a row costing more the longer its context (default: on "
                        "for CPU, off for CUDA)")
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=_DEFAULTS.prefix_caching,
                   help="keep finished requests' KV rows in free slots and start requests that share "
                        "their prompt prefix from them (default on; evicted first when space is needed)")
    g.add_argument("--prefix-cache-block-size", type=int, default=_DEFAULTS.prefix_cache_block_size,
                   help=f"tokens per key of the prefix index (default {_DEFAULTS.prefix_cache_block_size}); "
                        "a prompt shorter than one block is never cached")


def _positive_int_or(*words: str):
    """An argparse type: a positive integer, or one of `words` ('none' -> None, others as given)."""
    def parse(value: str):
        if value.lower() in words:
            return None if value.lower() == "none" else value.lower()
        try:
            n = int(value)
        except ValueError:
            choices = ", ".join(repr(w) for w in words)
            raise argparse.ArgumentTypeError(f"expected a positive integer or {choices}, got {value!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
        return n
    return parse


_budget = _positive_int_or("none", "auto")          # --max-num-batched-tokens, --prefill-only-tokens


def _kv_cap(value: str):
    """--max-kv-per-client: 'auto', 'none', a share of the KV slots (with a decimal point, in
    (0, 1]) or a slot count (an integer >= 1)."""
    word = value.strip().lower()
    if word in ("auto", "none"):
        return None if word == "none" else word
    expected = "a share of the KV slots in (0, 1] such as 0.5, a slot count >= 1, 'auto' or 'none'"
    try:
        number = float(word) if "." in word else int(word)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
    if isinstance(number, float) and not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"a share of the KV slots must be in (0, 1], got {value}")
    if isinstance(number, int) and number < 1:
        raise argparse.ArgumentTypeError(f"a slot count must be >= 1, got {value}")
    return number
