"""Isolation benchmark: can one client cut the others' token rate?

Victims (`--victims` clients, each streaming greedy completions back to back) run for the whole
benchmark against one `python -m orca_ext serve` on 127.0.0.1. Phases of `--window` seconds
alternate: a baseline with the victims alone, then one attack, then a baseline again, and so on.
An attack's ratio is the victims' token rate during it over the mean of the two baselines around
it, so slow drift of a shared machine cancels out. The target: no attack may cut the rate by more
than 25% (ratio >= 0.75). A stream of accepted requests is load, not one request, so the
attack that sends one (disconnect_churn, and each accepted stream of extreme parameters) is held
to its polite twin instead (TWINS below).

Next to the wall-clock rate it reports the victims' tokens per CPU second of the server process
and its workers (utime + stime from /proc). An attack that makes the server burn CPU (encoding,
stop checks) lowers that too, while other jobs on a shared machine slow tokens and server CPU time alike, so
this ratio stays meaningful when the wall-clock one is swamped by other load. (An attack that
stalls the engine without using CPU shows only in the wall-clock rate.)

Each victim connects from its own loopback address (127.0.0.10, .11, ...) and each attack phase's
attacker from addresses of its own (127.1.<phase>.2 and up), so the server sees separate clients, as
it would separate machines, and no attack inherits what an earlier one left in the server's
per-client state (a rejection debt outlasts a phase by minutes). Attacks (each is one client unless
noted; requests are sent back to back):
  benign_client      a reference, not an attack: a fifth client with ordinary parameters
                     (temperature 1), i.e. what any extra client costs the victims; the accepted
                     single-stream attacks below are held to it (TWINS)
  one_token_client   a reference, not an attack: a fifth client whose requests ask for one token
                     each, back to back: the prompt-heavy load that disconnect_churn also sends,
                     without hanging up
  top_k_overflow     accepted: top_k = 2**63, temperature 1
  tiny_temperature   accepted: temperature 1e-39
  stop_strings_max   accepted: the most stop strings allowed, each as long as allowed, never matching
  stop_strings_huge  rejected by the limits: 1,000 stop strings of 1,000 characters
  huge_prompt        rejected: a 0.9 MB text prompt (longer than the context can hold)
  oversize_body      rejected: a 2 MiB body (over --max-body-bytes), each on a new connection,
                     read while written so that the early 413 ends the upload
  disconnect_churn   accepted, then the client hangs up after the first chunk (held to
                     one_token_client: hanging up may add nothing to that load)
  slow_headers       300 connections that send headers one byte every few seconds
  kv_hog             accepted: five streams whose prompt + max_tokens together reserve all but a
                     few of the KV slots (each one legal), held open for the whole phase
  long_prompt_hog    accepted: one very long legal prompt (`--long-prompt-words` words, one token
                     asked) after another, so its chunked prefill runs the whole phase
  long_context_hog   accepted: four streams of a long legal prompt (`--long-context-words` words)
                     asking LONG_CONTEXT_TOKENS tokens each, held open for the whole phase: every
                     decode row attends to thousands of cached keys. The prompt is put into the
                     prefix cache once before the victims start (as a client would at a quiet
                     moment), so the streams decode deep in their context from the phase's start;
                     it runs before kv_hog and cache_thrash, which may evict that entry
  cache_thrash       accepted: prompts of ~100 tokens, never the same twice, one token asked, back to
                     back: each leaves a prefix cache entry no one will use, pushing out the entries
                     of the victims' shared prompt (one client's entries hold at most an equal share
                     of the slots; docs/DESIGN.md section 6, "Prefix caching")
  connection_holding 2,047 connections from eight clients (the phase's 8 addresses): GET /health declaring a
                     1 GB body, POSTs the server answers 404 / 415 / 401 without reading their
                     (1 GB, declared) body, and idle connections that send nothing; each sends a
                     body byte every 3 s and is reopened 3 s after the server closes it
  shared_address     from victim 0's own address (the same client key): header-only POSTs
                     declaring a 1 GB body, each on a new connection, and 1 MiB invalid bodies,
                     back to back. Victim 0's own ratio is reported too; it must never get 429
  metrics_flood      4 connections scraping /metrics back to back (with the API key)
  chat_template_flood  chat requests of 30,000 one-character messages, back to back (rejected)
  chat_template_paced  the same, one request every 1-2 s
  oversize_head      a 100 KiB header in one send, on 2 connections back to back
  schema_worst_case  accepted: guided_json schemas near the bounds (~24 KiB, 31 JSON levels, 300
                     regex-constrained properties), a new one each request so no cache helps
  schema_invalid     rejected: a new invalid schema (an unbalanced regex) each request
  logits_controls_max  accepted: the largest logit_bias map allowed (1,024 ids), every penalty
                     on, top logprobs 5, temperature 1: the most work the batched sampler's logits
                     controls and logprobs do for one row
  logprobs_top5 / logit_bias_max / penalties_max  the three parts of logits_controls_max alone
  many_streams       a reference, not an attack: one client holding PROMPT_BATCH streams open
                     (the victims' prompt, 32 tokens each, temperature 1), each sent again as it ends
  prompt_batch       accepted: completions batches of PROMPT_BATCH such prompts back to back, one
                     request that is that many streams (held to many_streams: a batch may add
                     nothing to what the same client's separate requests cost)

kv_hog, long_prompt_hog, long_context_hog, many_streams and prompt_batch are legal requests from
one client: what stops them is the server's admission policy (`--admission`,
`--max-kv-per-client`), not a limit. Without those two options the server runs with its own
defaults; run them under both policies:
  python bench/isolation.py --attacks long_context_hog,kv_hog,long_prompt_hog,many_streams,prompt_batch --admission fcfs
  python bench/isolation.py --attacks long_context_hog,kv_hog,long_prompt_hog,many_streams,prompt_batch \
      --admission fair --max-kv-per-client 0.5
Next to the rate ratio the table gives the victims' median time to first token during the attack
over that of the baselines around it (target: within 2x), and the CPU share this process (the
victims' and the attacker's client side) took during the phase and its baselines: on a machine with
few cores an attacker's own CPU use competes with the server, which a separate attacker machine
would not.

The server runs with an API key (`--api-key`, default 'isolation-bench'; victims and attackers
send it unless an attack is about requests without it) and, with `-tp N`, as N tensor-parallel
worker processes (the model must split N ways: the default model's 9 / 3 heads split over 3), and
with `-pp N` as N pipeline stages.

Usage:
  python bench/isolation.py --out bench/isolation.json
  python bench/isolation.py -tp 3 --out bench/isolation_tp3.json
  python bench/isolation.py -pp 2 --out bench/isolation_pp2.json
  python bench/isolation.py --python /path/other/.venv/bin/python --cwd /path/other   # another build
Per-victim token counts come from each stream's final usage chunk, spread evenly over that
request's lifetime, so a request that straddles two phases counts in both.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import random
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback import REPO, ServeProcess, metric, raw_exchange, raw_upload, stream_completion  # noqa: E402

log = logging.getLogger("bench.isolation")

VICTIM_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
VICTIM_TOKENS = 16
# Every penalty on, at values that change the logits of every token seen (logits_controls_max).
MAX_PENALTIES = {"presence_penalty": 2.0, "frequency_penalty": -2.0, "repetition_penalty": 1.3, "min_tokens": 16}
ATTACK_ADDRESSES = 8  # loopback addresses per attack phase (connection_holding's eight clients)
HUGE_LENGTH = 1_000_000_000  # a declared Content-Length no body will ever fill
LONG_CONTEXT_TOKENS = 1000  # what each long_context_hog stream asks for, beyond its prompt
PRIMER_ADDRESS = "127.2.0.2"  # where long_context_hog's prompt is first sent from, before the victims start


def attack_addresses(phase: int) -> list[str]:
    """The loopback addresses of the `phase`-th attack phase (0, 1, ...): a block of its own,
    127.1.<phase>.2 - .9, apart from the victims' and every other phase's. What an attack leaves
    in the server's per-client state (a rejection debt that takes minutes to pay off, connections
    still closing) then never falls on the attacks after it."""
    if not 0 <= phase < 256:
        raise ValueError(f"attack phase {phase}: at most 256 attack phases per run")
    return [f"127.1.{phase}.{2 + i}" for i in range(ATTACK_ADDRESSES)]


def victim_address(i: int) -> str:
    """Each victim is a client of its own, as separate users are (127.0.0.10, .11, ...)."""
    return f"127.0.0.{10 + i}"

TARGET_RATIO = 0.75
DEFAULT_API_KEY = "isolation-bench"
REFERENCES = ("benign_client", "one_token_client", "many_streams")  # extra load, not attacks: what load itself costs
# A stream of accepted requests is load, which the target does not bound (it bounds one request and
# a stream of rejected ones; the server has no per-client rate limit for accepted requests). Such an
# attack passes when it costs the victims no more than its reference twin, the same requests sent
# politely, within TWIN_TOLERANCE: its way of misbehaving (hanging up, extreme sampling parameters,
# the most stop strings or logits controls allowed) must add nothing to the load. The twin of one
# client's stream of 32-token requests is benign_client, an ordinary fifth client; where a step is
# compute-bound that alone costs the victims up to a fifth of their rate and more (bench/RESULTS.md).
TWINS = {"disconnect_churn": "one_token_client", "prompt_batch": "many_streams",
         **{attack: "benign_client" for attack in ("top_k_overflow", "tiny_temperature", "stop_strings_max",
                                                   "logits_controls_max", "logprobs_top5", "logit_bias_max",
                                                   "penalties_max")}}
TWIN_TOLERANCE = 0.05
PROMPT_BATCH = 64   # prompt_batch's prompts per request


@dataclass
class Span:
    start: float
    end: float
    tokens: int
    ttft: float = float("nan")
    victim: int = 0


@dataclass
class Phase:
    name: str
    start: float = 0.0
    end: float = 0.0
    cpu_s: float = 0.0  # CPU seconds the server process used during the phase
    client_cpu_s: float = 0.0  # CPU seconds this process (victims and attacker) used during the phase
    attack_statuses: Counter = field(default_factory=Counter)
    engine: dict = field(default_factory=dict)  # the server's engine counters over the phase (engine_counters)

    def tokens(self, spans: list[Span]) -> float:
        """Victim tokens inside [start, end] (each request's tokens spread over its life)."""
        total = 0.0
        for s in spans:
            overlap = min(s.end, self.end) - max(s.start, self.start)
            if overlap > 0 and s.end > s.start:
                total += s.tokens * overlap / (s.end - s.start)
        return total

    def rate(self, spans: list[Span]) -> float:
        return self.tokens(spans) / (self.end - self.start)

    def per_cpu(self, spans: list[Span]) -> float:
        return self.tokens(spans) / self.cpu_s if self.cpu_s > 0 else float("nan")

    def median_ttft(self, spans: list[Span]) -> float:
        """Median time to first token of the victim requests sent during the phase."""
        ttfts = sorted(s.ttft for s in spans if self.start <= s.start < self.end and s.ttft == s.ttft)
        return ttfts[len(ttfts) // 2] if ttfts else float("nan")


def own_cpu_seconds() -> float:
    """user + system CPU seconds of this process (the victims' and the attacker's client side)."""
    t = os.times()
    return t.user + t.system


def _stat_fields(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and of all its live descendants (a parallel server's workers), in
    seconds."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                children.setdefault(int(_stat_fields(entry)[1]), []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = _stat_fields(p)
            total += int(fields[11]) + int(fields[12])
        todo += children.get(p, [])
    return total / os.sysconf("SC_CLK_TCK")


# -- attacks: each runs until cancelled, recording the HTTP statuses it got -------------------------

def _body(model: str, **extra: Any) -> dict:
    return {"model": model, "prompt": VICTIM_PROMPT, "max_tokens": 32, "ignore_eos": True, **extra}


async def _accepted_loop(client, url, body, statuses: Counter) -> None:
    while True:
        res = await stream_completion(client, url, body)
        statuses[res.status if not res.error or res.status != 200 else f"{res.status}+error"] += 1


async def _cache_thrash(client, url, model: str, statuses: Counter, words: int = 40) -> None:
    rng = random.Random(2)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while True:  # ~100-token prompts never seen before: each leaves an entry nobody will hit
        prompt = " ".join("".join(rng.choice(letters) for _ in range(5)) for _ in range(words))
        res = await stream_completion(client, url, {**_body(model, max_tokens=1), "prompt": prompt})
        statuses[res.status if not res.error or res.status != 200 else f"{res.status}+error"] += 1


async def _raw_loop(client, url, payload: bytes, statuses: Counter) -> None:
    headers = {"Content-Type": "application/json"}
    while True:
        try:
            r = await client.post(url, content=payload, headers=headers)
            statuses[r.status_code] += 1
        except httpx.HTTPError as exc:  # e.g. the server closed the connection mid-upload
            statuses[type(exc).__name__] += 1


def _worst_schema(k: int) -> dict:
    """A legal JSON schema near the guided bounds (32 KiB, 32 levels), different for every `k` so
    that the server's grammar cache never helps: regex-heavy properties and a deep nesting."""
    props = {f"p{k}_{i}": {"type": "string", "pattern": f"^(a|b|c{i % 7})*[x-z]{{1,{20 + i % 13}}}(q|r|s{k % 97})+$"}
             for i in range(300)}
    deep: dict = {"type": "integer"}
    for _ in range(14):  # 2 JSON levels each (object, properties): 31 of the 32 allowed
        deep = {"type": "object", "properties": {"d": deep}, "required": ["d"]}
    return {"type": "object", "properties": {**props, "deep": deep}, "required": ["deep"]}


async def _fresh_loop(client, url, make_body: Callable[[int], dict], statuses: Counter) -> None:
    """_raw_loop with a new body for every request."""
    k = 0
    while True:
        k += 1
        try:
            r = await client.post(url, json=make_body(k))
            statuses[r.status_code] += 1
        except httpx.HTTPError as exc:
            statuses[type(exc).__name__] += 1


async def _disconnect_loop(client, url, body, statuses: Counter) -> None:
    body = {**body, "stream": True, "max_tokens": 200}
    while True:
        try:
            async with client.stream("POST", url, json=body) as r:
                statuses[r.status_code] += 1
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # hang up after the first event
        except httpx.HTTPError as exc:
            statuses[type(exc).__name__] += 1


async def _slow_headers(port: int, address: str, statuses: Counter, n: int = 300, gap: float = 3.0) -> None:
    conns = []
    try:
        for _ in range(n):
            try:
                r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))
            except OSError as exc:
                statuses[type(exc).__name__] += 1
                continue
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            conns.append((r, w))
        statuses["opened"] += len(conns)
        while True:  # one more header byte per connection every `gap` seconds
            await asyncio.sleep(gap)
            for r, w in conns:
                if r.at_eof() or w.is_closing():
                    continue
                try:
                    w.write(b"X")
                    await w.drain()
                except (ConnectionError, OSError):
                    w.close()
            statuses["closed_by_server"] = sum(r.at_eof() for r, _ in conns)
    finally:
        for _, w in conns:
            w.close()


async def _kv_hog(client, url, model: str, n_slots: int, statuses: Counter, streams: int = 5, spare: int = 10) -> None:
    """`streams` concurrent greedy streams whose reservations leave only `spare` slots free."""
    prompt = "Count from one to a million, one number a line."
    per_stream = (n_slots - spare) // streams
    body = {"model": model, "prompt": prompt, "max_tokens": per_stream - 14, "temperature": 0, "ignore_eos": True}
    await _held_streams(client, url, body, statuses, streams)


async def _held_streams(client, url, body: dict, statuses: Counter, streams: int) -> None:
    """`streams` concurrent streams of `body`, each sent again as soon as it ends."""

    async def one() -> None:
        while True:
            res = await stream_completion(client, url, body)
            statuses[res.status if not res.error or res.status != 200 else f"{res.status}+error"] += 1
            if res.status != 200:
                await asyncio.sleep(0.5)

    await asyncio.gather(*(one() for _ in range(streams)))


def _auth(api_key: str) -> bytes:
    return f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""


def _holding_heads(api_key: str) -> dict[str, bytes]:
    """What each kind of held connection sends first: requests the server answers without reading
    their (huge, declared) body, and nothing at all (an idle connection)."""
    host = b"Host: 127.0.0.1\r\n"
    huge = f"Content-Length: {HUGE_LENGTH}\r\n".encode()
    heads = {
        "get_body": b"GET /health HTTP/1.1\r\n" + host + huge + b"\r\n",
        "idle": b"",
        "post_404": b"POST /nowhere HTTP/1.1\r\n" + host + _auth(api_key) + b"Content-Type: application/json\r\n"
                    + huge + b"\r\n",
        "post_415": b"POST /v1/completions HTTP/1.1\r\n" + host + _auth(api_key) + b"Content-Type: text/plain\r\n"
                    + huge + b"\r\n",
    }
    if api_key:
        heads["post_401"] = b"POST /v1/completions HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n" \
                            + huge + b"\r\n"
    return heads


async def _connection_holding(port: int, api_key: str, addresses: list[str], statuses: Counter, n: int = 2047,
                              gap: float = 3.0, backoff: float = 3.0) -> None:
    """`n` connections from `addresses` (eight clients), each sending one of _holding_heads and
    then a body byte every `gap` seconds, reopened `backoff` seconds after the server closes it."""
    heads = list(_holding_heads(api_key).items())
    open_now = [0]

    async def slot(i: int) -> None:
        kind, head = heads[i % len(heads)]
        address = addresses[i % len(addresses)]
        await asyncio.sleep(random.random())  # spread the first opens over a second
        while True:
            open_now[0] += 1
            statuses["open_max"] = max(statuses["open_max"], open_now[0])
            try:
                status, held = await raw_exchange(port, address, head, trickle=b"x" if head else b"", gap=gap)
            finally:
                open_now[0] -= 1
            statuses[f"{kind} {status}"] += 1
            await asyncio.sleep(backoff)

    await asyncio.gather(*(slot(i) for i in range(n)))


def _post_head(api_key: str, length: int) -> bytes:
    """A completion POST's head declaring a `length`-byte JSON body."""
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + _auth(api_key)
            + f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode())


async def _shared_address(port: int, api_key: str, url: str, statuses: Counter, header_only: int = 4) -> None:
    """From victim 0's address (the same client key): header-only POSTs declaring a huge body, each
    on a new connection and abandoned after a second, and 1 MiB invalid bodies, back to back."""
    address = victim_address(0)
    head = _post_head(api_key, HUGE_LENGTH)
    invalid = b"{" + b"x" * ((1 << 20) - 64) + b"}"

    async def header_only_loop() -> None:
        while True:
            status, _ = await raw_exchange(port, address, head, gap=1.0, limit=1.0)
            statuses[f"header-only {status}"] += 1

    async def invalid_loop() -> None:
        transport = httpx.AsyncHTTPTransport(local_address=address)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), transport=transport) as client:
            while True:
                try:
                    r = await client.post(url, content=invalid, headers=headers)
                    statuses[f"1MiB-invalid {r.status_code}"] += 1
                except httpx.HTTPError as exc:
                    statuses[f"1MiB-invalid {type(exc).__name__}"] += 1

    await asyncio.gather(invalid_loop(), *(header_only_loop() for _ in range(header_only)))


