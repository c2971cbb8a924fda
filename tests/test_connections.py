"""Connections are a shared resource: one client must not be able to hold them all.

The app runs under the real uvicorn server of `serve` (transport.make_config) on a free loopback
port, in a thread; clients are raw sockets, so the tests control every byte, and httpx for the
bystander. The attacker connects from 127.0.0.2 and the bystander from 127.0.0.1, two clients
to the server. Every wait is bounded (socket timeouts, deadlines) and is a hang guard, never a
speed assertion.
"""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from fake_model import FakeTokenizer, fake_reference
from http_utils import free_port

ATTACKER = "127.0.0.2"
GUARD_S = 60.0
EVENT_LOOP = ["auto"]  # the loop `serving` runs the transport on: each test runs on both below


@pytest.fixture(autouse=True, params=["asyncio", "uvloop"])
def event_loop_name(request):
    """Every test here holds under asyncio's loop and under uvloop, which differ in when a
    connection starts reading and in how they close (the protections rely on both)."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    EVENT_LOOP[0] = request.param
    yield request.param
    EVENT_LOOP[0] = "auto"


def make_app(server, **kw):
    from orca_ext.http import create_app

    return create_app(server, model_name="m", max_queue=16, **kw)


@contextlib.contextmanager
def serving(app, log_level: str = "warning", **config):
    """The app behind the `serve` transport on a free loopback port; yields (port, limiter)."""
    from orca_ext.http import transport

    port = free_port()
    config.setdefault("event_loop", EVENT_LOOP[0])
    cfg = transport.make_config(app, host="127.0.0.1", port=port, log_level=log_level,
                                client_keys=app.state.client_keys, **config)
    http = transport.DrainingServer(cfg, lambda hurry: app.state.service.drain(0.0, hurry))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + GUARD_S
        while not http.started:
            assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.05)
        yield port, cfg.http.connection_limiter
    finally:
        http.should_exit = True
        thread.join(GUARD_S)
    assert not thread.is_alive()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=GUARD_S, source_address=(source, 0))


def read_response(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one response (its Content-Length, else up to EOF); (0, b'', b'') on
    EOF first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, b"", b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
               if line.lower().startswith(b"content-length:")]
    while not lengths or len(body) < lengths[0]:
        chunk = sock.recv(65536)
        if not chunk:
            assert not lengths, head
            break
        body += chunk
    return int(head.split(b" ", 2)[1]), head, body[:lengths[0]] if lengths else body


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection (EOF or a reset) before GUARD_S."""
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def fully_closed_by_server(sock: socket.socket) -> bool:
    """Keep sending body bytes after the server's EOF: true once a send or recv fails, i.e. the
    server stopped reading too; false if it still reads them after GUARD_S / 3."""
    deadline = time.monotonic() + GUARD_S / 3
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"x" * 1024)
            if sock.recv(4096) == b"":
                continue  # half-closed: the server may still be discarding what we send
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def bystander_is_served(port: int) -> None:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "AB", "max_tokens": 3, "temperature": 0},
                   timeout=GUARD_S)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == FakeTokenizer().decode(fake_reference([0, 1], 3))


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# -- a response ends a connection whose body was not read --------------------------------------------
EARLY_ANSWERS = [
    # (request head, expected status): each is answered without reading its declared body
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000\r\n\r\n", 200),
    (b"POST /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000\r\n\r\n", 404),
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\nContent-Type: text/plain\r\n"
     b"Content-Length: 1000000\r\n\r\n{\"prompt\"", 415),
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n", 401),
]


def test_a_connection_answered_before_its_body_was_read_is_closed(make_server):
    """A request answered while its declared body is still unread (a GET with a huge
    Content-Length, a 404, a 415, a 401) ends its connection: the client reads the response, then
    EOF, and the server stops reading soon after, although the client keeps sending body bytes and
    the header and keep-alive timeouts are far longer than the wait. The connection is no longer
    counted against its client, and the client is still served on a new connection."""
    server = make_server()
    app = make_app(server, api_key="k")
    with serving(app, header_timeout=120, keep_alive_timeout=120) as (port, limiter):
        for head, status in EARLY_ANSWERS:
            sock = connect(port, ATTACKER)
            sock.sendall(head)
            got, _, _ = read_response(sock)
            assert got == status, head
            sock.sendall(b"x")  # one body byte after the response
            assert closed_by_server(sock), head
            assert fully_closed_by_server(sock), head
            sock.close()
        wait_for(lambda: limiter.held(ATTACKER) == 0, "the closed connections are still counted")
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer k"}, timeout=GUARD_S)
        assert r.status_code == 200


