"""Who may talk to the server: a web page may not, unless its origin is allowed.

A page on any site can make the user's browser send requests to 127.0.0.1 (by a name
that resolves there, DNS rebinding, or a cross-site form). Such a request is refused
with 403 before any route sees it when its `Host` header is a name this machine does
not answer to, or when it carries an `Origin` that is not allowed. `/health` stays open
(it tells nothing and changes nothing); CORS headers are sent only for allowed origins.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from typing import Iterable
from urllib.parse import urlsplit

from .errors import ApiError

OPEN_PATHS = ("/health",)


def key_accepted(headers, keys) -> bool:
    """Whether a request's headers (any case-insensitive mapping) carry one of `keys`, as
    `Authorization: Bearer KEY` or `x-api-key: KEY`."""
    header = headers.get("authorization") or ""
    token = header[7:].strip() if header[:7].lower() == "bearer " else headers.get("x-api-key") or ""
    return bool(token) and any(secrets.compare_digest(token.encode(), k.encode()) for k in keys if k)


def host_name(header: str) -> str:
    """A Host header's name: lower case, without its port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost") or (_is_ip(name) and ipaddress.ip_address(name).is_loopback)


def _own_names() -> set[str]:
    own = socket.gethostname().lower()
    return {own, f"{own}.local", own.partition(".")[0]}


class Guard:
    """ASGI middleware: 403 for a foreign Host or a disallowed Origin, CORS for allowed ones."""

    def __init__(self, app, *, hosts: Iterable[str] = (), origins: Iterable[str] = ()) -> None:
        self.app = app
        self.hosts = {host_name(h) for h in hosts}
        self.origins = {o.rstrip("/").lower() for o in origins}
        self.own = _own_names()

    def host_allowed(self, header: str) -> bool:
        """Loopback names, IP addresses (a rebinding attack needs a name), this machine's
        own name and the configured ones."""
        name = host_name(header)
        return "*" in self.hosts or _is_ip(name) or _is_loopback(name) or name in self.own or name in self.hosts

    def origin_allowed(self, origin: str, host: str) -> bool:
        """The configured origins, loopback pages, and the server's own pages (its /docs)."""
        origin = origin.rstrip("/").lower()
        parts = urlsplit(origin)
        return ("*" in self.origins or origin in self.origins or _is_loopback(parts.hostname or "")
                or parts.netloc == host.strip().lower())

    def _cors(self, origin: str) -> list[tuple[bytes, bytes]]:
        if not (self.origins and origin):
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                (b"access-control-allow-headers", b"authorization, x-api-key, content-type, anthropic-version, "
                 b"anthropic-beta, anthropic-dangerous-direct-browser-access"),
                (b"access-control-allow-methods", b"GET, POST, OPTIONS")]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin", b"").decode("latin-1")
        if host and not self.host_allowed(host):
            refusal = ApiError(403, f"Host {host_name(host)!r} is not a name this server answers to; "
                               "add it with `llm mlxs config server_hosts`", code="host_not_allowed")
            return await refusal.response(scope)(scope, receive, send)
        if origin and not self.origin_allowed(origin, host):
            refusal = ApiError(403, f"Origin {origin!r} is not allowed; add it with "
                               "`llm mlxs config server_origins`", code="origin_not_allowed")
            return await refusal.response(scope)(scope, receive, send)
        cors = self._cors(origin)
        if cors and scope["method"] == "OPTIONS":  # a preflight: answered here
            await send({"type": "http.response.start", "status": 204, "headers": cors})
            return await send({"type": "http.response.body", "body": b""})

        async def with_cors(message):
            if message["type"] == "http.response.start" and cors:
                message = {**message, "headers": list(message.get("headers", [])) + cors}
            await send(message)

        await self.app(scope, receive, with_cors)