async def _metrics_flood(client, base_url: str, statuses: Counter, connections: int = 4) -> None:
    async def one() -> None:
        while True:
            try:
                r = await client.get(base_url + "/metrics")
                statuses[r.status_code] += 1
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1

    await asyncio.gather(*(one() for _ in range(connections)))


async def _paced_raw_loop(client, url, payload: bytes, statuses: Counter, interval: tuple[float, float]) -> None:
    """_raw_loop at one request every `interval` (uniform) seconds."""
    headers = {"Content-Type": "application/json"}
    rng = random.Random(1)
    while True:
        start = time.perf_counter()
        try:
            r = await client.post(url, content=payload, headers=headers)
            statuses[r.status_code] += 1
        except httpx.HTTPError as exc:
            statuses[type(exc).__name__] += 1
        await asyncio.sleep(max(0.0, rng.uniform(*interval) - (time.perf_counter() - start)))


async def _oversize_head(port: int, address: str, statuses: Counter, size: int = 100 << 10,
                         connections: int = 2) -> None:
    """Request heads of `size` bytes (one header), each in one send, back to back."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * size + b"\r\n\r\n"

    async def one() -> None:
        while True:
            status, _ = await raw_exchange(port, address, head, gap=5.0, limit=10.0)
            statuses[status] += 1

    await asyncio.gather(*(one() for _ in range(connections)))


async def _upload_loop(port: int, address: str, head: bytes, body: bytes, statuses: Counter) -> None:
    """`head` + `body` on a new connection each time, back to back, reading while writing
    (loopback.raw_upload): an early answer ends each upload, as it would a careful client's."""
    while True:
        statuses[await raw_upload(port, address, head, body)] += 1


