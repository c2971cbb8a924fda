"""Server CPU per refused oversize request head: what one head of `bench/isolation.py`'s
oversize_head attack costs the server.

The `serve` transport (transport.make_config) runs in a thread of this process around the fake
model of tests/fake_model.py; the client, in the main thread, opens a connection from 127.0.0.2,
sends one request head of `--size` bytes in one write, reads the answer (or the close) and closes,
`--heads` times in a row. Reported: the server thread's CPU time (utime + stime from
/proc/self/task, so the client's own work is not counted) per head, for a client with budget left
(every head answered 400) and for a client in debt (the budget's burst spent by the first head).

    python bench/refusal_cost.py --heads 2000 2>/dev/null
"""
from __future__ import annotations

import argparse
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
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_head(port: int, head: bytes) -> str:
    """Send `head` on a new connection; the answer's status, or how the connection ended."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(ATTACKER, 0))
    try:
        try:
            sock.sendall(head)
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


def measure(heads: int, size: int, budget_kwargs: dict) -> tuple[float, Counter]:
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
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * size + b"\r\n\r\n"
    statuses: Counter = Counter()
    try:
        deadline = time.monotonic() + 60
        while not http.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        statuses[one_head(port, head)] += 1  # warm-up (and, with a tiny burst, the debt)
        time.sleep(0.2)
        cpu0 = thread_cpu_seconds(thread.native_id)
        for _ in range(heads):
            statuses[one_head(port, head)] += 1
        time.sleep(0.2)  # the last connections' ends
        cpu = thread_cpu_seconds(thread.native_id) - cpu0
    finally:
        http.should_exit = True
        thread.join(60)
        server.shutdown()
    return cpu / heads, statuses


def main() -> None:
    import logging

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=2000)
    ap.add_argument("--size", type=int, default=100 << 10, help="bytes of the one header's value")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)  # warnings are written, as in `serve` (2>/dev/null to hide them)
    cases = {
        "budget left": dict(rate=1.0, burst=1e15),
        # in debt from the first head on; a short delay keeps the loop quick (the CPU per head does
        # not depend on how long an answer is held)
        "in debt": dict(rate=1.0, burst=1.0, max_delay=0.002),
    }
    for name, kw in cases.items():
        per_head, statuses = measure(args.heads, args.size, kw)
        print(f"{name:12s} {per_head * 1e6:7.0f} us server CPU per head  {dict(statuses)}")


if __name__ == "__main__":
    main()
