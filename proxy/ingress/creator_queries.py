"""Who created an object id (a response, an item, a file, ...), asked across workers and
replicas, without a new datastore.

The process that returns an object id to an app records its creator's tenant first
(:mod:`proxy.serve.creator_check`). A later request naming that id may land anywhere (SO_REUSEPORT
spreads connections over the workers, a load balancer over the replicas, and chained requests
are never forwarded). So a process that does not know an id asks the others, in parallel:

* its sibling workers, on their private sockets (the filesystem sockets in the 0700 runtime
  directory that worker forwards use, the listener checked with ``SO_PEERCRED`` before a byte
  is sent), and
* every other replica, at its address as forwards reach it (TLS where peers use it), once it
  proved it holds the cluster secret, with the cluster's ``x-upshift-forwarded`` marker signed
  as forwards are (:mod:`proxy.ingress.peerauth`: an HMAC over method, path and query, time
  and nonce); the replica verifies it (a query not signed under its secret is answered 404)
  and asks its own workers. Without ``cluster.secret_file`` only a caller at the address of
  another replica of the peer set is answered (the marker alone proves nothing); a process
  with no replicas answers only its own workers, so no client learns whether an id exists.

``GET /_upshift/owner?id=<response id>&identity=<digest>`` answers ``{"verdict": "own" |
"foreign" | "unknown"}`` for that pair, compared by the identity's tenant (never an identity):
``foreign`` only for the process that created the id, so the first answer that is not
``unknown`` decides. A peer that does not answer within ``cluster.connect_timeout_seconds``
counts as ``unknown`` and is skipped for ``cluster.down_seconds``; behind an injected key an id
that stays unknown is refused (the safe direction: its creator is down, or its record was
evicted).

The narrow hook into the cluster (:class:`proxy.ingress.cluster.Cluster`) is read-only: its
``members``/``self_url`` (the replica set), ``worker`` (the private sockets), ``query_peer()``
(a peer of the query's own, reached as forwards reach it), ``proven()``, ``sign()`` /
``authentic()`` (the signed peer marker) and :func:`~proxy.ingress.cluster.arrived_privately`.
Nothing in the cluster's forwarding changes.
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
from yarl import URL

from proxy.errors import invalid_url_body
from proxy.ingress.cluster import Cluster, arrived_privately
from proxy.ingress.forward import Level, Peer
from proxy.ingress.front import CLUSTER
from proxy.ingress.peers import MARKER
from proxy.reasons import OwnerVerdict
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
        cluster: This process's cluster (peer set, private sockets, TLS, secret).
    """

    _LIMIT = 8
    """Connections kept per peer for owner queries (their own, beside the forwards')."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        c = cluster.settings.cluster
        self._timeout = c.connect_timeout_seconds
        self._down_for = c.down_seconds
        self._peers: dict[str, Peer] = {}

    @property
    def worker_names(self) -> tuple[str, ...]:
        """The sibling workers (``worker-<i>``)."""
        w = self.cluster.worker
        if w is None or w.count < 2:
            return ()
        return tuple(f"worker-{i}" for i in range(w.count) if i != w.index)

    @property
    def replica_urls(self) -> tuple[str, ...]:
        """Base URLs of the other replicas."""
        members = self.cluster.members
        return tuple(m for m in members if m != self.cluster.self_url) if len(members) > 1 else ()

    @property
    def has_peers(self) -> bool:
        return bool(self.worker_names or self.replica_urls or self.cluster.settings.cluster.peers_dns)

    async def close(self) -> None:
        peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            await peer.close()

    def _peer(self, name: str) -> Peer | None:
        peer = self._peers.get(name)
        if peer is None:
            peer = self.cluster.query_peer(name, self._LIMIT)
            if peer is not None:
                self._peers[name] = peer
        return peer

    async def verdict(self, identity: str, response_id: str) -> OwnerVerdict:
        """Ask every other process (workers, then replicas with their workers) at once."""
        return await self._ask(identity, response_id, replicas=True)

    async def workers_verdict(self, identity: str, response_id: str) -> OwnerVerdict:
        """Ask the sibling workers only (a replica answering another replica's question)."""
        return await self._ask(identity, response_id, replicas=False)

    async def _ask(self, identity: str, response_id: str, *, replicas: bool) -> OwnerVerdict:
        now = time.monotonic()
        names = list(self.worker_names) + (list(self.replica_urls) if replicas else [])
        if replicas:
            for gone in set(self._peers) - set(names):
                await self._peers.pop(gone).close()  # a replica that left the peer set
        targets = [p for p in map(self._peer, names) if p is not None and p.down_until <= now]
        if not targets:
            return OwnerVerdict.UNKNOWN
        asks = [asyncio.ensure_future(self._one(peer, identity, response_id)) for peer in targets]
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

    async def _one(self, peer: Peer, identity: str, response_id: str) -> OwnerVerdict:
        url = URL(QUERY_PATH).with_query({"id": response_id, "identity": identity})
        raw = str(url)
        headers = {}
        try:
            if peer.level is Level.REPLICA:
                if not await self.cluster.proven(peer):
                    return OwnerVerdict.UNKNOWN  # it never proved the secret: not asked (and skipped)
                headers[MARKER] = self.cluster.sign("GET", raw, "owner-" + os.urandom(8).hex())
            timeout = aiohttp.ClientTimeout(total=2 * self._timeout, sock_connect=self._timeout)
            async with peer.client().get(
                peer.url(raw), headers=headers, timeout=timeout, allow_redirects=False, server_hostname=peer.server_name
            ) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                answer = await resp.json()
            return OwnerVerdict(answer["verdict"])
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            if peer.down_until <= time.monotonic():
                log.warning(
                    "owner query to %s failed (%s): skipped for %g s", peer.name, type(exc).__name__, self._down_for
                )
            peer.down_until = time.monotonic() + self._down_for
            return OwnerVerdict.UNKNOWN


async def _query(request: web.Request) -> web.StreamResponse:
    """Answer another process: is this response id that identity's, another's, or unknown?"""
    cluster = request.app.get(CLUSTER)
    private = arrived_privately(request)
    marker = request.headers.get(MARKER)
    # A replica's query is signed as its forwards are (verified when this replica has a secret).
    allowed = private or (cluster is not None and marker is not None and cluster.authentic(request, marker))
    rid, identity = request.query.get("id"), request.query.get("identity")
    if not allowed or not rid or not identity:
        body = invalid_url_body(request.method, request.path)
        return web.Response(body=json_body(body), status=404, content_type="application/json")
    svc = request.app[SERVICES]
    found = svc.owners.registry.verdict(identity, rid)
    peers = request.app.get(_KEY)
    if found is OwnerVerdict.UNKNOWN and not private and isinstance(peers, PeerOwners):
        with contextlib.suppress(Exception):
            found = await peers.workers_verdict(identity, rid)
    return web.Response(body=json_body({"verdict": found.value}), content_type="application/json")