def long_context_body(model: str, words: int) -> dict:
    """long_context_hog's request: a prompt of `words` words, LONG_CONTEXT_TOKENS tokens asked."""
    rng = random.Random(1)
    prompt = " ".join(rng.choice(["tide", "lamp", "rock", "gull", "storm", "rope", "fog", "shore"]) for _ in range(words))
    return {"model": model, "prompt": prompt, "max_tokens": LONG_CONTEXT_TOKENS, "temperature": 0, "ignore_eos": True}


def attacks(model: str, port: int, n_slots: int = 0, long_prompt_words: int = 1200,
            api_key: str = "", long_context_words: int = 3000,
            ) -> dict[str, Callable[[httpx.AsyncClient, str, Counter, list[str]], Awaitable[None]]]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    # Long random stops: they never occur in the text, so every character is checked against all.
    max_stops = ["".join(rng.choice(letters) for _ in range(255)) + "#" for _ in range(16)]
    huge_stops = ["".join(rng.choice(letters) for _ in range(1000)) for _ in range(1000)]
    huge_stops_body = json.dumps(_body(model, stop=huge_stops)).encode()
    huge_prompt_body = json.dumps({**_body(model), "prompt": "lorem ipsum dolor sit amet " * 33_000}).encode()
    oversize_body = json.dumps({**_body(model), "prompt": "x" * (2 << 20)}).encode()
    long_prompt = " ".join(rng.choice(["light", "house", "keeper", "bottle", "message", "sea", "night", "wave"])
                           for _ in range(long_prompt_words))
    long_prompt_body = {**_body(model, max_tokens=1), "prompt": long_prompt}
    chat_flood_body = json.dumps({"model": model, "max_tokens": 16,
                                  "messages": [{"role": "user", "content": "a"}] * 30_000}).encode()

    def chat_url(url: str) -> str:
        return url.replace("/v1/completions", "/v1/chat/completions")

    def base_url(url: str) -> str:
        return url.rsplit("/v1/", 1)[0]

    max_bias = {str(i * 47 % 49152): (i % 201) - 100.0 for i in range(1024)}  # the most entries allowed
    return {
        "benign_client": lambda c, u, s, a: _accepted_loop(c, u, _body(model, temperature=1.0), s),
        "one_token_client": lambda c, u, s, a: _accepted_loop(c, u, _body(model, max_tokens=1), s),
        "top_k_overflow": lambda c, u, s, a: _accepted_loop(c, u, _body(model, temperature=1.0, top_k=2**63), s),
        "tiny_temperature": lambda c, u, s, a: _accepted_loop(c, u, _body(model, temperature=1e-39), s),
        "stop_strings_max": lambda c, u, s, a: _accepted_loop(c, u, _body(model, stop=max_stops), s),
        "stop_strings_huge": lambda c, u, s, a: _raw_loop(c, u, huge_stops_body, s),
        "huge_prompt": lambda c, u, s, a: _raw_loop(c, u, huge_prompt_body, s),
        "oversize_body": lambda c, u, s, a: _upload_loop(port, a[0], _post_head(api_key, len(oversize_body)),
                                                         oversize_body, s),
        "disconnect_churn": lambda c, u, s, a: _disconnect_loop(c, u, _body(model), s),
        "slow_headers": lambda c, u, s, a: _slow_headers(port, a[0], s),
        "long_context_hog": lambda c, u, s, a: _held_streams(c, u, long_context_body(model, long_context_words), s, 4),
        "kv_hog": lambda c, u, s, a: _kv_hog(c, u, model, n_slots, s),
        "long_prompt_hog": lambda c, u, s, a: _accepted_loop(c, u, long_prompt_body, s),
        "cache_thrash": lambda c, u, s, a: _cache_thrash(c, u, model, s),
        "connection_holding": lambda c, u, s, a: _connection_holding(port, api_key, a, s),
        "shared_address": lambda c, u, s, a: _shared_address(port, api_key, u, s),
        "metrics_flood": lambda c, u, s, a: _metrics_flood(c, base_url(u), s),
        "chat_template_flood": lambda c, u, s, a: _raw_loop(c, chat_url(u), chat_flood_body, s),
        "chat_template_paced": lambda c, u, s, a: _paced_raw_loop(c, chat_url(u), chat_flood_body, s, (1.0, 2.0)),
        "oversize_head": lambda c, u, s, a: _oversize_head(port, a[0], s),
        "schema_worst_case": lambda c, u, s, a: _fresh_loop(
            c, u, lambda k: _body(model, ignore_eos=False, guided_json=_worst_schema(k)), s),
        "logits_controls_max": lambda c, u, s, a: _accepted_loop(c, u, _body(
            model, temperature=1.0, logprobs=5, **MAX_PENALTIES, logit_bias=max_bias), s),
        # logits_controls_max's three parts alone, to tell which one costs the others
        "logprobs_top5": lambda c, u, s, a: _accepted_loop(c, u, _body(model, temperature=1.0, logprobs=5), s),
        "logit_bias_max": lambda c, u, s, a: _accepted_loop(c, u, _body(model, temperature=1.0, logit_bias=max_bias), s),
        "penalties_max": lambda c, u, s, a: _accepted_loop(c, u, _body(model, temperature=1.0, **MAX_PENALTIES), s),
        "many_streams": lambda c, u, s, a: _held_streams(c, u, _body(model, temperature=1.0), s, PROMPT_BATCH),
        "prompt_batch": lambda c, u, s, a: _accepted_loop(
            c, u, _body(model, temperature=1.0, prompt=[VICTIM_PROMPT] * PROMPT_BATCH), s),
        "schema_invalid": lambda c, u, s, a: _fresh_loop(
            c, u, lambda k: _body(model, guided_json={"type": "object", "properties": {
                f"p{k}": {"type": "string", "pattern": "(" * 200}}}), s),
    }


