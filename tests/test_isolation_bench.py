"""bench/isolation.py's attackers: each attack phase is a client of its own, and an oversize upload
is read while it is written, so the benchmark measures each attack and not what an earlier one
left behind or what a client library dropped."""
from __future__ import annotations

import asyncio
import ipaddress
import sys
from pathlib import Path

import pytest

from test_connections import make_app, serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_every_attack_phase_has_loopback_addresses_of_its_own():
    """A rejection debt outlasts a phase by minutes: an attack sent from an earlier attack's
    address would be held back for that one's debt (the server answering it once per 5 s)."""
    import isolation

    victims = {isolation.victim_address(i) for i in range(64)}
    seen: set[str] = set()
    for phase in range(256):
        block = isolation.attack_addresses(phase)
        assert len(block) == len(set(block)) == isolation.ATTACK_ADDRESSES
        assert all(ipaddress.ip_address(a).is_loopback for a in block)
        assert not seen & set(block) and not victims & set(block), phase
        seen |= set(block)
    with pytest.raises(ValueError):
        isolation.attack_addresses(256)


def test_an_upload_read_while_written_gets_its_early_413_every_time(make_server):
    """raw_upload sends a body far over --max-body-bytes, each time on a new connection, while
    reading: the server's early 413 (sent before the body, then the connection closed) reaches
    it every time, never a reset in its place."""
    from loopback import raw_upload
    from orca_ext.http.rejections import RejectionBudget

    budget = RejectionBudget(rate=1.0, burst=1 << 40)  # never in debt: every upload is answered at once
    app = make_app(make_server(), rejections=budget, max_body_bytes=1 << 16)
    body = b"x" * (2 << 20)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")

    async def uploads(port: int) -> list[str]:
        return [await raw_upload(port, "127.1.0.2", head, body, limit=60.0) for _ in range(20)]

    with serving(app, rejections=budget) as (port, _):
        assert asyncio.run(uploads(port)) == ["413"] * 20
