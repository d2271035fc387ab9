"""Admin endpoints: ``/healthz`` (liveness), ``/readyz`` (startup + readiness), ``/metrics``,
and for people: ``/`` and ``/status`` (the live status page, :mod:`proxy.observe.status`) and ``/misses``
(the last explained misses as JSON, :mod:`proxy.observe.misses`). All read-only, none shows content.

Both probes are dependency-free and answer in well under 10 ms. Neither ever looks at the
upstream: a transient upstream error must not mark the whole Pod NotReady (readiness) or
restart the sidecar in a loop (liveness). ``/readyz`` only reflects the sidecar's own
lifecycle: 503 while starting and while draining.

Web pages get nothing here (:func:`admin_host_guard`): a DNS-rebound page would otherwise read
the status page, ``/misses`` and ``/metrics`` of a sidecar on the user's machine. Its ``Host``
names the page's own domain; every request whose ``Host`` is not ``localhost``, an IP address
(loopback, the listener's own, the pod IP the kubelet's probes and Prometheus send), the
admin listen name or a ``listener.allowed_hosts`` name gets 403 ``host_not_allowed``. An IP
address is never a rebound name: a page can only be same-origin with an address by being
served from it.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client.aiohttp import make_aiohttp_handler

from proxy.errors import ForeignHost
from proxy.observe.metrics import BROWSER_REFUSALS, ERRORS, REGISTRY
from proxy.observe.misses import RECENT
from proxy.observe.status import Sampler, misses_json, render_status, snapshot
from proxy.reasons import BrowserRefusal

__all__ = ["LIFECYCLE_KEY", "SAMPLER_KEY", "Lifecycle", "State", "admin_host_guard", "make_admin_app"]


class State(enum.Enum):
    """Lifecycle states; transitions only go forward."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


class Lifecycle:
    """The sidecar's lifecycle: starting → ready → draining.

    The server calls :meth:`mark_ready` once its listeners are bound and :meth:`mark_draining`
    on SIGTERM. Draining is final: a late ``mark_ready`` does not undo it.
    """

    def __init__(self) -> None:
        self.state = State.STARTING
        """Current state."""

    def mark_ready(self) -> None:
        """Listeners are bound and config loaded: ``/readyz`` answers 200."""
        if self.state is State.STARTING:
            self.state = State.READY

    def mark_draining(self) -> None:
        """Shutdown began: ``/readyz`` answers 503 from now on."""
        self.state = State.DRAINING

    @property
    def ready(self) -> bool:
        """Whether the sidecar accepts new work (ready and not draining)."""
        return self.state is State.READY

    @property
    def draining(self) -> bool:
        """Whether shutdown began."""
        return self.state is State.DRAINING

    def __repr__(self) -> str:
        return f"<Lifecycle {self.state.value}>"


LIFECYCLE_KEY = web.AppKey("lifecycle", Lifecycle)
"""The :class:`Lifecycle` of the admin app."""


async def _healthz(request: web.Request) -> web.Response:
    # Answering at all proves the event loop is alive; that is the whole liveness check.
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    lifecycle = request.app[LIFECYCLE_KEY]
    if lifecycle.ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "unavailable", "reason": lifecycle.state.value}, status=503)


SAMPLER_KEY = web.AppKey("status_sampler", Sampler)
"""The :class:`~proxy.observe.status.Sampler` behind the status page's chart."""

_NO_STORE = {"Cache-Control": "no-store"}


async def _status(request: web.Request) -> web.Response:
    sampler = request.app[SAMPLER_KEY]
    state = request.app[LIFECYCLE_KEY].state.value
    page = render_status(list(sampler.samples), snapshot(), RECENT, state, sampler.interval)
    return web.Response(text=page, content_type="text/html", headers=_NO_STORE)


async def _misses(request: web.Request) -> web.Response:
    try:
        limit = int(request.query.get("limit", "0")) or None
    except ValueError:
        limit = None
    return web.json_response(misses_json(RECENT, limit), headers=_NO_STORE)


def _host_name(value: str) -> str | None:
    """The name of a ``Host`` value (lower case, IPv6 without brackets, no port); ``None`` when
    it is malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :] if end > 0 else ":"
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return value[1:end]
    name, colon, port = value.rpartition(":")
    if not colon:
        return value or None
    if not port.isdigit() or ":" in name or not name:
        return None
    return name


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def admin_host_guard(admin_listen: str, allowed_hosts: Iterable[str] = ()) -> Middleware:
    """The admin listener's ``Host`` check (see the module docstring): ``localhost``, an IP
    address, the host of ``admin_listen`` or a name of ``allowed_hosts``; requests on a unix
    socket (a worker's admin socket, scraped by its supervisor) are not checked."""
    listen_name = _host_name(admin_listen)
    names = {n for n in (_host_name(h) for h in allowed_hosts) if n}
    exact = {h.strip().lower() for h in allowed_hosts}
    if listen_name and listen_name not in ("0.0.0.0", "::"):
        names.add(listen_name)

    def allowed(raw: str) -> bool:
        name = _host_name(raw)
        if name is None:
            return False
        return name == "localhost" or _is_address(name) or name in names or raw.strip().lower() in exact

    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        transport = request.transport
        unix = transport is not None and isinstance(transport.get_extra_info("sockname"), str | bytes)
        if not unix and not allowed(request.headers.get("Host", "")):
            exc = ForeignHost("The Host header does not name this admin listener (see listener.allowed_hosts).")
            ERRORS.labels(exc.code).inc()
            BROWSER_REFUSALS.labels(BrowserRefusal.HOST).inc()
            return web.json_response(exc.body(), status=exc.status, headers={"Connection": "close", **_NO_STORE})
        return await handler(request)

    return guard


def make_admin_app(
    lifecycle: Lifecycle,
    *,
    sample_seconds: float = 5.0,
    admin_listen: str = "127.0.0.1:9090",
    allowed_hosts: Iterable[str] = (),
) -> web.Application:
    """The admin application: ``GET /healthz``, ``/readyz``, ``/metrics``, ``/``, ``/status``,
    ``/misses``, nothing else.

    Args:
        lifecycle: Shared with the server, which moves it forward.
        sample_seconds: How often the status page's chart samples the counters (15 minutes kept).
        admin_listen: The listen address (its host is a name the listener answers to).
        allowed_hosts: Further ``Host`` names it answers to (``listener.allowed_hosts``).

    Returns:
        An aiohttp application to serve on ``admin_listen`` (run it with ``access_log=None``:
        probes every second would flood the log).
    """
    app = web.Application(middlewares=[admin_host_guard(admin_listen, allowed_hosts)])
    app[LIFECYCLE_KEY] = lifecycle
    sampler = app[SAMPLER_KEY] = Sampler(sample_seconds, 900.0)

    async def _sampling(app: web.Application) -> AsyncIterator[None]:
        sampler.start()
        yield
        await sampler.stop()

    app.cleanup_ctx.append(_sampling)
    app.router.add_get("/", _status)
    app.router.add_get("/status", _status)
    app.router.add_get("/misses", _misses)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    # Only proxy.observe.metrics.REGISTRY: metrics hold bounded labels, never request data.
    app.router.add_get("/metrics", make_aiohttp_handler(REGISTRY))
    return app