# -- the run --------------------------------------------------------------------------------------

def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def metrics_text(server: ServeProcess, api_key: str = "") -> str:
    return httpx.get(server.base_url + "/metrics", headers=auth_headers(api_key), timeout=30).text


def kv_slots(server: ServeProcess, api_key: str = "") -> int:
    """The server's KV capacity in slots, from /metrics."""
    return int(metric(metrics_text(server, api_key), "orca_kv_slots_total"))


# Engine counters read from /metrics at each phase's start and end: they tell what the engine did
# while the victims slowed (iterations, rows per iteration, slab compactions, cache evictions).
ENGINE_COUNTERS = {"iterations": "orca_iterations_total", "generated": "orca_engine_generated_tokens",
                   "prompt": "orca_engine_prompt_tokens", "busy_s": "orca_engine_busy_seconds",
                   "compactions": "orca_kv_slab_compactions_total",
                   "compaction_bytes": "orca_kv_slab_compaction_moved_bytes_total",
                   "cache_evictions": "orca_prefix_cache_evictions_total"}


def engine_counters(server: ServeProcess, api_key: str = "") -> dict[str, float]:
    """The ENGINE_COUNTERS now (a counter the server does not export reads 0)."""
    text = metrics_text(server, api_key)
    return {key: metric(text, name, default=0.0) for key, name in ENGINE_COUNTERS.items()}


