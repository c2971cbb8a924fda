"""Oversize and malformed request heads are refused by the transport before the app sees them, and
charged to their client's rejection budget: once the client is in debt, every further bad head is
refused cheaply (unparsed, held for the budget's delay, then a fixed 429 and a close), while a
well-formed request from the same address on another connection is still served.

The app runs under the real `serve` transport on a free loopback port (test_connections.py's
helpers); clients are raw sockets. Waits are bounded hang guards, never speed assertions.
"""
from __future__ import annotations

import logging
import socket

import pytest

from fake_model import FakeTokenizer, fake_reference
from test_connections import ATTACKER, GUARD_S, bystander_is_served, connect, make_app, read_response, serving, wait_for

OVERSIZE_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (100 << 10) + b"\r\n\r\n"
MALFORMED_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n"
GOOD_BODY = b'{"model": "m", "prompt": [1, 2], "max_tokens": 3, "temperature": 0}'


def send_head(port: int, head: bytes) -> str:
    """Send `head` in one write on a new connection from ATTACKER: the answer's status as text, or
    'closed' / 'reset' when the connection ended without one."""
    sock = connect(port, ATTACKER)
    try:
        try:
            sock.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the rest was read
        try:
            status, _, _ = read_response(sock)
        except ConnectionResetError:
            return "reset"
        return str(status) if status else "closed"
    finally:
        sock.close()


def post_good(sock: socket.socket) -> None:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(GOOD_BODY)).encode() + b"\r\n\r\n" + GOOD_BODY)


def assert_good_answer(sock: socket.socket) -> None:
    status, _, body = read_response(sock)
    assert status == 200, body
    assert b'"text":"' + FakeTokenizer().decode(fake_reference([1, 2], 3)).encode() + b'"' in body


class Records(logging.Handler):
    """Keeps the records at `level` and above."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("head", [OVERSIZE_HEAD, MALFORMED_HEAD], ids=["oversize", "malformed"])
def test_bad_heads_from_a_client_in_debt_end_in_429s_while_its_good_requests_are_served(make_server, head):
    """Bad request heads from one address, each on a new connection, one after another: the
    first ones are answered 400 and charged; once the budget is spent, every further one ends in
    a 429 or a closed connection, never another 400. A well-formed request from the same address
    on another connection is served, both while one of those refusals is being held and after."""
    from orca_ext.http.rejections import RejectionBudget

    budget = RejectionBudget(rate=1.0, burst=40 << 10, max_delay=0.3)  # a few bad heads spend it
    app = make_app(make_server(), rejections=budget)
    with serving(app, rejections=budget) as (port, limiter):
        outcomes = [send_head(port, head) for _ in range(12)]
        assert outcomes[0] == "400"
        in_debt_from = next(i for i, o in enumerate(outcomes) if o != "400")
        assert in_debt_from == 3, outcomes  # 16 KiB charged each: three take 48 KiB of 40
        assert set(outcomes[in_debt_from:]) <= {"429", "closed", "reset"}, outcomes
        assert budget.delay(ATTACKER) > 0
        # One more bad head, held far longer; meanwhile the same address is served elsewhere.
        budget.max_delay = 3 * GUARD_S
        held = connect(port, ATTACKER)
        held.sendall(head)
        good = connect(port, ATTACKER)
        post_good(good)
        assert_good_answer(good)
        good.close()
        held.setblocking(False)
        with pytest.raises(BlockingIOError):
            held.recv(1)  # still held: nothing sent, not closed
        held.close()  # the client gives up: the server forgets the held refusal
        wait_for(lambda: limiter.held(ATTACKER) == 0, "a closed, held connection is still counted")
        bystander_is_served(port)


def test_refused_heads_do_not_log_a_warning_each(make_server):
    """A client sending oversize heads in a loop leaves a bounded number of warnings in the log
    (one per interval, with a count), not one per head."""
    from orca_ext.http.rejections import RejectionBudget

    budget = RejectionBudget(rate=1.0, burst=1 << 40)  # never in debt: every head is answered 400
    app = make_app(make_server(), rejections=budget)
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "orca_ext.http.transport")]
    with serving(app, rejections=budget) as (port, _):
        for lg in loggers:
            lg.addHandler(handler)
        try:
            outcomes = [send_head(port, OVERSIZE_HEAD) for _ in range(20)]
        finally:
            for lg in loggers:
                lg.removeHandler(handler)
    assert outcomes == ["400"] * 20
    assert 1 <= len(handler.records) <= 2, [r.getMessage() for r in handler.records]
    assert "16384" in handler.records[0].getMessage() and repr(ATTACKER) in handler.records[0].getMessage()


@pytest.mark.parametrize("size, pieces", [(16 * 1024 - 200, 1), (16 * 1024 - 200, 7), (20 * 1024, 1), (20 * 1024, 5)])
def test_the_head_limit_is_exact_however_the_head_and_body_arrive(make_server, size, pieces):
    """A head just under 16 KiB is served, followed in the same writes by its body and a second,
    pipelined request; a head over it is refused, whether it comes in one write or in pieces."""
    from orca_ext.http.rejections import RejectionBudget

    budget = RejectionBudget(rate=1.0, burst=1 << 40)
    app = make_app(make_server(), rejections=budget)
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(GOOD_BODY)).encode() + b"\r\nX-Pad: ")
    request += b"a" * (size - len(request) - 4) + b"\r\n\r\n"
    assert len(request) == size
    data = request + GOOD_BODY + request + GOOD_BODY
    with serving(app, rejections=budget) as (port, _):
        sock = connect(port, ATTACKER)
        step = -(-len(data) // pieces)
        try:
            for i in range(0, len(data), step):
                sock.sendall(data[i:i + step])
        except (BrokenPipeError, ConnectionResetError):
            pass
        if size <= 16 * 1024:
            assert_good_answer(sock)
            assert_good_answer(sock)
        else:
            assert read_response(sock)[0] == 400
        sock.close()


def test_a_client_in_debt_uploading_an_oversize_body_is_answered_within_the_delay(make_server):
    """A client in debt declares a body over --max-body-bytes and sends part of it, then keeps
    still: its 413 comes within the budget's delay (not after the body timeout), and the
    connection is closed, so an upload can never hang on the server."""
    from orca_ext.http.rejections import RejectionBudget

    budget = RejectionBudget(rate=1.0, burst=1.0, max_delay=0.5)
    app = make_app(make_server(), rejections=budget, max_body_bytes=1 << 16, body_timeout=600)
    with serving(app, rejections=budget) as (port, _):
        assert send_head(port, MALFORMED_HEAD) == "400"  # now in debt
        assert budget.delay(ATTACKER) > 0
        sock = connect(port, ATTACKER)
        sock.settimeout(GUARD_S / 2)
        try:  # the recv timeout (far below the body timeout) is what would catch a hang
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2097152\r\n\r\n" + b"x" * (256 << 10))
            status, head, _ = read_response(sock)
        except (BrokenPipeError, ConnectionResetError):
            status, head = 0, b""
        assert status in (0, 413), head
        sock.close()
