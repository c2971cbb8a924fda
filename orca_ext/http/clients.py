"""Who is the client? One key per client, shared by every per-client limit (connections per
client, the rejected-request budget) and by whoever needs to tell clients apart.

The key is the client's IP address, normalised: an IPv4 address as is, an IPv4-mapped IPv6
address as its IPv4 address, and any other IPv6 address as its /64 network (one host usually
holds a whole /64, so a per-address limit keyed by the full IPv6 address would not bound it).

Behind a reverse proxy every connection comes from the proxy. Only a peer listed in
--trusted-proxies (addresses or CIDR networks) may name the client: for its requests the key is
the right-most address of `X-Forwarded-For` that is not itself a trusted proxy (every trusted
hop appends the address it saw, so the entries to the left of it are the client's own words and
are ignored). From any other peer `X-Forwarded-For` is ignored. The `user` field of a request
body is never a key: any client can write anything there.
"""
from __future__ import annotations

import functools
import ipaddress
from typing import Iterable, Optional, Sequence, Union

from starlette.requests import Request

Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

MAX_FORWARDED_ENTRIES = 64   # X-Forwarded-For entries looked at, right to left
IPV6_CLIENT_PREFIX = 64      # an IPv6 client is its /64


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """'10.0.0.1', '10.0.0.0/8', '::1' -> networks; ValueError naming the bad entry."""
    nets = []
    for value in values:
        value = value.strip()
        if not value:
            continue
        try:
            nets.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise ValueError(f"--trusted-proxies: {value[:100]!r} is not an IP address or CIDR network") from None
    return tuple(nets)


@functools.lru_cache(maxsize=4096)  # every connection and request parses its peer's address again
def _address(text: str) -> Optional[Address]:
    try:
        addr = ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@functools.lru_cache(maxsize=4096)
def address_key(addr: Address) -> str:
    if isinstance(addr, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((addr, IPV6_CLIENT_PREFIX), strict=False))
    return str(addr)


class ClientKeys:
    """The client key of a peer address and its `X-Forwarded-For` headers."""

    def __init__(self, trusted_proxies: Iterable[str] = ()) -> None:
        self.trusted = parse_networks(trusted_proxies)

    def is_trusted(self, peer: str) -> bool:
        addr = _address(peer)
        return addr is not None and any(addr in net for net in self.trusted)

    def peer_key(self, peer: str) -> str:
        """The key of a connection's peer address (no header consulted)."""
        addr = _address(peer)
        return address_key(addr) if addr is not None else peer[:64]

    def key(self, peer: str, forwarded_for: Sequence[str] = ()) -> str:
        """The client key of a request from `peer` with these X-Forwarded-For header values."""
        if not forwarded_for or not self.is_trusted(peer):
            return self.peer_key(peer)
        entries = [e for value in forwarded_for for e in value.split(",")][-MAX_FORWARDED_ENTRIES:]
        client = _address(peer)
        for entry in reversed(entries):
            addr = _address(entry)
            if addr is None:  # not an address: nothing further left can be trusted
                break
            client = addr
            if not any(addr in net for net in self.trusted):
                break
        return address_key(client) if client is not None else self.peer_key(peer)

    def of_scope(self, scope: dict) -> str:
        peer = scope["client"][0] if scope.get("client") else ""
        forwarded = [v.decode("latin-1") for k, v in scope.get("headers") or () if k == b"x-forwarded-for"]
        return self.key(peer, forwarded)


def client_key(request: Request) -> str:
    """The client key of an HTTP request to an app built by create_app (its --trusted-proxies)."""
    keys: ClientKeys = request.app.state.client_keys
    return keys.of_scope(request.scope)
