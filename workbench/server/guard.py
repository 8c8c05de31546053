"""What keeps web pages and careless clients from reaching the server: the outermost ASGI layers.

Owns: `GuardMiddleware` (a Host-header allow-list, loopback names by default, so a page that
re-binds its DNS name to 127.0.0.1 gets 400 instead of every prompt on /debug/events; a limit on
the number of request headers, 431 past it; `X-Content-Type-Options: nosniff` on every response,
trace downloads among them), `APIKeyMiddleware` (the key only in `Authorization: Bearer`, never in
a URL, plus a short-lived session cookie that `POST /debug/session` hands a page that presented
the key, since its EventSource cannot set headers) and `redact_access_log` (a filter that keeps
secrets in a query string out of uvicorn's access log). Does not own: routes or the app (app.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from workbench.server.errors import APIError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
OPEN_PATHS = frozenset({"/health", "/"})  # the live page itself holds nothing secret
OPEN_PREFIXES = ("/static/",)
SESSION_PATH = "/debug/session"
COOKIE = "workbench_session"
SESSION_TTL = 600.0  # seconds a page's session cookie is good for (the page renews it)
_SECRET_QUERY = re.compile(r"(?i)([?&](?:api_key|key|token|access_token|auth)=)[^&\s\"]*")


def _host_name(value: str) -> str:
    """`example.com:8000` -> `example.com`; `[::1]:8000` -> `[::1]`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class GuardMiddleware:
    """400 for a Host not on the list, 431 for too many headers; nosniff on every response."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str] = LOOPBACK_HOSTS, max_headers: int = 100) -> None:
        self.app = app  # "*" among the hosts: any Host (behind a proxy that checks it)
        self.hosts = None if "*" in allowed_hosts else frozenset(_host_name(h) for h in allowed_hosts)
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        if len(headers) > self.max_headers:
            error = APIError(431, f"the request has {len(headers)} headers, above the limit of {self.max_headers} "
                                  f"(workbench serve --max-request-headers)", code="too_many_headers")
            await error.response()(scope, receive, send)
            return
        if self.hosts is not None:
            host = next((v.decode("latin-1") for k, v in headers if k == b"host"), "")
            if _host_name(host) not in self.hosts:
                error = APIError(400, f"Host {host[:80]!r} is not allowed; this server answers "
                                      f"{', '.join(sorted(self.hosts))} (workbench serve --allowed-hosts)",
                                 code="invalid_host")
                await error.response()(scope, receive, send)
                return

        async def nosniff(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-content-type-options", b"nosniff")]
            await send(message)

        await self.app(scope, receive, nosniff)


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode("utf-8") if isinstance(value, str) else value).digest()


class APIKeyMiddleware:
    """401 unless the request carries the key (`Authorization: Bearer <key>`), or, on a GET, a live
    session cookie; `/health`, the page and its static files stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = _digest(api_key)  # comparing digests keeps the comparison constant-time in length too
        self._sessions: dict[str, float] = {}  # token -> expiry (time.monotonic)

    def _header(self, scope: Scope, name: bytes) -> bytes | None:
        return next((v for k, v in scope.get("headers", ()) if k == name), None)

    def _bearer(self, scope: Scope) -> bytes | None:
        value = self._header(scope, b"authorization")
        return value[7:].strip() if value is not None and value[:7].lower() == b"bearer " else None

    def _session_ok(self, scope: Scope) -> bool:
        cookie = self._header(scope, b"cookie")
        if cookie is None or scope.get("method") != "GET":
            return False
        now = time.monotonic()
        self._sessions = {t: e for t, e in self._sessions.items() if e > now}
        for part in cookie.decode("latin-1").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE and value in self._sessions:
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        key = self._bearer(scope)
        ok = key is not None and hmac.compare_digest(_digest(key), self._key)
        if ok and path == SESSION_PATH and scope.get("method") == "POST":
            await self._new_session(scope, receive, send)
            return
        if ok or (key is None and self._session_ok(scope)):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer <key>'" if key is None else "invalid API key"
        await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)

    async def _new_session(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A page presented the key: a cookie its EventSource can send (HttpOnly, same-site only)."""
        token = secrets.token_urlsafe(24)
        self._sessions[token] = time.monotonic() + SESSION_TTL
        cookie = f"{COOKIE}={token}; Path=/; Max-Age={int(SESSION_TTL)}; HttpOnly; SameSite=Strict"
        await send({"type": "http.response.start", "status": 204,
                    "headers": [(b"set-cookie", cookie.encode("latin-1"))]})
        await send({"type": "http.response.body", "body": b""})


class _RedactFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_SECRET_QUERY.sub(r"\1[redacted]", a) if isinstance(a, str) else a
                                for a in record.args)
        if isinstance(record.msg, str):
            record.msg = _SECRET_QUERY.sub(r"\1[redacted]", record.msg)
        return True


def redact_access_log() -> None:
    """Secrets in query strings (`?api_key=...`, which the server refuses anyway) never reach the log."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RedactFilter) for f in logger.filters):
            logger.addFilter(_RedactFilter())
