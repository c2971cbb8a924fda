"""Shared by the HTTP benchmarks (isolation.py, load.py): a `python -m orca_ext serve` subprocess
on a free 127.0.0.1 port, and one streaming completion measured from the client side.

Everything stays on loopback. The server's output goes to a log file (a pipe nobody reads would
fill up and block it); stop() sends SIGINT (the server's drain) and waits for a clean exit.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, TypeVar

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a checkout without an install

from orca_ext.benchmarks.serving import sse_chunks  # noqa: E402


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m orca_ext serve ARGS` on 127.0.0.1; a context manager.

    python/cwd select the checkout to run (e.g. another worktree's .venv, to measure a build
    without a fix next to one with it).
    """

    def __init__(self, *args: str, python: str = sys.executable, cwd: str | Path = REPO,
                 env: dict[str, str] | None = None, startup_timeout: float = 900.0) -> None:
        self.args = list(args)
        self.python = python
        self.cwd = str(cwd)
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_file = tempfile.NamedTemporaryFile("w+b", prefix="orca_bench_serve_", suffix=".log", delete=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def __enter__(self) -> "ServeProcess":
        cmd = [self.python, "-m", "orca_ext", "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during startup:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.startup_timeout} s:\n{self.log()[-3000:]}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.log_file.close()
        os.unlink(self.log_file.name)

    def model_card(self) -> dict:
        return httpx.get(self.base_url + "/v1/models", timeout=30).json()["data"][0]


@dataclass
class StreamResult:
    status: int = 0              # HTTP status (0: the connection failed)
    tokens: int = 0              # completion tokens (from the final usage chunk)
    ttft: float = float("nan")   # seconds from sending to the first text chunk
    e2e: float = float("nan")    # seconds from sending to the end of the stream
    finished: float = 0.0        # perf_counter() when the stream ended
    error: str = ""              # transport error, HTTP error body, or in-band error event


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamResult:
    """POST a streaming completion (stream_options.include_usage is added) and read it to the end."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res = StreamResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:200]
                return res
            async for chunk in sse_chunks(r):
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error event")
                    continue
                if res.ttft != res.ttft and chunk.get("choices") and chunk["choices"][0].get("text"):
                    res.ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.finished = time.perf_counter()
        res.e2e = res.finished - start
    return res


def metric(text: str, name: str, default: float = float("nan")) -> float:
    """The value of metric `name` (its first sample, any labels) in a /metrics text; `default`
    when the server does not export it."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return default


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN when empty."""
    vals = sorted(v for v in values if v == v)
    if not vals:
        return float("nan")
    pos = (len(vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


T = TypeVar("T")


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    """`awaitable`'s result, or asyncio.TimeoutError after `seconds`. asyncio.timeout where it
    exists (3.11+): wait_for can swallow a cancellation that lands as the read completes, and an
    attack loop built on it then keeps running after its phase cancelled it."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout=seconds)


def _status_of(head: bytes) -> str:
    """The status code of a response that starts with `head` (its first line complete)."""
    parts = head.split(b"\r\n", 1)[0].split()
    return parts[1].decode(errors="replace") if len(parts) > 1 else "malformed"


async def raw_exchange(port: int, local_address: str, data: bytes, *, trickle: bytes = b"", gap: float = 3.0,
                       limit: float = 600.0) -> tuple[str, float]:
    """Send `data` on a fresh connection from `local_address` to 127.0.0.1:`port`, then `trickle`
    (if any) every `gap` seconds, until the server closes the connection or `limit` seconds pass.

    Returns (the response's status code, or 'no response' / 'refused' / the error's type name;
    seconds the connection stayed open).
    """
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local_address, 0))
    except OSError as exc:
        return type(exc).__name__, 0.0
    status, head = "no response", b""
    try:
        if data:
            writer.write(data)
            await writer.drain()
        while time.perf_counter() - start < limit:
            try:
                chunk = await _within(reader.read(65536), gap)
            except asyncio.TimeoutError:
                if trickle:
                    writer.write(trickle)
                    await writer.drain()
                continue
            if not chunk:
                break  # the server closed the connection
            if status == "no response":
                head += chunk
                if b"\r\n" in head:
                    status = _status_of(head)
    except (ConnectionError, OSError) as exc:
        if status == "no response":
            status = type(exc).__name__
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return status, time.perf_counter() - start


async def raw_upload(port: int, local_address: str, head: bytes, body: bytes, *, limit: float = 30.0) -> str:
    """Send `head` then `body` on a fresh connection from `local_address` while reading the
    response, as a client that reads while it writes: a response that comes before the body is
    all sent (an early 413) ends the upload. Returns the response's status code, or 'no response'
    / 'timeout' / the error's type name; `limit` seconds bound the whole exchange, a stalled write
    included.

    A server that answers early closes with the rest of the body unread, which resets the
    connection; the answer is already in the client's socket by then, but a failed write makes
    asyncio's transports (and so asyncio streams, httpx, anyio) drop the connection without
    reading it. So this works on the bare socket: a failed write ends only the writing."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sending: asyncio.Task | None = None
    try:
        sock.bind((local_address, 0))
        await loop.sock_connect(sock, ("127.0.0.1", port))
        sending = asyncio.create_task(loop.sock_sendall(sock, head + body))
        data = await _within(_status_line(loop, sock), limit)
        return _status_of(data) if data else "no response"
    except asyncio.TimeoutError:
        return "timeout"
    except OSError as exc:
        return type(exc).__name__
    finally:
        if sending is not None:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
        sock.close()


async def _status_line(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """Bytes received up to the first CRLF (or all of them, at EOF)."""
    data = b""
    while b"\r\n" not in data:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            break
        data += chunk
    return data