def test_idle_and_half_sent_connections_are_closed_within_the_timeouts(make_server):
    """A connection that sends nothing, one that stops halfway through its headers, and a
    keep-alive connection that goes idle after a response are all closed by the server."""
    server = make_server()
    app = make_app(server)
    with serving(app, header_timeout=0.5, keep_alive_timeout=1) as (port, limiter):
        idle = connect(port, ATTACKER)
        half = connect(port, ATTACKER)
        half.sendall(b"GET /health HTTP/1.1\r\nHost: 127.")
        kept = connect(port, ATTACKER)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(kept)[0] == 200
        for sock in (idle, half, kept):
            assert closed_by_server(sock)
            sock.close()
        wait_for(lambda: limiter.total == 0, "closed connections are still counted")


# -- one client cannot hold every connection -------------------------------------------------------
@pytest.mark.parametrize("max_connections, per_client, kept, refusal", [
    (64, 4, 4, (429, b"too_many_connections")),    # the per-client cap
    (16, 16, 12, (503, b"server_busy")),           # room for new clients near the global limit
])
def test_one_client_holding_connections_cannot_deny_another(make_server, max_connections, per_client, kept,
                                                             refusal):
    """An attacker opens 64 keep-alive connections, each with a request. It keeps only
    --max-connections-per-client of them, or, once three quarters of --max-connections are open,
    no more than its share; every other one is answered 429/503 (naming the limit) and closed.
    Meanwhile a second client is served, on several connections at once."""
    server = make_server()
    app = make_app(server)
    with serving(app, header_timeout=120, keep_alive_timeout=120, max_connections=max_connections,
                 max_connections_per_client=per_client) as (port, limiter):
        socks = []
        statuses = []
        for _ in range(64):
            sock = connect(port, ATTACKER)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            socks.append(sock)
        for sock in socks:
            status, head, body = read_response(sock)
            statuses.append(status)
            if status != 200:
                assert (status, b'"code":"' + refusal[1] + b'"') == (refusal[0], body[body.find(b'"code"'):][
                    :len(refusal[1]) + 9]), body
                assert b"connection: close" in head.lower()
                assert closed_by_server(sock)
        assert statuses.count(200) == kept and statuses.count(refusal[0]) == 64 - kept
        assert limiter.held(ATTACKER) == kept
        # The attacker holds its connections open; another client is served, three at once.
        threads = [threading.Thread(target=bystander_is_served, args=(port,)) for _ in range(3)]
        errors = []
        for t in threads:
            t.run = (lambda run: lambda: _record(errors, run))(t.run)
            t.start()
        for t in threads:
            t.join(GUARD_S)
        assert not errors, errors
        for sock in socks:
            sock.close()
        wait_for(lambda: limiter.total == 0, "closed connections are still counted")