def engine_summary(delta: dict[str, float]) -> dict[str, float]:
    """Per-phase figures from counter differences: mean iteration time and generated tokens per
    iteration (the decode rows), compactions and the bytes they moved, cache evictions."""
    iterations = delta["iterations"]
    return {"iterations": iterations,
            "iteration_ms": 1e3 * delta["busy_s"] / iterations if iterations else float("nan"),
            "tokens_per_iteration": delta["generated"] / iterations if iterations else float("nan"),
            "generated": delta["generated"],
            "prompt_tokens": delta["prompt"], "compactions": delta["compactions"],
            "compaction_mb": delta["compaction_bytes"] / 2**20, "cache_evictions": delta["cache_evictions"]}


def victim_spans(spans: list[Span], victim: int) -> list[Span]:
    return [s for s in spans if s.victim == victim]


async def prime_long_context(url: str, model: str, words: int, api_key: str) -> None:
    """Send long_context_hog's prompt once (one token asked) while the server is idle, so that the
    prefix cache holds it when the attack's streams come."""
    transport = httpx.AsyncHTTPTransport(local_address=PRIMER_ADDRESS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=auth_headers(api_key), transport=transport) as c:
        t0 = time.perf_counter()
        res = await stream_completion(c, url, {**long_context_body(model, words), "max_tokens": 1})
        if res.status != 200 or res.error:
            raise RuntimeError(f"priming long_context_hog's prompt failed: {res.status} {res.error[:200]}")
        log.info("long_context_hog's prompt (%d words) is in the prefix cache (%.1f s)", words, time.perf_counter() - t0)


