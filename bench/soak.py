"""Soak test: many requests with random parameters and random aborts; nothing may leak.

`--requests` (default 10,000) requests go to one in-process Server from `--threads` threads.
Each request draws a prompt (text or token ids) and sampling parameters at random, including the
extremes a hostile client would send (top_k = 2**63, temperature 1e-39 or 1e300, top_p = 1e-50,
the most and longest stop strings allowed), and is consumed one of several ways (result(),
stream() to the end, stream() left early). `--abort-fraction` of them (default 20%) are aborted
at a random moment: before the engine sees them, mid-stream, or after they finished. A few
invalid requests (which submit must reject) are mixed in.

Every `--sample-every` requests (default 1,000) it records the process RSS, the server's slot
counters and its undelivered outputs. At the end it waits for the server to go idle and prints
one PASS/FAIL line:
  PASS needs 0 KV slots reserved/used/allocated, 0 undelivered outputs, 0 requests that ended
  with finish_reason "error", every output within its max_tokens and the vocabulary, and RSS
  growth from the first sample after warm-up (the one after --sample-every requests; allocator
  pools and caches fill in the first ones) to the end below --max-rss-growth-mib (default 64).
The RSS curve is drawn to --plot (PNG).

The model defaults to a tiny random Llama (tests/tiny_models.py, the default model's tokenizer),
so the run measures the serving machinery rather than the model; --model takes any folder.

Usage:
  python bench/soak.py --out bench/soak.json --plot bench/soak_rss.png
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.soak")

WORDS = ("the river city light music under star old new small bright road window garden morning "
         "because while after before people tree house water little ünïcödé 日本 🦙").split()
STOP_CHOICES = ["\n", ".", " the", "ing", ",", "!"]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def tiny_model_dir(folder: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import make_tiny_model  # noqa: E402  (test helper: a random tiny Llama)

    from orca_ext.default_model import default_model_path

    return make_tiny_model(folder, "llama", tokenizer_dir=default_model_path())


def random_params(rng: random.Random, max_len: int):
    from orca_ext import SamplingParams
    from orca_ext.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    stop: list[str] = []
    r = rng.random()
    if r < 0.3:
        stop = rng.sample(STOP_CHOICES, rng.randint(1, 3))
    elif r < 0.35:  # the largest stop lists allowed
        stop = ["".join(rng.choice("abcxyz ") for _ in range(MAX_STOP_STRING_CHARS)) for _ in range(MAX_STOP_STRINGS)]
    return SamplingParams(
        max_tokens=rng.randint(1, min(24, max_len - 70)),
        temperature=rng.choice([0.0, 0.0, 1e-39, 0.7, 1.0, 1.5, 1e300]),
        top_k=rng.choice([0, 0, 1, 5, 50, 2**63]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 1e-50]),
        seed=rng.choice([None, rng.randrange(-2**70, 2**70)]),
        stop=stop,
        ignore_eos=rng.random() < 0.5,
    )


def random_prompt(rng: random.Random, vocab: int):
    if rng.random() < 0.7:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
    return [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]


def invalid_request(rng: random.Random, server):
    """(prompt, params) that submit must reject with InvalidRequestError."""
    from orca_ext import SamplingParams

    return rng.choice([
        ("hello", SamplingParams(max_tokens=server.max_model_len + 1)),
        ([server.vocab_size], SamplingParams()),
        ([], SamplingParams()),
        ("", SamplingParams()),
        ([1, 2], SamplingParams(stop_token_ids=[server.vocab_size + 5])),
    ])


class Soak:
    def __init__(self, server, n: int, threads: int, abort_fraction: float, sample_every: int, seed: int):
        self.server = server
        self.n = n
        self.threads = threads
        self.abort_fraction = abort_fraction
        self.sample_every = sample_every
        self.seed = seed
        self.lock = threading.Lock()
        self.next = 0
        self.done = 0
        self.samples: list[dict] = []
        self.counts = {"completed": 0, "aborted": 0, "rejected": 0, "error": 0, "bad_output": 0, "unexpected": 0}
        self.finish_reasons: dict[str, int] = {}
        self.problems: list[str] = []

    def take(self) -> int | None:
        with self.lock:
            if self.next >= self.n:
                return None
            self.next += 1
            return self.next - 1

    def finish(self, key: str, out=None, params=None) -> None:
        with self.lock:
            self.counts[key] += 1
            if out is not None:
                self.finish_reasons[out.finish_reason] = self.finish_reasons.get(out.finish_reason, 0) + 1
                if out.finish_reason == "error":
                    self.counts["error"] += 1
                    if len(self.problems) < 20:
                        self.problems.append(f"error: {out.error}")
                if len(out.token_ids) > params.max_tokens or any(
                        not 0 <= t < self.server.vocab_size for t in out.token_ids):
                    self.counts["bad_output"] += 1
            self.done += 1
            if self.done % self.sample_every == 0:
                self.sample()

    def sample(self) -> None:
        st = self.server.stats()
        self.samples.append({"requests": self.done, "rss_mib": rss_mib(), "running": st["running"],
                             "waiting": st["waiting"], "slots_reserved": st["slots_reserved"],
                             "slots_used": st["slots_used"], "slots_allocated": st["slots_allocated"],
                             "undelivered_outputs": st["undelivered_outputs"]})
        log.info("%s", self.samples[-1])

    def one(self, i: int) -> None:
        from orca_ext import InvalidRequestError

        rng = random.Random(self.seed * 1_000_003 + i)
        server = self.server
        if rng.random() < 0.02:
            prompt, params = invalid_request(rng, server)
            try:
                server.submit(prompt, params)
            except InvalidRequestError:
                self.finish("rejected")
                return
            self.problems.append(f"accepted an invalid request: {prompt!r:.60} {params}")
            self.finish("unexpected")
            return
        params = random_params(rng, server.max_model_len)
        rid = server.submit(random_prompt(rng, server.vocab_size), params)
        if rng.random() < self.abort_fraction:
            how = rng.choice(["now", "sleep", "mid_stream"])
            if how == "sleep":
                time.sleep(rng.uniform(0, 0.05))
            elif how == "mid_stream":
                stop_after = rng.randint(1, 4)
                for k, snap in enumerate(server.stream(rid)):
                    if snap.finished or k + 1 >= stop_after:
                        break
            server.abort(rid)
            try:
                out = server.result(rid, timeout=600)
            except KeyError:  # a stream that reached the end already delivered it
                out = None
            self.finish("aborted", out, params)
            return
        way = rng.choice(["result", "stream", "stream_left_early"])
        if way == "result":
            out = server.result(rid, timeout=600)
        elif way == "stream":
            out = None
            for out in server.stream(rid):
                pass
        else:  # leaving a stream does not abort: result() still delivers the whole output
            for out in server.stream(rid):
                break
            if not out.finished:  # a final snapshot was delivered by the stream itself
                out = server.result(rid, timeout=600)
        self.finish("completed", out, params)

    def worker(self, bar) -> None:
        while (i := self.take()) is not None:
            try:
                self.one(i)
            except Exception as exc:  # a bug: record it, keep soaking
                with self.lock:
                    self.counts["unexpected"] += 1
                    self.done += 1
                    if len(self.problems) < 20:
                        self.problems.append(f"request {i}: {type(exc).__name__}: {exc}")
            bar.update(1)

    def run(self) -> float:
        from tqdm import tqdm

        bar = tqdm(total=self.n, desc="soak", unit="req", mininterval=5)
        start = time.perf_counter()
        workers = [threading.Thread(target=self.worker, args=(bar,)) for _ in range(self.threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        bar.close()
        return time.perf_counter() - start


def wait_idle(server, limit_s: float = 120.0) -> dict:
    """Stats once nothing is running (bounded wait: a leak shows as a non-idle final sample)."""
    end = time.monotonic() + limit_s
    while True:
        st = server.stats()
        if (st["running"] == 0 and st["waiting"] == 0) or time.monotonic() > end:
            return st
        time.sleep(0.05)


def plot(samples: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot([s["requests"] for s in samples], [s["rss_mib"] for s in samples], marker="o", label="RSS")
    ax.set_xlabel("requests finished")
    ax.set_ylabel("process RSS (MiB)")
    lo = min(s["rss_mib"] for s in samples)
    ax.set_ylim(lo * 0.9, max(s["rss_mib"] for s in samples) * 1.1)
    ax2 = ax.twinx()
    ax2.plot([s["requests"] for s in samples], [s["slots_reserved"] for s in samples], color="tab:orange",
             linestyle="--", marker=".", label="KV slots reserved")
    ax2.set_ylabel("KV slots reserved (at the sample)")
    ax.set_title(title, fontsize=9)
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--abort-fraction", type=float, default=0.2)
    p.add_argument("--sample-every", type=int, default=1000)
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--model", default=None, help="model folder (default: a tiny random Llama)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--plot", default=None, help="PNG of RSS over requests")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from orca_ext import Server

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model_dir(Path(tmp) / "tiny-llama"))
        with Server(model, max_batch_size=args.max_batch_size, kv_cache_memory="256MiB") as server:
            soak = Soak(server, args.requests, args.threads, args.abort_fraction, args.sample_every, args.seed)
            soak.sample()  # before any request
            elapsed = soak.run()
            final = wait_idle(server)
            soak.sample()
    first = soak.samples[1] if len(soak.samples) > 2 else soak.samples[0]
    growth = soak.samples[-1]["rss_mib"] - first["rss_mib"]
    leaked = final["slots_reserved"] + final["slots_used"] + final["slots_allocated"]
    checks = {
        "zero KV slots at the end": leaked == 0,
        "zero undelivered outputs": final["undelivered_outputs"] == 0,
        "no request ended in error": soak.counts["error"] == 0,
        "outputs within max_tokens and the vocabulary": soak.counts["bad_output"] == 0,
        "no unexpected exception": soak.counts["unexpected"] == 0,
        f"RSS growth {growth:.1f} MiB < {args.max_rss_growth_mib:g} MiB": growth < args.max_rss_growth_mib,
    }
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(), "requests": args.requests,
              "threads": args.threads, "elapsed_s": elapsed, "requests_per_s": args.requests / elapsed,
              "counts": soak.counts, "finish_reasons": soak.finish_reasons, "samples": soak.samples,
              "rss_growth_mib": growth, "final_stats": final, "checks": checks, "problems": soak.problems}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(soak.samples, args.plot, f"soak: {args.requests} requests, {args.threads} threads, "
             f"{args.abort_fraction:.0%} aborted ({result['date']})")
    for problem in soak.problems:
        print("problem:", problem)
    print(f"{args.requests} requests in {elapsed:.0f} s ({args.requests / elapsed:.1f}/s): {soak.counts}")
    print(f"finish reasons: {soak.finish_reasons}")
    ok = all(checks.values())
    print(("PASS: " if ok else "FAIL: ") + "; ".join(f"{k}: {'ok' if v else 'NO'}" for k, v in checks.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
