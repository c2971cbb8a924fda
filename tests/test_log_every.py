"""What a client can repeat at will costs a bounded number of log lines: one per interval for each
kind of refusal or rejection (with the count left out since), the rest at DEBUG; uvicorn's access
log, a line per request, is off unless asked for."""
from __future__ import annotations

import asyncio
import logging

import httpx

from test_connections import ATTACKER, connect, make_app, read_response, serving
from test_http_head_refusals import Records


def test_one_line_per_interval_at_its_level_and_the_rest_at_debug():
    from orca_ext.http.log_every import LogEvery

    now = [100.0]
    log = logging.getLogger("test_log_every.unit")
    log.setLevel(logging.DEBUG)
    handler = Records(logging.DEBUG)
    log.addHandler(handler)
    try:
        every = LogEvery(log, logging.WARNING, every=7.0, clock=lambda: now[0])
        for i in range(5):
            every.log("refused %r", f"c{i}")
            now[0] += 1.0
        now[0] = 107.0  # 7 s after the first line: the next one is due
        every.log("refused %r", "late")
        every.log("refused %r", "later")
    finally:
        log.removeHandler(handler)
    levels = [(r.levelno, r.getMessage()) for r in handler.records]
    assert levels == [
        (logging.WARNING, "refused 'c0' (0 more like it since the last such line)"),
        (logging.DEBUG, "refused 'c1'"), (logging.DEBUG, "refused 'c2'"),
        (logging.DEBUG, "refused 'c3'"), (logging.DEBUG, "refused 'c4'"),
        (logging.WARNING, "refused 'late' (4 more like it since the last such line)"),
        (logging.DEBUG, "refused 'later'"),
    ]


def test_rejected_requests_log_one_info_line_per_interval(make_server):
    """29 rejections of three kinds (401, 415, 400): one INFO line, every one of them at DEBUG."""
    app = make_app(make_server(), api_key="k")
    handler = Records(logging.DEBUG)
    log = logging.getLogger("orca_ext.http.requests")
    old_level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)

    async def go() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000") as c:
            codes = [(await c.post("/v1/completions", json={"prompt": "AB"})).status_code for _ in range(10)]
            codes += [(await c.post("/v1/completions", content=b"{}", headers={
                "Authorization": "Bearer k", "Content-Type": "text/plain"})).status_code for _ in range(10)]
            codes += [(await c.post("/v1/completions", content=b"{", headers={
                "Authorization": "Bearer k", "Content-Type": "application/json"})).status_code for _ in range(9)]
            return codes

    try:
        codes = asyncio.run(go())
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    assert codes == [401] * 10 + [415] * 10 + [400] * 9
    info = [r for r in handler.records if r.levelno == logging.INFO]
    debug = [r for r in handler.records if r.levelno == logging.DEBUG]
    assert len(info) == 1 and " 401 " in info[0].getMessage(), [r.getMessage() for r in info]
    assert len(debug) == 28 and sum(" 400 " in r.getMessage() for r in debug) == 9


def test_no_access_log_line_per_request_unless_asked(make_server, capfd):
    """Under the `serve` transport at log level INFO: requests leave no access line (uvicorn
    writes them to stdout) by default, and one each with access_log=True (--access-log)."""
    lines = {}
    for enabled in (False, True):
        app = make_app(make_server())
        with serving(app, log_level="info", access_log=enabled) as (port, _):
            for _ in range(3):
                sock = connect(port, ATTACKER)
                try:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    assert read_response(sock)[0] == 200
                finally:
                    sock.close()
        out, err = capfd.readouterr()
        lines[enabled] = (out + err).count('"GET /health HTTP/1.1" 200')
    assert lines == {False: 0, True: 3}