async def run(server: ServeProcess, names: list[str], *, victims: int, window: float, settle: float,
              long_prompt_words: int = 1200, api_key: str = "", long_context_words: int = 3000) -> dict:
    model = httpx.get(server.base_url + "/v1/models", headers=auth_headers(api_key), timeout=30).json()["data"][0]["id"]
    url = server.base_url + "/v1/completions"
    table = attacks(model, server.port, kv_slots(server, api_key), long_prompt_words, api_key, long_context_words)
    if "long_context_hog" in names:
        await prime_long_context(url, model, long_context_words, api_key)
    spans: list[Span] = []
    victim_errors: Counter = Counter()
    stop = asyncio.Event()
    victim_body = {"model": model, "prompt": VICTIM_PROMPT, "max_tokens": VICTIM_TOKENS, "temperature": 0,
                   "ignore_eos": True}

    async def victim(i: int, client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            res = await stream_completion(client, url, victim_body)
            if res.status == 200 and not res.error:
                spans.append(Span(start, res.finished, res.tokens, res.ttft, victim=i))
            else:
                phase_name = phases_now[-1] if phases_now else "warm-up"
                victim_errors[f"victim {i} in {phase_name}: {res.status} "
                              f"{re.sub(r'cmpl-[0-9a-f]+', 'cmpl-<id>', res.error)[:80]}"] += 1
                await asyncio.sleep(0.1)

    phases: list[Phase] = []
    phases_now: list[str] = []
    headers = auth_headers(api_key)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    victim_clients = [httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers,
                                        transport=httpx.AsyncHTTPTransport(local_address=victim_address(i),
                                                                           limits=limits))
                      for i in range(victims)]
    async with contextlib.AsyncExitStack() as stack:
        vtasks = [asyncio.create_task(victim(i, await stack.enter_async_context(vc)))
                  for i, vc in enumerate(victim_clients)]
        await asyncio.sleep(settle * 2)  # warm up
        order = ["baseline"]
        for name in names:
            order += [name, "baseline"]
        attack_phases = 0
        for i, name in enumerate(order):
            phase = Phase(name)
            phases_now.append(name)
            task = None
            if name != "baseline":
                addresses = attack_addresses(attack_phases)
                attack_phases += 1
                ac = httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers,
                                       transport=httpx.AsyncHTTPTransport(local_address=addresses[0], limits=limits))
                task = asyncio.create_task(table[name](ac, url, phase.attack_statuses, addresses))
            await asyncio.sleep(settle)  # let the attack reach its steady state
            engine0 = await asyncio.to_thread(engine_counters, server, api_key)
            cpu0, client0, phase.start = cpu_seconds(server.proc.pid), own_cpu_seconds(), time.perf_counter()
            await asyncio.sleep(window)
            phase.end, phase.cpu_s = time.perf_counter(), cpu_seconds(server.proc.pid) - cpu0
            engine1 = await asyncio.to_thread(engine_counters, server, api_key)
            phase.engine = engine_summary({k: engine1[k] - engine0[k] for k in engine0})
            phase.client_cpu_s = own_cpu_seconds() - client0
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await ac.aclose()  # its keep-alive connections end with the phase
            phases.append(phase)
            e = phase.engine
            log.info("phase %d/%d %-18s server %.1f CPU-s, clients %.1f CPU-s, attacker %s; engine: %d iterations "
                     "of %.1f ms, %.2f tokens each, %d prompt tokens, %d compactions (%.0f MiB), %d cache evictions",
                     i + 1, len(order), name, phase.cpu_s, phase.client_cpu_s, dict(phase.attack_statuses),
                     e["iterations"], e["iteration_ms"], e["tokens_per_iteration"], e["prompt_tokens"],
                     e["compactions"], e["compaction_mb"], e["cache_evictions"])
        stop.set()
        await asyncio.gather(*vtasks, return_exceptions=True)

    rows = []
    for i, phase in enumerate(phases):
        if phase.name == "baseline":
            continue
        base = (phases[i - 1].rate(spans) + phases[i + 1].rate(spans)) / 2
        during = phase.rate(spans)
        base_cpu = (phases[i - 1].per_cpu(spans) + phases[i + 1].per_cpu(spans)) / 2
        during_cpu = phase.per_cpu(spans)
        base_ttft = (phases[i - 1].median_ttft(spans) + phases[i + 1].median_ttft(spans)) / 2
        during_ttft = phase.median_ttft(spans)
        # victim 0 alone: the client whose address shared_address borrows
        own = victim_spans(spans, 0)
        base0 = (phases[i - 1].rate(own) + phases[i + 1].rate(own)) / 2
        base0_ttft = (phases[i - 1].median_ttft(own) + phases[i + 1].median_ttft(own)) / 2
        rows.append({"attack": phase.name, "baseline_tok_s": base, "attack_tok_s": during,
                     "ratio": during / base if base else float("nan"),
                     "baseline_tok_per_cpu_s": base_cpu, "attack_tok_per_cpu_s": during_cpu,
                     "cpu_ratio": during_cpu / base_cpu if base_cpu else float("nan"),
                     "baseline_ttft_s": base_ttft, "attack_ttft_s": during_ttft,
                     "ttft_ratio": during_ttft / base_ttft if base_ttft else float("nan"),
                     "server_cpu_s": phase.cpu_s, "client_cpu_s": phase.client_cpu_s,
                     "baseline_client_cpu_s": (phases[i - 1].client_cpu_s + phases[i + 1].client_cpu_s) / 2,
                     "window_s": phase.end - phase.start,
                     "victim0_ratio": phase.rate(own) / base0 if base0 else float("nan"),
                     "victim0_ttft_ratio": phase.median_ttft(own) / base0_ttft if base0_ttft else float("nan"),
                     # what the engine generated beyond the victims' tokens: the attacker's share
                     # (a legal hog's rate; approximate: a victim request's tokens are spread over its life)
                     "others_tok_s": phase.engine["generated"] / (phase.end - phase.start) - during,
                     "attacker": {str(k): v for k, v in phase.attack_statuses.items()},
                     "engine": phase.engine, "baseline_engine": [phases[i - 1].engine, phases[i + 1].engine]})
    return {"rows": rows, "victim_errors": dict(victim_errors),
            "baselines_tok_s": [p.rate(spans) for p in phases if p.name == "baseline"],
            "baselines_tok_per_cpu_s": [p.per_cpu(spans) for p in phases if p.name == "baseline"]}


