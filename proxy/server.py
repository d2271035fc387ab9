"""The sidecar process: the API listener, the admin listener, and the drain on SIGTERM.

:class:`Server` binds both listeners and owns the shared services (key source, head table,
pool, HTTP relay). :func:`run` serves until SIGTERM/SIGINT, then drains: ``/readyz`` fails at
once, the API listener stops accepting, in-flight requests get ``shutdown.grace_seconds`` to
finish, WebSocket relays and upstream sockets close with 1001; exit code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.metadata
import ipaddress
import logging
import os
import platform
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.build import build_kind
from proxy.config import Settings
from proxy.core.conversation import HeadTable
from proxy.core.creators import OwnerRegistry
from proxy.core.explainer import MissExplainer
from proxy.errors import MemoryRefused, RequestError, invalid_url_body
from proxy.ingress.browsers import browser_guard
from proxy.ingress.creator_queries import install as install_owner_routes
from proxy.ingress.front import Cluster, Ingress, Resolver, WorkerPlacement, canonical_paths, post_responses
from proxy.ingress.listener import Guard, HardenedTCPSite, HardenedUnixSite
from proxy.intake.keys import KeySource
from proxy.intake.memory import MemoryGate, effective_settings, tune_allocator
from proxy.loop import loop_name
from proxy.loop import run as run_loop
from proxy.observe.health import Lifecycle, make_admin_app
from proxy.observe.log import setup_logging
from proxy.observe.metrics import BUILD_INFO, ERRORS
from proxy.reasons import Mode, Route
from proxy.serve.handlers import SERVICES, Services, refuse
from proxy.serve.objects import guard as object_guard
from proxy.serve.record import Record
from proxy.serve.relay import relay_websocket
from proxy.serve.streaming import json_body, new_request_id
from proxy.upstream.passthrough import Passthrough
from proxy.upstream.pool import Pool

__all__ = ["Server", "build_app", "run", "split_hostport"]

log = logging.getLogger(__name__)


class _MalformedRequestFilter(logging.Filter):
    """Keep the bytes of a malformed request out of the logs.

    aiohttp logs a parse failure with the exception, whose text quotes the offending header
    line: it may hold a credential the redaction net does not recognise (``x-api-key``).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "malformed HTTP request refused (%s)", (type(exc).__name__,)
            record.exc_info, record.exc_text = None, None
        return True


_FILTER = _MalformedRequestFilter()


_READ_BUFSIZE = 16 * 1024
"""aiohttp's per-connection read buffer limit: a connection whose body waits for
memory holds at most about twice this plus one socket read before reading pauses."""


def split_hostport(value: str) -> tuple[str, int]:
    """``"127.0.0.1:8080"``, ``"[::1]:8080"`` or ``":8080"`` → (host, port)."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


async def _get_responses(request: web.Request) -> web.StreamResponse:
    # The SDK's WebSocket URL is the POST path with a ws:// scheme (protocol.md §3.2).
    if request.headers.get("Upgrade", "").lower() == "websocket":
        return await relay_websocket(request)
    return await _passthrough(request)


async def _passthrough(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    rec = Record(new_request_id(), route=Route.OTHER, mode=Mode.PASSTHROUGH)
    svc = request.app[SERVICES]
    try:
        try:  # the stored objects the path and body name are the caller's, or the route is refused
            async with object_guard(svc, request) as (options, body):
                fwd = await svc.passthrough.forward(
                    request,
                    headers={"x-request-id": rec.request_id, "x-upshift-mode": "passthrough"},
                    body=body,
                    started=started,
                    options=options,
                )
        except (RequestError, MemoryRefused) as exc:
            shown = exc.headers(rec.request_id) if isinstance(exc, MemoryRefused) else {"x-request-id": rec.request_id}
            response = refuse(exc, shown, rec, started)
            rec.responded(response.status)
            return response
        rec.passed_through(fwd)
        return fwd.response
    finally:
        rec.finish()


async def _not_found(request: web.Request) -> web.Response:
    body = invalid_url_body(request.method, request.path)
    return web.Response(body=json_body(body), status=404, content_type="application/json")


@web.middleware
async def _canonical_paths(request: web.Request, handler: Any) -> web.StreamResponse:
    """:func:`proxy.ingress.front.canonical_paths` as the app's middleware."""
    return await canonical_paths(request, handler)


