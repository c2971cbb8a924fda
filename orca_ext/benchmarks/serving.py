"""Online serving benchmark for the OpenAI-compatible server (vLLM's serving-benchmark definitions).

Requests arrive as a Poisson process at `--request-rate` requests/s (gamma-distributed gaps with
shape `--burstiness`: 1 = Poisson, < 1 burstier, > 1 more regular; rate inf = all at once), at
most `--max-concurrency` in flight, each a streaming POST /v1/completions whose prompt is a list
of random token ids (exact input lengths) and whose output length is forced with ignore_eos.

Per request (client-side clocks, perf_counter):
  TTFT  = first streamed text - request sent
  ITL   = gaps between successive streamed text chunks
  TPOT  = (E2EL - TTFT) / (output tokens - 1)      (output tokens > 1 only)
  E2EL  = last byte - request sent
  normalized latency = E2EL / output tokens          (the Orca paper's latency metric)
Aggregates: request throughput, output and total token throughput, mean/median/p99/std of each
latency, and goodput = completed requests per second that meet every `--goodput` limit.

Usage (`python -m orca_ext.benchmarks.serving` is the same):
  python bench/serving.py --base-url http://127.0.0.1:8000 --num-prompts 100 --request-rate 2 \
      --goodput ttft:2000 tpot:200 --result-json bench/serving_result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator

import httpx
import numpy as np

logger = logging.getLogger(__name__)

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                       # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0                    # seconds
    error: str = ""


def sample_requests(n: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    vocab: tuple[int, int], seed: int) -> list[BenchRequest]:
    """n requests with input/output lengths uniform on the inclusive ranges, random token ids."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, size=n)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=n)
    return [BenchRequest(rng.integers(vocab[0], vocab[1], size=int(i)).tolist(), int(o))
            for i, o in zip(in_lens, out_lens)]


async def arrivals(requests: list[BenchRequest], rate: float, burstiness: float,
                   seed: int) -> AsyncIterator[BenchRequest]:
    """Yield requests at gamma-distributed gaps with mean 1/rate (Poisson when burstiness = 1)."""
    rng = np.random.default_rng(seed + 1)
    for i, req in enumerate(requests):
        yield req
        if math.isinf(rate) or i == len(requests) - 1:
            continue
        # Gamma(shape=k, scale=1/(rate*k)) has mean 1/rate for every k; k scales the variance.
        await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


