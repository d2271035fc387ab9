"""The front of ``POST /v1/responses``: where is this request served?

The ingress layer reads the body within the limit under its memory lease, identifies the
caller and asks the cluster whether another process or replica owns the conversation (then
that one answers: a handoff of the connection or a forward of the bytes). Only a request
served here reaches the local handler (:func:`proxy.serve.handlers.serve`), as an
:class:`~proxy.serve.handlers.Arrival`: body, identity, record. The handler imports nothing
of the cluster, the handoff or the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time

from aiohttp import web

from proxy.config import Settings, parse_hostport
from proxy.core.reasons import BodyAbort, RequestOutcome
from proxy.errors import BodyTimeout, ConfigError, RequestError
from proxy.ingress.cluster import Cluster, Resolver, WorkerPlacement
from proxy.ingress.handoff import Receiver
from proxy.ingress.listener import Guard, HardenedTCPSite, HardenedUnixSite, protocol_factory
from proxy.ingress.peerauth import PROOF_PATH
from proxy.ops.metrics import BODIES_ABORTED, INFLIGHT, REQUEST_BYTES
from proxy.serve.handlers import SERVICES, Arrival, refuse, serve
from proxy.serve.memory import MemoryRefused
from proxy.serve.streaming import BodyClock, ClientGone, Record, body_length, new_request_id, read_body

log = logging.getLogger(__name__)

__all__ = ["CLUSTER", "Cluster", "Ingress", "Resolver", "WorkerPlacement", "post_responses"]

CLUSTER = web.AppKey("upshift_cluster", Cluster)
"""Conversation affinity: forwards a request to the process owning it (absent: serve here)."""

_NO_LEASE: contextlib.nullcontext[None] = contextlib.nullcontext()
"""Stands in for the memory lease when there is no gate (an app built without one)."""


async def post_responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    started = time.perf_counter()
    rec = Record(new_request_id())
    INFLIGHT.inc()
    svc = request.app[SERVICES]
    # issue 21: the body must be complete within limits.body_timeout_seconds of the head (and
    # keep a minimum rate), waiting for memory included.
    clock = BodyClock(svc.settings.limits, asyncio.get_running_loop().time())
    try:
        try:
            # The identity is known from the headers: the memory budget admits fairly by it.
            length = body_length(request)
            identity = svc.identity(request)
        except RequestError as exc:
            response: web.StreamResponse = refuse(exc, {"x-request-id": rec.request_id}, rec, started)
            rec.status = response.status
            return response
        # issue 12: the request's memory lease, from before its body is read until its answer
        # is written; a refusal (429/503 + retry-after) is answered here, nothing was read.
        lease = (
            svc.memory.lease(length, key=identity.digest, headers=_head_size(request), deadline=clock.deadline)
            if svc.memory
            else _NO_LEASE
        )
        try:
            async with lease as mem:
                try:
                    body = await read_body(request, svc.settings.limits.max_body_bytes, mem, clock)
                    rec.bytes_in = len(body)
                    REQUEST_BYTES.inc(len(body))
                    arrival = Arrival(request, body, identity, rec, started, mem)
                    routed = await _route(request, arrival)
                except ClientGone:
                    BODIES_ABORTED.labels(BodyAbort.CLIENT_GONE).inc()
                    log.info("the app closed its connection before its request body was complete")
                    rec.outcome, rec.status = RequestOutcome.CANCELLED, 499
                    return web.Response(status=400)  # nobody reads it: aiohttp drops it quietly
                except BodyTimeout as exc:
                    return await _timed_out(request, exc, rec, started)
                except RequestError as exc:
                    response = refuse(exc, {"x-request-id": rec.request_id}, rec, started)
                else:
                    response = routed if routed is not None else await serve(svc, arrival)
        except BodyTimeout as exc:  # the deadline passed while it waited for memory
            return await _timed_out(request, exc, rec, started)
        except MemoryRefused as exc:
            response = refuse(exc, exc.headers(rec.request_id), rec, started)
            rec.outcome = RequestOutcome.PROXY_ERROR
        rec.status = response.status
        if response.status >= 400 and not request.content.is_eof():
            _close_unread_at(request, clock.deadline)
        return response
    except asyncio.CancelledError:
        rec.outcome = RequestOutcome.CANCELLED
        raise
    except Exception:
        rec.outcome, rec.status = RequestOutcome.PROXY_ERROR, 500
        raise
    finally:
        INFLIGHT.dec()
        if not rec.added_s:
            rec.added_s = max(time.perf_counter() - started - rec.upstream_s, 0.0)
        rec.finish()


_LINGER = 10.0
"""How long aiohttp reads and drops an unread body after the answer (its ``lingering_time``)."""


def _close_unread_at(request: web.Request, deadline: float) -> None:
    """A refusal answered with the body unread: aiohttp then reads and drops the rest for a
    while (so the app sees the answer, not a reset), then closes; if the body's deadline comes
    first, it stops there."""
    loop = asyncio.get_running_loop()
    if deadline >= loop.time() + _LINGER:
        return  # the lingering ends first

    def close() -> None:
        if not request.content.is_eof() and request.transport is not None:
            request.protocol.force_close()

    loop.call_at(deadline, close)


def _head_size(request: web.Request) -> int:
    """Bytes of the request's head (they count against the memory budget)."""
    return len(request.raw_path) + sum(len(k) + len(v) + 4 for k, v in request.raw_headers) + 16


async def _timed_out(request: web.Request, exc: BodyTimeout, rec: Record, started: float) -> web.StreamResponse:
    """408 for a body that did not keep arriving, and the connection closed (never drained)."""
    BODIES_ABORTED.labels(BodyAbort.TOO_SLOW if exc.slow else BodyAbort.TIMEOUT).inc()
    why = "too slow" if exc.slow else "deadline"
    log.info("closed a connection whose request body did not keep arriving (%s)", why)
    response = refuse(exc, {"x-request-id": rec.request_id, "Connection": "close"}, rec, started)
    rec.status = response.status
    with contextlib.suppress(ConnectionError):
        await response.prepare(request)
        await response.write_eof()
    request.protocol.force_close()  # the rest of the body is not waited for (no lingering)
    return response


async def _route(request: web.Request, arrival: Arrival) -> web.StreamResponse | None:
    """The owner's answer when another process or replica owns the conversation, else None."""
    cluster = request.app.get(CLUSTER)
    if cluster is None:
        return None
    return await cluster.maybe_forward(request, arrival.body, arrival.identity, arrival.rec)


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
