"""Admin endpoints: ``/healthz`` (liveness), ``/readyz`` (startup + readiness), ``/metrics``,
and for people: ``/`` and ``/status`` (the live status page, :mod:`proxy.ops.status`) and ``/misses``
(the last explained misses as JSON, :mod:`proxy.ops.misses`). All read-only, none shows content.

Both probes are dependency-free and answer in well under 10 ms. Neither ever looks at the
upstream: a transient upstream error must not mark the whole Pod NotReady (readiness) or
restart the sidecar in a loop (liveness). ``/readyz`` only reflects the sidecar's own
lifecycle: 503 while starting and while draining.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from proxy.ops.metrics import REGISTRY
from proxy.ops.misses import RECENT
from proxy.ops.status import Sampler, misses_json, render_status, snapshot

__all__ = ["LIFECYCLE_KEY", "SAMPLER_KEY", "Lifecycle", "State", "make_admin_app"]


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
"""The :class:`~proxy.ops.status.Sampler` behind the status page's chart."""

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


def make_admin_app(lifecycle: Lifecycle, *, sample_seconds: float = 5.0) -> web.Application:
    """The admin application: ``GET /healthz``, ``/readyz``, ``/metrics``, ``/``, ``/status``,
    ``/misses``, nothing else.

    Args:
        lifecycle: Shared with the server, which moves it forward.
        sample_seconds: How often the status page's chart samples the counters (15 minutes kept).

    Returns:
        An aiohttp application to serve on ``admin_listen`` (run it with ``access_log=None``:
        probes every second would flood the log).
    """
    app = web.Application()
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
    # Only proxy.ops.metrics.REGISTRY: metrics hold bounded labels, never request data.
    app.router.add_get("/metrics", make_aiohttp_handler(REGISTRY))
    return app