def _record(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


def test_connection_limiter_rules():
    from orca_ext.http.connections import ConnectionLimiter

    lim = ConnectionLimiter(max_connections=8, max_per_client=3)
    assert [lim.open("a") for _ in range(3)] == [None] * 3
    refused = lim.open("a")
    assert refused.status == 429 and "--max-connections-per-client 3" in refused.message
    assert lim.open("proxy", trusted=True) is None and lim.open("proxy", trusted=True) is None
    assert lim.open("proxy", trusted=True) is None and lim.open("proxy", trusted=True) is None  # exempt: 4
    assert lim.total == 7
    assert lim.open("b") is None                      # 8 open: full
    full = lim.open("c")
    assert full.status == 503 and "--max-connections 8" in full.message
    lim.close("proxy")
    lim.close("b")
    assert lim.total == 6 and lim.held("b") == 0      # 6 >= 3/4 of 8: crowded
    assert lim.open("a").status == 429                # 3 held: at its cap
    assert lim.open("b") is None                      # a new client gets room
    assert lim.open("proxy", trusted=True) is None    # trusted: no share rule
    lim.close("b")
    assert lim.open("b") is None


def test_unproven_connections_past_the_cap_are_paced_and_proven_ones_give_their_place_back():
    """A client may open --max-connections-per-client connections on probation at once; each one
    past that waits its turn at the unproven rate, in order; a connection that carried a
    successful request returns its place; trusted proxies are never paced."""
    from orca_ext.http.connections import ConnectionLimiter

    now = [50.0]
    lim = ConnectionLimiter(max_connections=64, max_per_client=3, unproven_rate=2.0, clock=lambda: now[0])
    assert [lim.pace("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert [lim.pace("a") for _ in range(2)] == pytest.approx([0.5, 1.0])   # in turn, 1 / rate apart
    assert lim.pace("b") == 0.0                                             # another client: its own places
    assert [lim.pace("proxy", trusted=True) for _ in range(8)] == [0.0] * 8
    lim.proven("a")
    lim.proven("a")
    assert lim.pace("a") == pytest.approx(0.5)                              # two places back
    now[0] += 10.0
    assert lim.pace("a") == 0.0                                             # refilled
    with pytest.raises(ValueError, match="unproven_rate"):
        ConnectionLimiter(8, 3, unproven_rate=0.0)


def test_a_client_cycling_failed_connections_is_read_in_turn_while_a_successful_one_is_not(make_server):
    """Served by the real transport with 2 connections per client and one unproven connection per
    100 s: after the attacker's two connections closed (one answered 404, one idle), a third one
    is held unread (its request gets no answer), while a client whose requests succeed opens one
    new connection after another and each is answered (as is one that hangs up on each of its
    streams once it has started), and so is the bystander."""
    server = make_server()
    app = make_app(server)
    with serving(app, header_timeout=120, max_connections_per_client=2, unproven_connection_rate=0.01) as (
            port, limiter):
        failed = [connect(port, ATTACKER) for _ in range(2)]        # on probation, never proven:
        failed[0].sendall(b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(failed[0])[0] == 404                     # one refused, one idle
        wait_for(lambda: limiter.held(ATTACKER) == 2, "the connections are not counted")
        for sock in failed:
            sock.close()
        wait_for(lambda: limiter.held(ATTACKER) == 0, "the closed connections are still counted")
        held = connect(port, ATTACKER)                                # no place left: paced 100 s
        held.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        for _ in range(6):                                            # 3x the cap, one after another
            sock = connect(port, "127.0.0.3")
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert read_response(sock)[0] == 200
            sock.close()
        stream = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 64, "stream": True}).encode()
        for _ in range(6):                                            # streams cancelled after their head
            sock = connect(port, "127.0.0.4")
            _post(sock, stream)
            assert sock.recv(12) == b"HTTP/1.1 200"                   # started: proven, though cut short
            sock.close()
        bystander_is_served(port)
        held.settimeout(2.0)
        with pytest.raises(socket.timeout):                           # still unread, so unanswered
            held.recv(1)
        held.close()


def test_a_held_connection_is_answered_in_its_turn_with_what_it_sent_while_held(make_server):
    """A client out of places on probation: its next connection, whose request arrives at once,
    is held until its turn (half a second at 2 per second), then read and answered whole; the
    connection that proves itself gives its place back, so the next one is not held."""
    server = make_server()
    app = make_app(server)
    with serving(app, max_connections_per_client=1, unproven_connection_rate=2.0) as (port, limiter):
        failed = connect(port, ATTACKER)
        failed.sendall(b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(failed)[0] == 404                        # its one place, never given back
        failed.close()
        wait_for(lambda: limiter.held(ATTACKER) == 0, "the closed connection is still counted")
        for _ in range(2):
            held = connect(port, ATTACKER)
            held.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            status, _, body = read_response(held)
            assert status == 200 and json.loads(body)["status"] == "ok"
            held.close()


# -- request heads are bounded however they arrive -------------------------------------------------
@pytest.mark.parametrize("pieces", [1, 8])
def test_request_heads_over_16_kib_are_refused_even_in_one_read(make_server, pieces):
    """A request line + headers over 16 KiB gets 400 and a closed connection, whether it arrives
    in one read or in pieces, and counts against its client's rejection budget (one refusal of
    16 KiB empties this budget); a 15 KiB head is served."""
    from orca_ext.http.rejections import RejectionBudget

    server = make_server()
    budget = RejectionBudget(rate=1.0, burst=16 << 10, max_delay=0.2)
    app = make_app(server, rejections=budget)

    def head(filler: int) -> bytes:
        return b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"a" * filler + b"\r\n\r\n"

    with serving(app, rejections=budget) as (port, _):
        sock = connect(port, ATTACKER)
        sock.sendall(head(15 * 1024))
        assert read_response(sock)[0] == 200
        sock.close()
        assert budget.delay(ATTACKER) == 0
        sock = connect(port, ATTACKER)
        big = head(100 * 1024)
        step = -(-len(big) // pieces)
        try:
            for i in range(0, len(big), step):
                sock.sendall(big[i:i + step])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the rest was sent
        status, _, _ = read_response(sock)
        assert status in (400, 431)
        assert closed_by_server(sock)
        sock.close()
        assert budget.delay(ATTACKER) == 0  # exactly the burst spent: 16 KiB
        sock = connect(port, ATTACKER)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n")
        assert read_response(sock)[0] == 400  # malformed: charged too, and now in debt
        sock.close()
        assert budget.delay(ATTACKER) > 0
        bystander_is_served(port)


def test_a_trusted_proxys_malformed_requests_are_not_charged_to_it(make_server):
    """A trusted proxy carries many clients, so the transport charges it nothing for a malformed
    request head (as the connection limits exempt it), while any other peer is charged."""
    from orca_ext.http.rejections import RejectionBudget

    proxy = "127.0.0.3"
    budget = RejectionBudget(rate=1.0, burst=1.0, max_delay=0.2)  # one charge puts a client in debt
    app = make_app(make_server(), rejections=budget, trusted_proxies=[proxy])
    with serving(app, rejections=budget) as (port, _):
        for source in (proxy, ATTACKER):
            sock = connect(port, source)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n")
            assert read_response(sock)[0] == 400
            sock.close()
    assert budget.delay(proxy) == 0
    assert budget.delay(ATTACKER) > 0


def test_forwarded_for_names_no_client_without_trusted_proxies(make_server):
    """Without --trusted-proxies, X-Forwarded-For is the client's own words from any peer, the
    loopback address included (which uvicorn's own proxy-header handling would trust): a bad
    request sent from 127.0.0.1 naming 9.9.9.9 is charged to 127.0.0.1."""
    from orca_ext.http.rejections import RejectionBudget

    budget = RejectionBudget(rate=1.0, burst=1.0, max_delay=0.2)  # one rejection puts a client in debt
    app = make_app(make_server(), rejections=budget)
    with serving(app, rejections=budget) as (port, _):
        sock = connect(port, "127.0.0.1")
        body = b"{not json"
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"X-Forwarded-For: 9.9.9.9\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert read_response(sock)[0] == 400
        sock.close()
    assert budget.delay("127.0.0.1") > 0 and budget.delay("9.9.9.9") == 0


def _post(sock: socket.socket, body: bytes) -> None:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_a_new_connection_on_a_closed_connections_port_is_not_held_back(make_server):
    """A rejection marks its connection, and while its client is in debt a request on a marked
    connection gets a 429 unread. Once that connection has closed, a new connection that happens
    to reuse its source port is a different connection: its well-formed request is served."""
    from orca_ext.http.rejections import RejectionBudget

    budget = RejectionBudget(rate=1.0, burst=1.0, max_delay=0.2)  # one rejection puts a client in debt
    app = make_app(make_server(), rejections=budget)
    good = b'{"model": "m", "prompt": [1, 2], "max_tokens": 2}'
    with serving(app, rejections=budget) as (port, _):
        first = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        first.settimeout(GUARD_S)
        first.bind((ATTACKER, 0))
        first.connect(("127.0.0.1", port))
        source_port = first.getsockname()[1]
        _post(first, b"{not json")
        assert read_response(first)[0] == 400                 # rejected: the client is in debt now
        _post(first, good)
        assert read_response(first)[0] == 429                 # held back on the rejected connection...
        assert closed_by_server(first)                        # ... which the server then closes
        first.close()
        again = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.settimeout(GUARD_S)
        again.bind((ATTACKER, source_port))
        again.connect(("127.0.0.1", port))
        _post(again, good)
        status, _, body = read_response(again)
        again.close()
    assert status == 200, body