def _commit(cwd: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    return ""


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--attacks", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--victims", type=int, default=4, help="victim clients (default 4)")
    p.add_argument("--window", type=float, default=20.0, help="seconds measured per phase (default 20)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds before each phase is measured (default 2)")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs the server")
    p.add_argument("--cwd", default=str(REPO), help="checkout the server runs from")
    p.add_argument("--label", default="", help="a name for this run in the output")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--admission", default=None, choices=["fcfs", "fair"],
                   help="the server's admission policy (default: the server's default)")
    p.add_argument("--max-kv-per-client", default=None,
                   help="the server's per-client KV cap with --admission fair: a share such as 0.5 ('half' "
                        "is 0.5), slots, 'auto' or 'none' (default: the server's default)")
    p.add_argument("--long-prompt-words", type=int, default=1200,
                   help="words in long_prompt_hog's prompt (default 1200, about 1,200 tokens)")
    p.add_argument("--long-context-words", type=int, default=3000,
                   help="words in long_context_hog's prompt (default 3000, about 3,000 tokens)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="serve with -tp N worker processes (default 1: one process)")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="serve with -pp N pipeline stages, one worker process each (default 1)")
    p.add_argument("--api-key", default=DEFAULT_API_KEY,
                   help="the server's API key, sent by victims and attackers ('' for none; "
                        f"default {DEFAULT_API_KEY!r})")
    p.add_argument("--serve-args", default="", help="more options for the server, as one string (e.g. "
                   "'--unproven-connection-rate 4')")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="the server's prefix cache (default on, as the server's own default)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    names = list(attacks("m", 0)) if args.attacks is None else args.attacks.split(",")
    serve_args = ["--max-queue", "100000", "--log-level", "warning", "-tp", str(args.tensor_parallel_size),
                  "-pp", str(args.pipeline_parallel_size)]
    if args.admission is not None:
        serve_args += ["--admission", args.admission]
    if not args.prefix_caching:
        serve_args.append("--no-prefix-caching")
    if args.model:
        serve_args += ["--model", args.model]
    serve_args += shlex.split(args.serve_args)
    env = {"ORCA_EXT_KV_CACHE_MEMORY": "512MiB", **({"ORCA_EXT_API_KEY": args.api_key} if args.api_key else {})}
    if args.max_kv_per_client == "half":  # the spelling of earlier runs (bench/RESULTS.md)
        args.max_kv_per_client = "0.5"
    if args.max_kv_per_client is not None:
        serve_args += ["--max-kv-per-client", args.max_kv_per_client]
    with ServeProcess(*serve_args, python=args.python, cwd=args.cwd, env=env) as server:
        result = asyncio.run(run(server, names, victims=args.victims, window=args.window, settle=args.settle,
                                 long_prompt_words=args.long_prompt_words, api_key=args.api_key,
                                 long_context_words=args.long_context_words))
    result.update({"admission": args.admission or "default", "max_kv_per_client": args.max_kv_per_client or "default",
                   "prefix_caching": args.prefix_caching,
                   "tensor_parallel_size": args.tensor_parallel_size,
                   "pipeline_parallel_size": args.pipeline_parallel_size, "model": args.model or "default",
                   "serve_args": args.serve_args,
                   "commit": _commit(args.cwd), "cpu": _cpu_model(), "cores": os.cpu_count()})
    result.update({"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor()
                   or platform.machine(), "victims": args.victims, "window_s": args.window, "server_cwd": args.cwd})
    print(f"\n{'attack':<18} {'baseline tok/s':>14} {'attack tok/s':>12} {'ratio':>6}   "
          f"{'tok/CPU-s base':>14} {'attack':>7} {'ratio':>6}   {'TTFT base':>9} {'attack':>7} {'ratio':>6}"
          f"   {'client CPU base':>15} {'attack':>6} {'others tok/s':>12}  attacker statuses")
    attacks_only = [r for r in result["rows"] if r["attack"] not in REFERENCES]
    for r in result["rows"]:
        print(f"{r['attack']:<18} {r['baseline_tok_s']:>14.1f} {r['attack_tok_s']:>12.1f} {r['ratio']:>6.2f}   "
              f"{r['baseline_tok_per_cpu_s']:>14.1f} {r['attack_tok_per_cpu_s']:>7.1f} {r['cpu_ratio']:>6.2f}   "
              f"{r['baseline_ttft_s']:>9.2f} {r['attack_ttft_s']:>7.2f} {r['ttft_ratio']:>6.2f}   "
              f"{r['baseline_client_cpu_s'] / r['window_s']:>14.0%} {r['client_cpu_s'] / r['window_s']:>6.0%} "
              f"{r['others_tok_s']:>12.1f}  {r['attacker']}")
    for r in result["rows"]:
        if r["attack"] == "shared_address":
            print(f"shared_address: victim 0 (the attacker's own address) kept {r['victim0_ratio']:.2f} of its rate, "
                  f"TTFT ratio {r['victim0_ttft_ratio']:.2f}")
    print(f"victim errors: {result['victim_errors'] or 'none'}")
    measured = {r["attack"]: r for r in result["rows"]}

    def bound(attack: str, key: str) -> float:
        twin = measured.get(TWINS.get(attack, ""))
        return TARGET_RATIO if twin is None else min(TARGET_RATIO, twin[key] - TWIN_TOLERANCE)

    for attack, twin in TWINS.items():
        if attack in measured and twin in measured:
            print(f"{attack} costs {1 - measured[attack]['ratio']:.0%} against {1 - measured[twin]['ratio']:.0%} for "
                  f"{twin} (the same load without misbehaving): checked against that, not the {TARGET_RATIO:.0%} bound")
    below = [r["attack"] for r in attacks_only if not r["ratio"] >= bound(r["attack"], "ratio")]
    below_cpu = [r["attack"] for r in attacks_only if not r["cpu_ratio"] >= bound(r["attack"], "cpu_ratio")]
    ok = not below and not result["victim_errors"]
    print(f"{'PASS' if ok else 'FAIL'}: wall-clock rate >= {TARGET_RATIO:.0%} of baseline for every attack"
          f"{'' if not below else ' except ' + ', '.join(below)}; per server CPU second: "
          f"{'all' if not below_cpu else 'all but ' + ', '.join(below_cpu)}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
