"""Browsers are not clients: a web page must not reach the API listener.

A page the user opens can send requests to ``127.0.0.1:8080`` (a cross-site ``POST`` with a
``text/plain`` body needs no preflight; a WebSocket needs none at all), and DNS rebinding makes
the sidecar same-origin to a page of a foreign name. With an injected key that page would be
billed to the key and read the answers. Dev servers that bind loopback (Jupyter, Vite) check
``Host`` and ``Origin`` for the same reason; so does this middleware, before any handler runs:

* a request carrying ``Origin`` (every browser request but a same-origin ``GET``; every
  cross-origin ``POST`` and every WebSocket upgrade) is refused with 403 ``origin_not_allowed``
  unless the origin is listed in ``listener.allowed_origins``;
* on a loopback listener, ``Host`` must name the listen address, ``localhost``, a loopback IP
  (with this listener's port when a port is given) or a name in ``listener.allowed_hosts``
  (a rebound page sends its own name): else 403 ``host_not_allowed``; on any other listener,
  ``Host`` must be in ``listener.allowed_hosts`` (the gateway's Service names) when that list
  is set (empty: any Host, the replicas' and the Service's names being many);
* ``OPTIONS`` (a CORS preflight) is answered here, 204 without any ``access-control-*`` grant,
  and never relayed upstream. The sidecar never grants CORS (``access-control-*`` headers of
  relayed answers are dropped, :mod:`proxy.upstream.passthrough`), so a listed origin is let
  through, not invited.

The checks cover the API (``/v1`` and below); any other path is a 404 that relays nothing. The
SDKs and agents send no ``Origin`` and name the address they were given: unaffected.
Requests on a worker's private socket were checked by the worker they arrived at first.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.config import Settings, parse_hostport, peer_urls
from proxy.errors import ForeignHost, ForeignOrigin, RequestError
from proxy.ingress.cluster import arrived_privately
from proxy.observe.metrics import BROWSER_REFUSALS, ERRORS
from proxy.reasons import BrowserRefusal
from proxy.serve.streaming import new_request_id

__all__ = ["browser_guard"]

log = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ALLOW = "GET, POST, DELETE, OPTIONS"


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> tuple[str, int | None] | None:
    """``Host`` as (lower-case name without brackets, port or None); None when malformed."""
    value = value.strip().lower()
    if not value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if not rest:
            return name, None
        if not rest.startswith(":") or not rest[1:].isdigit():
            return None
        return name, int(rest[1:])
    name, colon, port = value.rpartition(":")
    if not colon:
        return value, None
    if not port.isdigit() or ":" in name:
        return None
    return name, int(port)


def _origin(value: str) -> str:
    """An origin compared case-insensitively, without a trailing slash."""
    return value.strip().rstrip("/").lower()


class _Policy:
    """What one API listener answers to."""

    def __init__(self, settings: Settings) -> None:
        lst = settings.listener
        self.origins = frozenset(_origin(o) for o in lst.allowed_origins)
        names: set[str] = set()
        for entry in lst.allowed_hosts:
            parsed = _split_host(entry)
            if parsed is not None:
                names.add(entry.strip().lower() if parsed[1] is not None else parsed[0])
        # The replicas name each other by their peer URLs (the owner's Host on a forward).
        for url in (*peer_urls(settings.cluster.peers), settings.cluster.self_url):
            parts = urlsplit(url)
            if parts.hostname:
                names.add(parts.netloc.lower())
        self.names = frozenset(names)
        host, _ = parse_hostport(settings.listen)
        self.listen_host = host.strip("[]").lower()
        self.loopback = _is_loopback(self.listen_host)
        self._good: set[str] = set()
        """``Host`` values already found good (a handful: the address and its spellings)."""

    def host_ok(self, request: web.Request) -> bool:
        raw = request.headers.get("Host", "")
        if raw in self._good:
            return True
        parsed = _split_host(raw)
        if parsed is None:
            return False
        name, port = parsed
        lowered = raw.strip().lower()
        if lowered in self.names or name in self.names:
            ok = True
        elif not self.loopback:
            ok = not self.names
        elif name == self.listen_host or _is_loopback(name):
            ok = port is None or port == _local_port(request)
        else:
            ok = False
        if ok and len(self._good) < 64:
            self._good.add(raw)
        return ok

    def origin_ok(self, origin: str) -> bool:
        return _origin(origin) in self.origins


def _local_port(request: web.Request) -> int | None:
    transport = request.transport
    if transport is None:
        return None
    sockname = transport.get_extra_info("sockname")
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return int(sockname[1])
    return None


def _refused(exc: RequestError, reason: BrowserRefusal) -> web.Response:
    ERRORS.labels(exc.code).inc()
    BROWSER_REFUSALS.labels(reason).inc()
    headers = {"Connection": "close", "x-request-id": new_request_id()}
    return web.json_response(exc.body(), status=exc.status, headers=headers)


def browser_guard(settings: Settings) -> Middleware:
    """The middleware for the API app of ``settings`` (``listener.allowed_origins``,
    ``listener.allowed_hosts``, the listen address)."""
    policy = _Policy(settings)

    @web.middleware
    async def guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if not request.path.startswith("/v1"):
            return await handler(request)  # outside the API: a 404, nothing relayed, no key used
        origin = request.headers.get("Origin")
        if origin is not None and not policy.origin_ok(origin):
            log.info("refused a browser request from a foreign origin (%s %s)", request.method, request.path)
            message = (
                "Requests from web pages are not accepted: this origin is not in the sidecar's "
                "listener.allowed_origins."
            )
            return _refused(ForeignOrigin(message), BrowserRefusal.ORIGIN)
        if not policy.host_ok(request) and not arrived_privately(request):
            log.info("refused a request for a foreign Host (%s %s)", request.method, request.path)
            message = "The Host header does not name this sidecar (see listener.allowed_hosts)."
            return _refused(ForeignHost(message), BrowserRefusal.HOST)
        if request.method == "OPTIONS":
            return web.Response(status=204, headers={"Allow": _ALLOW})
        return await handler(request)

    return guard
