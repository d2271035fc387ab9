"""Response-id owners across workers and replicas (issue 22), without a new datastore.

The process that returns a response id to an app records its creator first
(:mod:`proxy.serve.owners`). A later request naming that id may land anywhere (SO_REUSEPORT
spreads connections over the workers, a load balancer over the replicas, and chained requests
are never forwarded). So a process that does not know an id asks the others, in parallel:

* its sibling workers, on their private unix sockets (the ones worker forwards use), and
* every other replica, at its API address with the cluster's ``x-upshift-forwarded`` marker
  (signed with ``cluster.secret_file`` when set); the replica that answers asks its own workers.

``GET /_upshift/owner?id=<response id>&identity=<digest>`` answers ``{"verdict": "own" |
"foreign" | "unknown"}`` for that pair (never an identity): ``foreign`` only for the process
that created the id, so the first answer that is not ``unknown`` decides. A peer that does not
answer within ``cluster.connect_timeout_seconds`` counts as ``unknown`` and is skipped for
``cluster.down_seconds``; behind an injected key an id that stays unknown is refused (the safe
direction: its creator is down, or its record was evicted).

The narrow hook into the cluster (:class:`proxy.ingress.cluster.Cluster`) is read-only: its
``members``/``self_url`` (the replica set), ``worker`` (the private sockets), ``marker()`` /
``verify()`` (the peer marker) and :func:`~proxy.ingress.cluster.arrived_privately`. Nothing
in the cluster's forwarding changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from proxy.contracts import AbstractUnixConnector
from proxy.core.reasons import OwnerVerdict
from proxy.ingress.cluster import MARKER, Cluster, arrived_privately
from proxy.ingress.front import CLUSTER
from proxy.serve.handlers import SERVICES
from proxy.serve.responses import add_routes as add_response_routes
from proxy.serve.streaming import json_body

__all__ = ["QUERY_PATH", "PeerOwners", "install"]

log = logging.getLogger(__name__)

QUERY_PATH = "/_upshift/owner"
"""Where a process asks another about a response id."""

_KEY = web.AppKey("upshift_peer_owners", object)


def install(app: web.Application) -> None:
    """The id-bearing ``/v1/responses/...`` routes and the peer owner query, on the API app;
    at startup, the owner book learns to ask the cluster's other processes."""
    add_response_routes(app)
    app.router.add_get(QUERY_PATH, _query)
    app.cleanup_ctx.append(_peers)


async def _peers(app: web.Application) -> AsyncIterator[None]:
    cluster = app.get(CLUSTER)
    svc = app[SERVICES]
    peers = PeerOwners(cluster) if cluster is not None else None
    if peers is not None and peers.has_peers:
        svc.owners.remote = peers
        app[_KEY] = peers
    yield
    if peers is not None:
        await peers.close()


class PeerOwners:
    """Asks the other workers and replicas whose a response id is.

    Args:
        cluster: This process's cluster (peer set, marker).
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        c = cluster.settings.cluster
        self._timeout = c.connect_timeout_seconds
        self._down_for = c.down_seconds
        self._down: dict[str, float] = {}
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    @property
    def worker_paths(self) -> tuple[str, ...]:
        """Private sockets of the sibling workers."""
        w = self.cluster.worker
        if w is None or w.count < 2:
            return ()
        return tuple(path for i, path in enumerate(w.sockets) if i != w.index)

    @property
    def replica_urls(self) -> tuple[str, ...]:
        """Base URLs of the other replicas."""
        members = self.cluster.members
        return tuple(m for m in members if m != self.cluster.self_url) if len(members) > 1 else ()

    @property
    def has_peers(self) -> bool:
        return bool(self.worker_paths or self.replica_urls or self.cluster.settings.cluster.peers_dns)

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    def _session(self, name: str, path: str | None) -> aiohttp.ClientSession:
        session = self._sessions.get(name)
        if session is None or session.closed:
            connector = AbstractUnixConnector(path=path, limit=8) if path is not None else aiohttp.TCPConnector(limit=0)
            session = aiohttp.ClientSession(
                connector=connector,
                trust_env=False,
                timeout=aiohttp.ClientTimeout(total=2 * self._timeout, sock_connect=self._timeout),
            )
            self._sessions[name] = session
        return session

    async def verdict(self, identity: str, response_id: str) -> OwnerVerdict:
        """Ask every other process (workers, then replicas with their workers) at once."""
        return await self._ask(identity, response_id, replicas=True)

    async def workers_verdict(self, identity: str, response_id: str) -> OwnerVerdict:
        """Ask the sibling workers only (a replica answering another replica's question)."""
        return await self._ask(identity, response_id, replicas=False)

    async def _ask(self, identity: str, response_id: str, *, replicas: bool) -> OwnerVerdict:
        now = time.monotonic()
        targets: list[tuple[str, str | None, str]] = [
            (f"worker:{path}", path, "http://localhost") for path in self.worker_paths
        ]
        if replicas:
            targets += [(url, None, url) for url in self.replica_urls]
        targets = [t for t in targets if self._down.get(t[0], 0.0) <= now]
        if not targets:
            return OwnerVerdict.UNKNOWN
        asks = [
            asyncio.ensure_future(self._one(name, path, base, identity, response_id)) for name, path, base in targets
        ]
        try:
            for done in asyncio.as_completed(asks):
                found = await done
                if found is not OwnerVerdict.UNKNOWN:
                    return found
        finally:
            for task in asks:
                task.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        return OwnerVerdict.UNKNOWN

    async def _one(self, name: str, path: str | None, base: str, identity: str, response_id: str) -> OwnerVerdict:
        headers = {}
        if path is None:
            headers[MARKER] = self.cluster.marker("owner-" + os.urandom(8).hex())
        try:
            session = self._session(name, path)
            params = {"id": response_id, "identity": identity}
            async with session.get(base + QUERY_PATH, params=params, headers=headers) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                answer = await resp.json()
            return OwnerVerdict(answer["verdict"])
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            if self._down.get(name, 0.0) <= time.monotonic():
                log.warning("owner query to %s failed (%s): skipped for %g s", name, type(exc).__name__, self._down_for)
            self._down[name] = time.monotonic() + self._down_for
            return OwnerVerdict.UNKNOWN


async def _query(request: web.Request) -> web.StreamResponse:
    """Answer another process: is this response id that identity's, another's, or unknown?"""
    cluster = request.app.get(CLUSTER)
    private = arrived_privately(request)
    marker = request.headers.get(MARKER)
    allowed = private or (cluster is not None and marker is not None and cluster.verify(marker) != "false")
    rid, identity = request.query.get("id"), request.query.get("identity")
    if not allowed or not rid or not identity:
        body = {
            "error": {
                "message": f"Invalid URL ({request.method} {request.path})",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        return web.Response(body=json_body(body), status=404, content_type="application/json")
    svc = request.app[SERVICES]
    found = svc.owners.registry.verdict(identity, rid)
    peers = request.app.get(_KEY)
    if found is OwnerVerdict.UNKNOWN and not private and isinstance(peers, PeerOwners):
        with contextlib.suppress(Exception):
            found = await peers.workers_verdict(identity, rid)
    return web.Response(body=json_body({"verdict": found.value}), content_type="application/json")