@web.middleware
async def _bugs_as_openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A bug becomes an OpenAI-shaped 500 (logged with its traceback), never a text page."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        ERRORS.labels("internal_error").inc()
        body = {
            "error": {
                "message": "The sidecar failed to process the request (an internal error; see its logs).",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
        }
        return web.Response(body=json_body(body), status=500, content_type="application/json")


def build_app(services: Services, ingress: Ingress | None = None) -> web.Application:
    """The API application (``listen``): ``/v1/responses`` and a relay for the rest of ``/v1``
    (with ``ingress``: routed through its cluster, and its peer proof answered)."""
    # The body limit is enforced by handlers.read_body while reading; aiohttp's own limit would
    # answer its own 413 shape, so it is set above ours.
    app = web.Application(
        client_max_size=services.settings.limits.max_body_bytes + 1,
        # No web pages; one spelling of every /v1 path (what is routed and checked is what is forwarded).
        middlewares=[_bugs_as_openai_errors, browser_guard(services.settings), _canonical_paths],
    )
    app[SERVICES] = services
    app.router.add_post("/v1/responses", post_responses)
    app.router.add_get("/v1/responses", _get_responses)
    if ingress is not None:
        ingress.install(app)
    install_owner_routes(app)  # the id-bearing /v1/responses/{id}... routes, owner queries
    app.router.add_route("*", "/v1/{tail:.*}", _passthrough)
    app.router.add_route("*", "/{tail:.*}", _not_found)

    async def _lifespan(app: web.Application) -> AsyncIterator[None]:
        await services.passthrough.start()
        services.pool.start()
        yield
        await services.pool.close(1001)
        await services.passthrough.close()

    async def _going_away(app: web.Application) -> None:
        # Runs before aiohttp waits for in-flight handlers: relays are sessions, not streams,
        # so they are told to go away now (1001) rather than holding the drain for its grace.
        services.pool.close_code = 1001
        for ws in list(services.relays):
            await ws.close(code=1001, message=b"going away")

    app.cleanup_ctx.append(_lifespan)
    app.on_shutdown.append(_going_away)
    return app


class Server:
    """Both listeners and the shared services of one sidecar.

    Args:
        settings: All settings; ``listen``/``admin_listen`` may use port 0 (tests).
        lifecycle: Shared with the admin app (a new one if omitted).
        worker: This process's place among ``--workers`` (proxy/supervisor.py): the API listener
            then shares its address (``SO_REUSEPORT``) and a private unix socket takes the
            other workers' forwards; the admin app goes to ``admin_path`` instead.
        admin_path: Unix socket for the admin app (a worker's, scraped by the supervisor).
        resolver: How ``cluster.peers_dns`` is resolved (tests inject one).
    """

    def __init__(
        self,
        settings: Settings,
        lifecycle: Lifecycle | None = None,
        *,
        worker: WorkerPlacement | None = None,
        admin_path: str | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        tune_allocator()  # large buffers get their own mappings, returned on free
        settings, derived = effective_settings(settings)  # limits derived from the budget
        self.settings = settings
        self.worker = worker
        self.admin_path = admin_path
        self.lifecycle = lifecycle or Lifecycle()
        server_log = logging.getLogger("aiohttp.server")
        if _FILTER not in server_log.filters:
            server_log.addFilter(_FILTER)
        m = settings.matching
        heads = HeadTable(
            max_heads=m.max_heads,
            ttl_seconds=m.head_ttl_seconds,
            tolerate=m.tolerances(),
            hot_bytes=m.hot_prefix_bytes,
            hot_seconds=m.hot_prefix_seconds,
        )
        # Who created each response id: the planner notes every head's, the handlers
        # every id an answer carries (through Services.owners).
        owners = OwnerRegistry.for_heads(m.max_heads)
        keys = KeySource(settings.api_key)
        self.ingress = Ingress(settings, worker=worker, resolver=resolver)
        pool = Pool(settings, heads, owners=owners)
        self.services = Services(settings, keys, heads, MissExplainer(heads), pool, Passthrough(settings, keys))
        limits = settings.limits
        self.services.memory = MemoryGate(
            derived,
            heads.prefixes,
            heads=heads,
            wait_seconds=limits.memory_wait_seconds,
            max_body_bytes=limits.max_body_bytes,
            whole_frames=not settings.pool.fragment_bytes,
        )
        api_app = build_app(self.services, self.ingress)
        self.guard = Guard(settings.listener)
        self.admin_guard = Guard(settings.listener)
        """The admin listener's own count under the same limits (no plain site)."""
        self._api = web.AppRunner(
            api_app,
            keepalive_timeout=settings.listener.keepalive_seconds,
            access_log=None,
            # aiohttp waits shutdown_timeout for handlers, then as long again after cancelling
            # only their payload: half of it each keeps the whole drain within the grace.
            shutdown_timeout=settings.shutdown.grace_seconds / 2,
            handle_signals=False,
            read_bufsize=_READ_BUFSIZE,
            auto_decompress=False,  # read_body decodes gzip/deflate within the limit
        )
        self._admin = web.AppRunner(
            make_admin_app(
                self.lifecycle, admin_listen=settings.admin_listen, allowed_hosts=settings.listener.allowed_hosts
            ),
            access_log=None,
            handle_signals=False,
            keepalive_timeout=settings.listener.keepalive_seconds,
        )
        self.api_address: tuple[str, int] = ("", 0)
        """Bound (host, port) of the API listener."""
        self.admin_address: tuple[str, int] = ("", 0)
        """Bound (host, port) of the admin listener."""

    @property
    def cluster(self) -> Cluster:
        """The ingress layer's cluster (membership, forwarding)."""
        return self.ingress.cluster

    async def start(self) -> None:
        """Bind both listeners, then mark the sidecar ready."""
        await self._admin.setup()
        if self.admin_path is not None:
            await HardenedUnixSite(self._admin, self.admin_path, self.admin_guard).start()
        else:
            host, port = split_hostport(self.settings.admin_listen)
            if os.environ.get("KUBERNETES_SERVICE_HOST") and _is_loopback(host):
                log.warning(
                    "admin_listen %s is loopback in a Kubernetes Pod: the kubelet's probes of the pod IP "
                    "cannot reach it (set UPSHIFT_ADMIN_LISTEN=0.0.0.0:%d, as the shipped manifests do)",
                    self.settings.admin_listen,
                    port,
                )
            await HardenedTCPSite(self._admin, host, port, self.admin_guard).start()
            self.admin_address = _bound(self._admin)
        await self._api.setup()
        self.api_address = await self.ingress.start(self._api, self.guard)
        self.lifecycle.mark_ready()
        if self.worker is not None:
            log.info("upshift worker %d listening on %s:%d", self.worker.index, *self.api_address)
        else:
            log.info("upshift listening on %s:%d (admin %s:%d)", *self.api_address, *self.admin_address)

    async def stop(self) -> None:
        """Drain and stop: ``/readyz`` fails, no new connections, in-flight requests get the
        grace period, relays and upstream sockets close with 1001, then the admin listener stops.
        """
        self.lifecycle.mark_draining()
        await self.ingress.stop_handoffs()  # senders fall back to forwarding or serve locally
        cutter = asyncio.create_task(self._cut_streams_at_grace())
        try:
            await self._api.cleanup()
        finally:
            cutter.cancel()
            await self.ingress.close()
        await self._admin.cleanup()

    async def _cut_streams_at_grace(self) -> None:
        """Just before the grace runs out, end streams still in flight with an error event
        (aiohttp would then close their connections mid-body)."""
        grace = self.settings.shutdown.grace_seconds
        await asyncio.sleep(max(grace - min(0.25, grace / 4), 0.0))
        await self.services.streams.cut_all()


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bound(runner: web.AppRunner) -> tuple[str, int]:
    address = next(a for a in runner.addresses if isinstance(a, tuple))
    return str(address[0]), int(address[1])


async def serve(server: Server, *, name: str = "", stop: asyncio.Event | None = None) -> int:
    """Start ``server``, serve until SIGTERM or SIGINT (or until ``stop`` is set), then drain.

    Returns the exit code: 1 when it cannot listen (said plainly, as ``name`` if given), else 0.
    """
    try:
        await server.start()
    except OSError as exc:  # e.g. the port is taken: say so plainly, exit 1
        log.error("%scannot listen: %s", f"{name} " if name else "", exc)
        await server.stop()
        return 1
    # What start-up built (modules, settings, tables, the compiled matcher) lives as long as the
    # process: frozen out of the collector, whose full passes under load would walk it all
    # again and again on the event loop.
    gc.collect()
    gc.freeze()
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received, draining for up to %g s", server.settings.shutdown.grace_seconds)
    await server.stop()
    return 0


def run(settings: Settings) -> int:
    """Serve until SIGTERM or SIGINT, drain, and return the exit code (0).

    One process (``workers`` above 1 is the supervisor's, :func:`proxy.supervisor.supervise`,
    which the command line chooses). On uvloop when it is installed (a default dependency on
    CPython outside Windows), else on asyncio's own loop; the choice, and the build (pure or
    compiled), are logged and exported as ``upshift_build_info``.
    """
    setup_logging(settings.logging)
    BUILD_INFO.labels(_version(), loop_name(), platform.python_version(), build_kind()).set(1)
    return run_loop(serve(Server(settings)))


def _version() -> str:
    try:
        return importlib.metadata.version("upshift")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