async def sse_chunks(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON chunks of an OpenAI server-sent-event stream, up to `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_one(client: httpx.AsyncClient, url: str, model: str | None, req: BenchRequest,
                   headers: dict[str, str]) -> RequestResult:
    body: dict[str, Any] = {
        "prompt": req.prompt_ids, "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    res = RequestResult(prompt_len=len(req.prompt_ids))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for chunk in sse_chunks(r):
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "stream error")
                    return res
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_len = chunk["usage"]["prompt_tokens"]
        res.latency = time.perf_counter() - start
        if res.ttft == 0.0:  # no text at all (possible for 1 token that decodes to nothing)
            res.ttft = res.latency
        res.success = res.output_tokens > 0
        if not res.success:
            res.error = "no usage in the stream"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean / median / p99 / std, scaled (seconds -> ms by default); NaN when empty."""
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan, "std": math.nan}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "std": float(a.std())}


def tpot_of(r: RequestResult) -> float:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def summarize(results: list[RequestResult], duration: float, goodput: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [tpot_of(r) for r in ok if r.output_tokens > 1]
    out = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
        "normalized_latency_ms_per_token": _stats([r.latency / r.output_tokens for r in ok]),
    }
    if goodput:
        def good(r: RequestResult) -> bool:
            values = {"ttft": r.ttft, "tpot": tpot_of(r), "e2el": r.latency}
            return all(values[k] * 1000.0 <= limit for k, limit in goodput.items())

        out["goodput_limits_ms"] = dict(goodput)
        out["request_goodput"] = sum(good(r) for r in ok) / duration
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        out["errors"] = errors[:10]
    return out


async def model_info(base_url: str, headers: dict[str, str]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]


async def run_benchmark(base_url: str, *, num_prompts: int, request_rate: float, burstiness: float = 1.0,
                        max_concurrency: int | None = None, input_range: tuple[int, int] = (8, 128),
                        output_range: tuple[int, int] = (1, 128), seed: int = 0, model: str | None = None,
                        api_key: str | None = None, goodput: dict[str, float] | None = None,
                        vocab_size: int | None = None, min_token_id: int = 100,
                        progress: bool = True, keep_details: bool = False) -> dict[str, Any]:
    """Run one load level against a running server; returns the summary dict."""
    from tqdm import tqdm

    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0 (got {request_rate}, {burstiness})")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info = await model_info(base_url, headers)
    model = model or info["id"]
    vocab = vocab_size or info.get("vocab_size")
    if not vocab:
        raise ValueError("the server does not report vocab_size; pass --vocab-size")
    requests = sample_requests(num_prompts, input_range, output_range, (min_token_id, vocab), seed)

    url = base_url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=num_prompts, desc=f"rate {request_rate:g}/s", disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=max_concurrency or num_prompts, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                res = await send_one(client, url, model, req, headers)
            else:
                async with limit:
                    res = await send_one(client, url, model, req, headers)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        async for req in arrivals(requests, request_rate, burstiness, seed):
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    summary = summarize(list(results), duration, goodput or {})
    summary.update({"model": model, "num_prompts": num_prompts, "request_rate": request_rate,
                    "burstiness": burstiness, "max_concurrency": max_concurrency,
                    "input_len_range": list(input_range), "output_len_range": list(output_range), "seed": seed})
    if keep_details:
        summary["requests"] = [asdict(r) for r in results]
    return summary


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    limits = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS or not value:
            raise argparse.ArgumentTypeError(
                f"--goodput entries are NAME:MS with NAME in {GOODPUT_METRICS}, got {item!r}")
        limits[name] = float(value)
    return limits


def print_summary(s: dict[str, Any]) -> None:
    print(f"{'=' * 16} Serving benchmark (rate {s['request_rate']:g}/s) {'=' * 16}")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total output tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.3f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    if "request_goodput" in s:
        rows.append(("Request goodput (req/s)", f"{s['request_goodput']:.3f}"))
    for name, value in rows:
        print(f"{name:<36}{value:>16}")
    for key, title in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                       ("e2el_ms", "E2E latency (ms)"),
                       ("normalized_latency_ms_per_token", "Normalized latency (ms/token)")):
        st = s[key]
        print(f"{title:<36}mean {st['mean']:9.1f}  median {st['median']:9.1f}  p99 {st['p99']:9.1f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf = all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--input-len-range", type=int, nargs=2, default=(8, 128), metavar=("MIN", "MAX"))
    p.add_argument("--output-len-range", type=int, nargs=2, default=(1, 128), metavar=("MIN", "MAX"))
    p.add_argument("--vocab-size", type=int, default=None, help="token-id range (default: from /v1/models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                   help="latency limits for goodput, e.g. ttft:2000 tpot:200 e2el:30000")
    p.add_argument("--result-json", default=None, help="write the summary here")
    p.add_argument("--save-detailed", action="store_true", help="include per-request results in the JSON")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for (lo, hi), name in ((args.input_len_range, "--input-len-range"),
                           (args.output_len_range, "--output-len-range")):
        if not 1 <= lo <= hi:
            parser.error(f"{name} needs 1 <= MIN <= MAX, got {lo} {hi}")
    summary = asyncio.run(run_benchmark(
        args.base_url, num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, input_range=tuple(args.input_len_range),
        output_range=tuple(args.output_len_range), seed=args.seed, model=args.model, api_key=args.api_key,
        goodput=parse_goodput(args.goodput), vocab_size=args.vocab_size, keep_details=args.save_detailed))
    print_summary(summary)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
        logger.info("wrote %s", args.result_json)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
