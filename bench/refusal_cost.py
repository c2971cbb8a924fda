"""Server CPU per refused request: what one request of `bench/isolation.py`'s oversize_head and
oversize_body attacks costs the server.

The `serve` transport (transport.make_config) runs in a thread of this process around the fake
model of tests/fake_model.py; the client, in the main thread, opens a connection from 127.0.0.2,
sends one request in one write (a head of `--size` bytes; or a head declaring a 2 MiB body, then
the body, over the 1 MiB body limit), reads the answer (or the close) and closes, `--requests`
times in a row. Reported: the server thread's CPU time (its run time from /proc/self/task/*/schedstat, so
the client's own work is not counted) per request, for a client with budget left (every request
answered 400 or 413) and for a client in debt (the budget's burst spent by the first request).

    python bench/refusal_cost.py --requests 2000 2>/dev/null
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

ATTACKER = "127.0.0.2"


def thread_cpu_seconds(native_id: int) -> float:
    """A thread's CPU time in ns resolution (schedstat's run time), not /proc stat's ticks."""
    return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[0]) / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(port: int, request: bytes) -> str:
    """Send `request` on a new connection; the answer's status, or how the connection ended."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(ATTACKER, 0))
    try:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            if not data:
                return "reset"
        return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"
    finally:
        sock.close()


def measure(requests: int, request: bytes, budget_kwargs: dict) -> tuple[float, Counter]:
    from fake_model import FakeModel, FakeTokenizer
    from orca_ext.http import create_app, transport
    from orca_ext.http.rejections import RejectionBudget
    from orca_ext.server import Server

    server = Server(FakeModel(), tokenizer=FakeTokenizer(), n_slots=256, max_batch_size=4)
    budget = RejectionBudget(**budget_kwargs)
    app = create_app(server, model_name="m", rejections=budget)
    port = free_port()
    cfg = transport.make_config(app, host="127.0.0.1", port=port, log_level="warning",
                                client_keys=app.state.client_keys, rejections=budget)
    http = transport.DrainingServer(cfg, lambda hurry: app.state.service.drain(0.0, hurry))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    statuses: Counter = Counter()
    try:
        deadline = time.monotonic() + 60
        while not http.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        statuses[one_request(port, request)] += 1  # warm-up (and, with a tiny burst, the debt)
        time.sleep(0.2)
        cpu0 = thread_cpu_seconds(thread.native_id)
        for _ in range(requests):
            statuses[one_request(port, request)] += 1
        time.sleep(0.2)  # the last connections' ends
        cpu = thread_cpu_seconds(thread.native_id) - cpu0
    finally:
        http.should_exit = True
        thread.join(60)
        server.shutdown()
    return cpu / requests, statuses


def main() -> None:
    import logging

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests of each kind and case")
    ap.add_argument("--size", type=int, default=100 << 10, help="bytes of the oversize head's one header value")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)  # warnings are written, as in `serve` (2>/dev/null to hide them)
    cases = {
        "budget left": dict(rate=1.0, burst=1e15),
        # in debt from the first head on; a short delay keeps the loop quick (the CPU per head does
        # not depend on how long an answer is held)
        "in debt": dict(rate=1.0, burst=1.0, max_delay=0.002),
    }
    body = json.dumps({"model": "m", "prompt": "x" * (2 << 20)}).encode()
    kinds = {
        "oversize head": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * args.size + b"\r\n\r\n",
        "oversize body": (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body),
    }
    for kind, request in kinds.items():
        for name, kw in cases.items():
            per_request, statuses = measure(args.requests, request, kw)
            print(f"{kind}, {name:12s} {per_request * 1e6:7.0f} us server CPU per request  {dict(statuses)}")


if __name__ == "__main__":
    main()
