"""Browser-facing protections, checked before any route runs: the Host allow-list (against DNS
rebinding) and the API-key gate of the API docs.

DNS rebinding: a web page on evil.example can make a victim's browser resolve evil.example to
127.0.0.1 and then talk to a server on the victim's loopback, with "Host: evil.example". So a
server bound to a loopback address answers only requests whose Host is a loopback name
(localhost, 127.x.x.x, [::1] with an optional :port and nothing else) unless --trusted-hosts
names more. A server bound to a public
address cannot know its own names, so it takes any Host unless --trusted-hosts is given.

Cross-site request forgery needs no check here: every POST must carry Content-Type
application/json (checked by the service), which a browser only sends cross-origin after a CORS
preflight, and CORS is off unless --cors-origins allows an origin.
"""
from __future__ import annotations

import hmac
import ipaddress
import re
from typing import Any, Iterable, Optional

from .errors import APIError

DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is loopback-only."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_PORT = re.compile(r"[0-9]{1,5}")


def hostname(header: str) -> Optional[str]:
    """The name part of a Host header value ('[::1]:8000' -> '::1', 'a.b:80' -> 'a.b'), or None
    when the value is malformed: a bracketed part must be an IPv6 address followed by nothing or
    ':port' ('[::1]evil' is malformed), and a port is 1-5 ASCII digits."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        if end < 0:
            return None
        rest = header[end + 1:]
        if rest and not (rest[0] == ":" and _PORT.fullmatch(rest[1:])):
            return None
        try:
            ipaddress.IPv6Address(header[1:end])
        except ValueError:
            return None
        return header[1:end]
    name, colon, port = header.rpartition(":")
    if not colon:
        return header
    return name if name and _PORT.fullmatch(port) else None


def allowed_hosts(bind_host: str, trusted: Optional[Iterable[str]]) -> Optional[frozenset[str]]:
    """The Host names to accept besides loopback ones, or None for any Host.

    trusted: the --trusted-hosts names ('*' = any; '*.example.com' = any subdomain)."""
    names = frozenset(h.strip().lower() for h in (trusted or ()) if h.strip())
    if "*" in names:
        return None
    if not names and not is_loopback(bind_host):
        return None  # a public bind without --trusted-hosts: its names are unknown
    return names


def host_is_allowed(header: Optional[str], allowed: Optional[frozenset[str]]) -> bool:
    if allowed is None:
        return True
    if not header:
        return False
    name = hostname(header)
    if name is None:
        return False
    if is_loopback(name) or name in allowed:
        return True
    return any(a.startswith("*.") and name.endswith(a[1:]) for a in allowed)


def bearer_ok(authorization: str, api_key: str) -> bool:
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class Guards:
    """ASGI middleware: 400 for a Host outside `allowed` (None = any), 401 for the docs pages
    without the API key (when one is set)."""

    def __init__(self, app: Any, *, allowed: Optional[frozenset[str]], api_key: Optional[str]) -> None:
        self.app = app
        self.allowed = allowed
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or ())
            host = headers.get(b"host", b"").decode("latin-1")
            if not host_is_allowed(host, self.allowed):
                await APIError(400, "Host header not allowed: this server answers loopback names only "
                               "(start it with --trusted-hosts to add names)", code="invalid_host",
                               headers={"Connection": "close"}).response()(scope, receive, send)
                return
            if self.api_key is not None and scope.get("path") in DOCS_PATHS and not bearer_ok(
                    headers.get(b"authorization", b"").decode("latin-1"), self.api_key):
                await APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"}).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
