"""The guard in front of every route: who may call, from where, with what; and a bug's 500 in the API's shape.

A local server is reachable from every web page its user visits, so the
guard (a pure ASGI middleware: under Starlette's BaseHTTPMiddleware a
handler never sees its client leave) refuses what a browser could send on a
page's behalf: a Host that is not the address the server is bound to (DNS
rebinding), an Origin not allowed with --cors (`--cors localhost`: every
loopback origin, any port, as llama-server's --cors-origins takes it) other
than the server's own (its web UI's: an Origin equal to the Host), and a
POST body that is not application/json (the "simple requests" a page may
send without asking). A preflight from another origin is answered without
CORS headers, which is how a browser learns that it may not ask.
With --api-key, every route but /health (and /v1/health) and the web UI's files wants one of the keys.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from urllib.parse import urlsplit

from fastapi.responses import Response
from starlette.datastructures import Headers

from .. import webui
from ..options import ServerOptions
from ..protocol import ApiError, error_response

log = logging.getLogger("kvsession.server")

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WILDCARD = {"0.0.0.0", "::", ""}
PUBLIC = {"/health", "/v1/health"}  # answered without a key (a load balancer's probe); and the web UI's files


def authorized(headers: Headers, keys: tuple[str, ...]) -> bool:
    """Whether the request carries one of the API keys (any request does on a server without keys)."""
    if not keys:
        return True
    key = _key(headers)
    # each key compared, all of them, in constant time: the time taken says nothing of which one matched
    return any([hmac.compare_digest(key, k.encode("utf-8", "surrogateescape")) for k in keys])


def owner(headers: Headers, keys: tuple[str, ...]) -> str | None:
    """Who a stored response belongs to: a digest of the request's API key (the key itself is never written to
    disk); None on a server without keys."""
    return hashlib.sha256(_key(headers)).hexdigest()[:32] if keys else None


def _key(headers: Headers) -> bytes:
    auth = headers.get("authorization", "")
    key = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
    return key.encode("utf-8", "surrogateescape")


class Guard:
    """Refuses, before any route runs: a foreign Host or Origin, a non-JSON POST body, a missing API key, a body
    over the limit. Adds CORS headers for the origins --cors allows. Answers a bug's exception as a 500 in the
    API's shape, and keeps the connection: Starlette's handler for Exception re-raises after answering, and
    uvicorn then closes the connection, so a keep-alive client lost it with its one failed request."""

    def __init__(self, app, options: ServerOptions):
        self.app, self.options = app, options
        self.public = PUBLIC | (webui.PATHS if options.webui else set())
        hosts = set(options.hosts)
        self.hosts = None if hosts & WILDCARD else (hosts | LOOPBACK if hosts & LOOPBACK else hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        problem = self.check(scope, headers, origin)
        if problem is not None:
            return await error_response(problem, scope["path"])(scope, receive, send)
        if origin is None:
            return await self.run(scope, receive, send)
        if _preflight(scope, headers):  # 200 as llama-server answers it; CORS headers only for an allowed origin
            allowed = self.cors_headers(origin) + [
                (b"Access-Control-Allow-Methods", b"GET, POST, DELETE, OPTIONS"),
                (b"Access-Control-Allow-Headers", headers.get("access-control-request-headers", "").encode("latin-1")),
                (b"Access-Control-Max-Age", b"600")] if self.allows(origin) else []
            response = Response(status_code=200)
            response.raw_headers.extend(allowed)
            return await response(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + self.cors_headers(origin)
            await send(message)

        await self.run(scope, receive, send_with_cors)

    async def run(self, scope, receive, send) -> None:
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if started:  # half a response cannot become an error: uvicorn closes the connection
                raise
            log.exception("%s %s failed", scope["method"], scope["path"])
            await error_response(ApiError(500, f"internal error: {type(e).__name__}", "server_error"),
                                 scope["path"])(scope, receive, send)

    def check(self, scope, headers: Headers, origin: str | None) -> ApiError | None:
        if self.hosts is not None and "host" in headers:
            name = _hostname(headers["host"])
            if name not in self.hosts:
                return ApiError(403, f"Host {name!r} is not this server's address (DNS rebinding is refused; bind "
                                "with --host to serve another name)", "permission_error")
        if origin is not None and not self.allows(origin) and not self.same_origin(origin, headers) and \
                not _preflight(scope, headers):
            return ApiError(403, f"cross-origin request from {origin!r} refused (allow an origin with --cors ORIGIN)",
                            "permission_error")
        if scope["method"] == "OPTIONS":
            return None
        if scope["path"] not in self.public and not authorized(headers, self.options.api_keys):
            return ApiError(401, "invalid or missing API key", "authentication_error")
        size = headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.options.max_body_bytes:
            return ApiError(413, f"request body over {self.options.max_body_bytes} bytes", "request_too_large")
        has_body = (size is not None and size != "0") or "transfer-encoding" in headers
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if scope["method"] in ("POST", "PUT", "PATCH") and has_body and not (
                kind == "application/json" or kind.endswith("+json")):
            return ApiError(415, f"the body must be application/json, not {kind or 'untyped'}",
                            "invalid_request_error")
        return None

    def allows(self, origin: str) -> bool:
        """An origin --cors names, or any loopback one (http or https, any port) when it names "localhost"."""
        if origin in self.options.cors:
            return True
        if "localhost" not in self.options.cors:
            return False
        try:
            url = urlsplit(origin)
            url.port  # noqa: B018 -- a port that is not a number raises
        except ValueError:
            return False
        return url.scheme in ("http", "https") and url.hostname in LOOPBACK and url.path == ""

    def same_origin(self, origin: str, headers: Headers) -> bool:
        """A page of this server calling it (the web UI): its Origin is the Host it was loaded from. Only where that
        Host is known to be this server's (the Host check above ran), or an IP address: a DNS rebinding page's
        name can point at a server bound to every address, and its Origin is then its Host too."""
        host = headers.get("host")
        try:
            url = urlsplit(origin)
        except ValueError:
            return False
        if host is None or url.scheme not in ("http", "https") or url.netloc.lower() != host.lower() or url.path:
            return False
        return self.hosts is not None or _is_address(_hostname(host))

    @staticmethod
    def cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
        """Raw, in the case llama-server writes them: header names are case-blind, but clients that keep headers
        in a plain dict (llama.cpp's own tests among them) look them up as written."""
        return [(b"Access-Control-Allow-Origin", origin.encode("latin-1")), (b"Vary", b"Origin")]


def _preflight(scope, headers: Headers) -> bool:
    return scope["method"] == "OPTIONS" and "access-control-request-method" in headers


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _hostname(host: str) -> str:
    """The name of a Host header without its port: "[::1]:8000" -> "::1", "localhost:80" -> "localhost"."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
