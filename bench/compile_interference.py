"""What a stream of grammar compiles costs the requests being decoded, at each compile priority.

One in-process Server of the default model decodes batches of `--requests` requests
(`--max-tokens` tokens each, EOS ignored) while, in turn:
- `none`: nothing else runs;
- `nice0` / `nice19`: a grammar thread (the HTTP server's `PromptWorkers`, at that nice value)
  compiles a fresh worst-case JSON schema (bench/isolation.py's schema_worst_case: ~24 KiB, 300
  regex properties, 31 levels) back to back, as one client sending such schemas with
  max_tokens=1 would keep it busy.
Modes take turns within each round, so a shared machine's load falls on all of them alike. It
prints each mode's decode rate (median and best over the rounds), its ratio to `none`, and how
many compiles ran per second.

    python bench/compile_interference.py [--requests 4] [--max-tokens 48] [--rounds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from guided_cost import run as decode_rate  # noqa: E402  (output tokens/s of one batch)
from isolation import _worst_schema  # noqa: E402
from orca_ext import SamplingParams, Server  # noqa: E402
from orca_ext.guided import GrammarCompiler, json_schema_spec, llg_tokenizer  # noqa: E402
from orca_ext.http.prompt_workers import PromptWorkers  # noqa: E402

MODES = ("none", "nice0", "nice19")


class CompileLoad:
    """Fresh worst-case schemas compiled back to back on one PromptWorkers thread, from a loop
    thread of its own, until stopped."""

    def __init__(self, compiler: GrammarCompiler, nice: int, first_key: int) -> None:
        self.compiler, self.workers, self.key = compiler, PromptWorkers(1, 1, nice=nice), first_key
        self.compiles = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._loop()), daemon=True)

    async def _loop(self) -> None:
        while not self._stop.is_set():
            self.key += 1
            await self.workers.run("attacker", self.compiler.compile,
                                   json_schema_spec(_worst_schema(self.key), "guided_json"))
            self.compiles += 1

    def __enter__(self) -> "CompileLoad":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.workers.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    with Server(max_batch_size=args.requests) as server:
        compiler = GrammarCompiler(llg_tokenizer(server.tokenizer, server.eos_token_ids, server.vocab_size))
        rng = random.Random(0)
        prompts = [[rng.randrange(100, server.vocab_size) for _ in range(16)] for _ in range(args.requests)]
        params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True) for _ in range(args.requests)]
        decode_rate(server, prompts, params)  # warm-up
        rates = {m: [] for m in MODES}
        compile_rates = {m: [] for m in MODES}
        key = 10_000
        for r in range(args.rounds):
            for mode in MODES:
                if mode == "none":
                    rates[mode].append(decode_rate(server, prompts, params))
                    continue
                key += 100_000
                with CompileLoad(compiler, 0 if mode == "nice0" else 19, key) as load:
                    t = time.perf_counter()
                    rates[mode].append(decode_rate(server, prompts, params))
                    compile_rates[mode].append(load.compiles / (time.perf_counter() - t))
            print(f"round {r + 1}: " + ", ".join(f"{m} {rates[m][-1]:.1f}" for m in MODES), flush=True)

    base = statistics.median(rates["none"])
    print(f"\n{platform.processor() or platform.machine()}, {args.requests} requests x {args.max_tokens} tokens, "
          f"{args.rounds} rounds")
    print("| mode | decode tok/s (median, best) | ratio to none | compiles/s |")
    print("|---|---|---|---|")
    for m in MODES:
        med = statistics.median(rates[m])
        cps = f"{statistics.median(compile_rates[m]):.1f}" if compile_rates[m] else "-"
        print(f"| {m} | {med:.1f}, {max(rates[m]):.1f} | {med / base:.2f} | {cps} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
