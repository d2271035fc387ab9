"""The front of ``POST /v1/responses``: where is this request served?

The ingress layer receives the request (:mod:`proxy.ingress.reception`: the caller's
identity, the body read within the limit, in time, under its memory lease) and asks the
cluster whether another process or replica owns the conversation (then that one answers: a
handoff of the connection or a forward of the bytes). Only a request served here reaches the
local handler (:func:`proxy.serve.handlers.serve`), as an :class:`~proxy.serve.handlers.Arrival`:
body, identity, record. The handler imports nothing of the cluster, the handoff or the workers.
"""

from __future__ import annotations

import ssl
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from aiohttp import web

from proxy.config import Settings, parse_hostport
from proxy.errors import ConfigError, InvalidRequest
from proxy.ingress.cluster import Cluster
from proxy.ingress.handoff import Receiver
from proxy.ingress.listener import Guard, HardenedTCPSite, HardenedUnixSite, protocol_factory
from proxy.ingress.peerauth import PROOF_PATH
from proxy.ingress.peers import Resolver, WorkerPlacement
from proxy.ingress.reception import Reception
from proxy.reasons import Mode, Route
from proxy.serve.handlers import SERVICES, refuse
from proxy.serve.record import Record
from proxy.serve.streaming import new_request_id

__all__ = [
    "CLUSTER",
    "Cluster",
    "Ingress",
    "Resolver",
    "WorkerPlacement",
    "canonical_paths",
    "path_fault",
    "post_responses",
]

CLUSTER = web.AppKey("upshift_cluster", Cluster)
"""Conversation affinity: forwards a request to the process owning it (absent: serve here)."""


async def post_responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``: received (:class:`~proxy.ingress.reception.Reception`), then
    answered by the process or replica owning the conversation, else here."""
    return await Reception(request, request.app[SERVICES]).answer(request.app.get(CLUSTER))


def path_fault(raw_path: str) -> str | None:
    """Why an app's ``/v1`` path (the request target as sent, still percent-encoded) is not
    canonical, or ``None``.

    A path is routed, checked and forwarded only in its one spelling: with an empty segment
    (``/v1//responses/ID``), a ``;`` parameter (``/v1/files/..;/responses/ID``), an encoded or
    back slash, or a dot segment, a front end or the upstream could resolve it to a route other
    than the one the sidecar matched and checked; an absolute-form target (``GET http://host/v1/…``)
    is routed by its path but relayed by its whole text. Paths outside ``/v1`` are not the
    upstream's.
    """
    path = raw_path.partition("?")[0]
    if not path.startswith("/"):  # absolute-form (a proxy's request line): never an app's
        return "an absolute-form target" if urlsplit(path).path.startswith("/v1") else None
    if not path.startswith("/v1"):
        return None
    lowered = path.lower()
    if ";" in path or "%3b" in lowered:
        return "a ';' parameter"
    if "%2f" in lowered or "%5c" in lowered or "\\" in path:
        return "an encoded or back slash"
    segments = path.split("/")[1:]
    if "" in segments:
        return "an empty segment"
    if any(unquote(segment) in (".", "..") for segment in segments):
        return "a dot segment"
    return None


async def canonical_paths(request: web.Request, handler: Any) -> web.StreamResponse:
    """Refuse a ``/v1`` path that is not canonical (:func:`path_fault`) before it is routed:
    what is matched, checked and forwarded is then one and the same path. The app's middleware
    (:mod:`proxy.server`) calls it: a compiled function takes no ``@web.middleware`` mark."""
    fault = path_fault(request.raw_path)
    if fault is None:
        response: web.StreamResponse = await handler(request)
        return response
    path = request.raw_path.partition("?")[0]
    rec = Record(new_request_id(), route=Route.OTHER, mode=Mode.PASSTHROUGH)
    try:
        exc = InvalidRequest(f"Invalid URL ({request.method} {path}): the path has {fault}.")
        response = refuse(exc, {"x-request-id": rec.request_id}, rec, time.perf_counter())
        rec.responded(response.status)
        return response
    finally:
        rec.finish()


class Ingress:
    """The ingress layer of one process, built for :class:`proxy.server.Server` (which imports
    nothing of the cluster, the handoff or the workers): the conversation-affinity cluster,
    the API listener's sites (TCP; a worker's private unix socket; the TLS peer listener), and
    a worker's handoff receiver.

    Args:
        settings: All settings.
        worker: This process's place among ``--workers`` (``None``: a single process).
        resolver: How ``cluster.peers_dns`` is resolved (tests inject one).
    """

    def __init__(
        self, settings: Settings, *, worker: WorkerPlacement | None = None, resolver: Resolver | None = None
    ) -> None:
        self.settings = settings
        self.worker = worker
        self.cluster = Cluster(settings, worker=worker, resolver=resolver)
        self._handoffs: Receiver | None = None
        self.peer_address: tuple[str, int] | None = None
        """Bound (host, port) of the peer listener (``cluster.peer_listen``), if any."""

    def install(self, app: web.Application) -> None:
        """Wire the cluster into the API app (call before its catch-all routes)."""
        app[CLUSTER] = self.cluster
        app.router.add_get(PROOF_PATH, self.cluster.prove)
        app.on_response_prepare.append(self._mark_owner)

    async def _mark_owner(self, request: web.Request, response: web.StreamResponse) -> None:
        self.cluster.on_prepare(request, response)

    async def start(self, runner: web.BaseRunner, guard: Guard) -> tuple[str, int]:
        """Start the cluster and every API site of ``runner``; the bound API (host, port)."""
        await self.cluster.start()
        settings, worker = self.settings, self.worker
        host, port = parse_hostport(settings.listen)
        api = HardenedTCPSite(runner, host, port, guard, reuse_port=worker is not None)
        await api.start()
        c = settings.cluster
        if c.peer_listen:
            peer_host, peer_port = parse_hostport(c.peer_listen)
            peer = HardenedTCPSite(runner, peer_host, peer_port, guard, tls=_tls_server(settings))
            await peer.start()
            self.peer_address = (peer_host, peer.port)
        if worker is not None:
            await HardenedUnixSite(runner, worker.sockets[worker.index], guard).start()
            if c.handoff and worker.handoffs:
                self._handoffs = Receiver(
                    worker.handoffs[worker.index],
                    protocol_factory(runner, guard, adopted=True),
                    guard,
                    max_prefix=settings.limits.max_body_bytes,
                    sessions=c.max_forwards_per_peer * max(worker.count - 1, 1),
                    timeout=2 * c.connect_timeout_seconds + 1.0,
                    trust=worker.trust,
                )
                await self._handoffs.start()
        return host, api.port

    async def stop_handoffs(self) -> None:
        """Stop taking handoffs (a sender in the middle of one falls back)."""
        if self._handoffs is not None:
            await self._handoffs.close()

    async def close(self) -> None:
        await self.cluster.close()


def _tls_server(settings: Settings) -> ssl.SSLContext:
    c = settings.cluster
    if not (c.tls_cert_file and c.tls_key_file):
        raise ConfigError("cluster.peer_listen needs cluster.tls_cert_file and cluster.tls_key_file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(c.tls_cert_file, c.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cluster.tls_cert_file/tls_key_file: cannot load: {exc}") from None
    return context
