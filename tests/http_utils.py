"""Start `python -m orca_ext serve` as a subprocess on a free loopback port, for HTTP tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A serve subprocess; use as a context manager. `url(path)` builds request URLs.

    The server's output goes to a temporary file (a pipe nobody reads would fill up and block
    it); `log()` returns it, and startup failures include its tail.
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 600.0) -> None:
        self.args = list(args)
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="orca_serve_", suffix=".log", delete=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def start(self) -> "ServerProcess":
        for attempt in range(3):  # the free port may be taken between probing and binding
            self.port = free_port()
            cmd = [sys.executable, "-m", "orca_ext", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   *self.args]
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
            if self._wait_healthy():
                return self
            if "address already in use" not in self.log().lower() or attempt == 2:
                break
        tail = self.log()[-4000:]
        self.stop()
        raise RuntimeError(f"server did not become healthy ({' '.join(self.args)}); log tail:\n{tail}")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url("/health"), timeout=2.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        return False

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown, then Server.shutdown
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()
        os.unlink(self._log.name)


def with_openai_client(server, fn, **app_options):
    """asyncio.run(fn(client, app)): `client` an openai.AsyncOpenAI that reaches create_app(server,
    model_name="m", **app_options) in this process (httpx's ASGI transport, no socket)."""
    import asyncio

    import openai

    from orca_ext.http import create_app

    app = create_app(server, model_name="m", **app_options)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="none", http_client=c, max_retries=0)
            return await fn(client, app)
    return asyncio.run(go())
