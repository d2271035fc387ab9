"""Conversation affinity across processes: a request that reaches a non-owner is forwarded once.

Every process computes the owner of a ``POST /v1/responses`` from its body alone
(:mod:`proxy.core.affinity`), at two levels: first the *replica* (rendezvous over
``cluster.peers`` or the addresses of ``cluster.peers_dns``), then, on a machine running
``--workers N``, the *worker* (rendezvous over the N workers). A request on the wrong process is
forwarded (aiohttp's client, :mod:`proxy.ingress.forward`) to the owner's listener (a replica's
URL, or a worker's private unix socket); the answer streams back unchanged.

Rules:

* **Once per level, never a loop.** A replica forward carries ``x-upshift-forwarded``; a request
  with that header is never forwarded to another replica again, whatever the receiver thinks
  of membership. A worker forward arrives on the private socket and is never forwarded again.
  So a request makes at most two hops (replica, then worker).
* **Peers prove who they are** (:mod:`proxy.ingress.peers` says how): with ``cluster.secret_file``
  replica forwards are signed and go only to replicas that proved they hold the secret; they
  travel over TLS unless ``cluster.plain_http_peers`` says otherwise.
* **An owner that is down or slow is skipped.** The owner must accept the forward (connect,
  then answer ``Expect: 100-continue``: proof that its event loop runs) within
  ``cluster.connect_timeout_seconds``; otherwise it is marked down for ``cluster.down_seconds``
  and the next owner in rendezvous order is tried, then this process serves the request itself
  (a full send). Every process skips the same down owner, so its conversations continue on
  their next owner after one full send each. A 5xx that did not come from an upshift request
  path (no ``x-upshift-owner``), or upshift's own listener refusal, is treated alike.
* **A forward that fails before the owner answered is served locally** (the same rule as an
  upstream socket closed before the first event); after the answer started, a cut SSE stream
  ends with one nested ``error`` event (complete events only are relayed, so the error never
  lands inside a half event), and a JSON answer, buffered whole, becomes a 502 OpenAI body.
* **Bounded.** At most ``cluster.max_forwards_per_peer`` forwards in flight per peer (more wait
  up to the connect timeout for a slot, then are served locally) and as many idle keep-alive
  connections; nothing else is kept per request.

Apps that chain themselves (``previous_response_id``, ``conversation``) have no root and are
served where they land: the upstream continues a stored response from any socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy.config import Settings, parse_hostport, peer_urls
from proxy.core.affinity import owner_key, rank, root_digest
from proxy.errors import ConfigError
from proxy.ingress.forward import (
    OWNER_HEADER,
    REFUSED_HEADER,
    Level,
    Peer,
    PeerError,
    relay,
    replica_peer,
    send,
    worker_peer,
)
from proxy.ingress.handoff import HANDED_OFF, Handoff, HandoffOutcome, arrived_by_handoff
from proxy.ingress.peerauth import PROOF_HEADER, PROOF_SECONDS, PeerAuth
from proxy.ingress.peers import (
    MARKER,
    Resolver,
    WorkerPlacement,
    ask_proof,
    is_me,
    member_address,
    peer_key,
    refused_forward,
    system_resolver,
    tls_client,
)
from proxy.ingress.private import check_peer
from proxy.intake.identity import Identity
from proxy.observe.metrics import CLUSTER_PEERS, FORWARDS, FORWARDS_RECEIVED, HANDOFFS, OWNER_MISSES
from proxy.reasons import ForwardOutcome, ForwardReason
from proxy.serve.record import Record
from proxy.upstream.forwarding import HOP_BY_HOP

__all__ = ["Cluster", "arrived_privately"]

log = logging.getLogger(__name__)

_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "content-encoding", "expect", MARKER}
"""``content-encoding``: aiohttp already decoded the body that is forwarded."""


def arrived_privately(request: web.BaseRequest) -> bool:
    """Whether the request came in on a worker's private unix socket."""
    known = getattr(request.protocol, "private", None)  # the listener's, found once per connection
    if isinstance(known, bool):
        return known
    transport = request.transport
    if transport is None:
        return False
    return isinstance(transport.get_extra_info("sockname"), str | bytes)


class Cluster:
    """Owner computation and forwarding for one process.

    Args:
        settings: ``cluster.*``, ``mode``, ``timeouts.stream_idle_seconds``.
        worker: This process's place among the machine's workers (``None``: a single process).
        resolver: How ``cluster.peers_dns`` is resolved (default: the system resolver).
    """

    def __init__(
        self, settings: Settings, *, worker: WorkerPlacement | None = None, resolver: Resolver | None = None
    ) -> None:
        c = settings.cluster
        self.settings = settings
        self.self_url = c.self_url.rstrip("/")
        self.worker = worker
        self._tls = tls_client(settings)
        self.resolver: Resolver = resolver or system_resolver("https" if self._tls is not None else "http")
        self._timeout = c.connect_timeout_seconds
        self._idle = settings.timeouts.stream_idle_seconds
        self._limit = c.max_forwards_per_peer
        self.auth = PeerAuth()
        self._members: tuple[str, ...] = ()
        self._replicas: dict[str, Peer] = {}
        self._workers: dict[str, Peer] = {}
        self._worker_names: tuple[str, ...] = ()
        self._refresh: asyncio.Task[None] | None = None
        self._websocket = settings.mode == "websocket"
        self._handoff: Handoff | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.received: Counter[str] = Counter()
        """Replica forwards this cluster received, by marker check (``true``/``false``/``unsigned``):
        the metric's count for this instance alone (in-process replicas share the registry)."""
        self.sent: Counter[ForwardOutcome] = Counter()
        """Forwards this cluster sent, by outcome (likewise)."""
        if c.peers:
            self.set_members(peer_urls(c.peers))
        self._check: Callable[[Any], None] | None = None
        if worker is not None and worker.count > 1:
            trust = worker.trust

            def check(sock: Any) -> None:
                check_peer(sock, trust)

            self._check = check

            self._worker_names = tuple(f"worker-{i}" for i in range(worker.count))
            for i, path in enumerate(worker.sockets):
                if i != worker.index:
                    self._workers[f"worker-{i}"] = worker_peer(i, path, self._limit, check)
            if c.handoff and len(worker.handoffs) == worker.count:
                self._handoff = Handoff(worker.handoffs, self._limit, self._timeout, trust)
        self._gauges()

    def _gauges(self) -> None:
        """``upshift_cluster_peers`` for the levels in use (none for a single process)."""
        if self.settings.cluster.peers or self.settings.cluster.peers_dns:
            CLUSTER_PEERS.labels("replica", "up").set_function(lambda: self._count(self._replicas, up=True))
            CLUSTER_PEERS.labels("replica", "down").set_function(lambda: self._count(self._replicas, up=False))
        if self._workers:
            CLUSTER_PEERS.labels("worker", "up").set_function(lambda: self._count(self._workers, up=True))
            CLUSTER_PEERS.labels("worker", "down").set_function(lambda: self._count(self._workers, up=False))

    def _count(self, peers: dict[str, Peer], *, up: bool) -> float:
        now = time.monotonic()
        down = sum(1 for p in peers.values() if p.down_until > now)
        total = len(peers) + (1 if (peers is self._replicas and self.self_url in self._members) else 0)
        if peers is self._workers and self._worker_names:
            total += 1
        return float(total - down if up else down)

    @property
    def members(self) -> tuple[str, ...]:
        """The replica peer set (sorted base URLs; this replica's ``self_url`` among them)."""
        return self._members

    @property
    def enabled(self) -> bool:
        """Whether any forwarding can happen."""
        return self._websocket and (len(self._members) > 1 or bool(self._workers))

    @property
    def routes(self) -> bool:
        """Whether :meth:`maybe_forward` may answer now: a request can be forwarded from here
        (:attr:`enabled`), or a forward received is checked (a peer secret); else it is ``None``."""
        return self.enabled or self.auth.enabled

    def set_members(self, urls: tuple[str, ...] | list[str]) -> None:
        """Replace the replica peer set (from DNS): only conversations whose owner changed move."""
        members = tuple(sorted({u.rstrip("/") for u in urls}))
        if self.self_url and self.self_url not in members:
            # This replica as the peer set spells it: every replica ranks the same names.
            mine = [m for m in members if peer_key(m) == peer_key(self.self_url)]
            if mine:
                self.self_url = mine[0]
        if members == self._members:
            return
        log.info("cluster peers: %d (%s)", len(members), ", ".join(members))
        for name in set(self._replicas) - set(members):
            self._close_later(self._replicas.pop(name))
        for name in members:
            if name != self.self_url and name not in self._replicas:
                self._replicas[name] = replica_peer(name, self._limit, self._tls, self.settings.cluster.tls_server_name)
        self._members = members

    def _close_later(self, peer: Peer) -> None:
        with contextlib.suppress(RuntimeError):  # no running loop: nothing was ever opened
            task = asyncio.get_running_loop().create_task(peer.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the secrets, check the transport, resolve ``peers_dns`` once, start its refresh.

        Raises:
            ConfigError: an unreadable secret file, or replicas over plain HTTP without
                ``cluster.plain_http_peers``.
        """
        c = self.settings.cluster
        self.auth = PeerAuth.load(c.secret_file)
        if c.peers or c.peers_dns:
            plain = [u for u in (peer_urls(c.peers) if c.peers else ()) if u.startswith("http://")]
            if c.peers_dns and self._tls is None:
                plain.append(f"http://{c.peers_dns}")
            if plain and not c.plain_http_peers:
                raise ConfigError(
                    "cluster: forwards between replicas carry the apps' keys; use https:// peers "
                    "(cluster.tls_ca_file, cluster.tls_cert_file, cluster.peer_listen) or set "
                    f"cluster.plain_http_peers: true (loopback tests only): {', '.join(plain)}"
                )
            if plain:
                log.warning("cluster: forwards between replicas travel as plain HTTP (cluster.plain_http_peers)")
            if not self.auth.enabled:
                log.warning("cluster: no cluster.secret_file: replicas do not authenticate each other")
        if c.peers_dns:
            await self._resolve()
            self._refresh = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        """Stop the refresh and close forwarding connections."""
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh
        for peer in [*self._replicas.values(), *self._workers.values()]:
            await peer.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def _resolve(self) -> None:
        host, port = parse_hostport(self.settings.cluster.peers_dns)
        try:
            urls = await self.resolver(host, port)
        except OSError as exc:
            log.warning("cluster.peers_dns %s: %s (keeping %d peers)", host, exc, len(self._members))
            return
        if urls:
            self.set_members(urls)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cluster.dns_refresh_seconds)
            await self._resolve()

    # -- the receiving side --------------------------------------------------------------------

    def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Mark answers to forwarded requests, so the forwarder knows an upshift answered."""
        if MARKER in request.headers or (self.worker is not None and arrived_privately(request)):
            # the pod URL reaches the app only with logging.level debug.
            debug = self.settings.logging.level == "debug"
            response.headers[OWNER_HEADER] = (self.self_url or "1") if debug else "1"

    async def prove(self, request: web.Request) -> web.Response:
        """``GET /.upshift/peer``: answer a replica's question with the proof of the secret,
        only when the question is signed with the secret (in time, once) and names this
        replica as the prover (:mod:`proxy.ingress.peerauth`); else the 404 of no route."""
        marker = request.headers.get(MARKER, "")
        asker, prover = request.query.get("asker", ""), request.query.get("prover", "")
        if not (self.auth.enabled and marker and is_me(request, prover, self.self_url)):
            return web.Response(status=404)
        if not self.auth.verify(marker, request.method, request.raw_path, b""):
            return web.Response(status=404)
        proof = self.auth.prove(asker, prover, request.query.get("challenge", ""))
        if not proof:
            return web.Response(status=404)
        return web.Response(status=204, headers={PROOF_HEADER: proof})

    def _received(self, request: web.Request, marker: str, body: bytes) -> web.Response | None:
        """Count a replica forward received; the refusal when it is not authentic."""
        verdict = "unsigned"
        if self.auth.enabled:
            verdict = "true" if self.auth.verify(marker, request.method, request.raw_path, body) else "false"
        FORWARDS_RECEIVED.labels(Level.REPLICA, verdict).inc()
        self.received[verdict] += 1
        if verdict != "false":
            return None
        return refused_forward(request)

    # -- owner queries (proxy/ingress/creator_queries.py) ----------------------------------------

    def query_peer(self, name: str, limit: int) -> Peer | None:
        """A peer of its own (own connections: an owner query never waits behind forwards) for
        the sibling worker ``worker-<i>`` or the replica ``name``, reached as forwards reach it:
        a worker's private socket checked with ``SO_PEERCRED``, a replica over its TLS (verified
        against ``cluster.tls_ca_file``, ``cluster.tls_server_name``). ``None``: not a peer."""
        if name.startswith("worker-"):
            w = self.worker
            index = int(name.removeprefix("worker-"))
            if w is None or self._check is None or not 0 <= index < w.count or index == w.index:
                return None
            return worker_peer(index, w.sockets[index], limit, self._check)
        if name == self.self_url or name not in self._members:
            return None
        return replica_peer(name, limit, self._tls, self.settings.cluster.tls_server_name)

    async def proven(self, peer: Peer) -> bool:
        """Whether replica ``peer`` proved it holds the cluster secret (always, without one):
        asked before it is trusted with anything, as before a forward."""
        return await self._proven(peer)

    def sign(self, method: str, raw_path: str, hop: str) -> str:
        """The ``x-upshift-forwarded`` marker of a bodiless request to a replica (signed with
        the cluster secret when there is one, as forwards are)."""
        return self.auth.marker(method, raw_path, b"", hop)

    def authentic(self, request: web.Request, marker: str) -> bool:
        """Whether a marked bodiless request (an owner query) comes from a replica: its
        signature holds (once, in time) when this replica has a secret; without one, only a
        caller at the address of another member of the peer set is one (a process with no
        peers answers no one but its own workers, on their private sockets). An owner query
        answered to anyone would tell any client which response ids exist."""
        if self.auth.enabled:
            return self.auth.verify(marker, request.method, request.raw_path, b"")
        return member_address(request.remote, self._members, self.self_url)

    # -- the request path ------------------------------------------------------------------------

    async def maybe_forward(
        self, request: web.Request, body: bytes, identity: Identity, rec: Record
    ) -> web.StreamResponse | None:
        """Forward ``request`` to the owner of its conversation and return the answer, or
        ``None`` when this process serves it (it owns it, or the owner cannot be reached).
        A marked request that is not authentic gets its refusal (403)."""
        marker = request.headers.get(MARKER)
        if marker is not None and (self.enabled or self.auth.enabled):
            refusal = self._received(request, marker, body)
            if refusal is not None:
                return refusal
        if not self.enabled:
            return None
        if arrived_by_handoff(request):
            return None  # its connection was handed here because this worker owns it
        if arrived_privately(request):
            FORWARDS_RECEIVED.labels(Level.WORKER, "unsigned").inc()
            return None
        root = root_digest(body)
        if root is None:
            return None
        key = owner_key(identity.digest, root)
        if marker is None and len(self._members) > 1:
            answer = await self._route(Level.REPLICA, key, self._members, self.self_url, request, body, rec)
            if answer is not None:
                return answer
        if self._workers and self.worker is not None:
            me = f"worker-{self.worker.index}"
            return await self._route(Level.WORKER, key, self._worker_names, me, request, body, rec)
        return None

    async def _route(
        self,
        level: Level,
        key: bytes,
        members: tuple[str, ...],
        me: str,
        request: web.Request,
        body: bytes,
        rec: Record,
    ) -> web.StreamResponse | None:
        peers = self._replicas if level is Level.REPLICA else self._workers
        now = time.monotonic()
        failed: ForwardOutcome | None = None
        attempts = 0
        for name in rank(key, members):
            if name == me:
                break
            peer = peers.get(name)
            if peer is None or peer.down_until > now:
                continue
            if level is Level.REPLICA and not await self._proven(peer):
                FORWARDS.labels(level, ForwardOutcome.UNPROVEN).inc()
                self.sent[ForwardOutcome.UNPROVEN] += 1
                continue  # never sent a byte of the app's request: the next owner, as if down
            if level is Level.WORKER and self._handoff is not None:
                handed = await self._handoff.offer(int(name.removeprefix("worker-")), request, body)
                HANDOFFS.labels(handed).inc()
                if handed is HandoffOutcome.ADOPTED:
                    rec.sent_to(ForwardReason.HANDOFF)
                    return HANDED_OFF()
                if handed in (HandoffOutcome.OWNER_DOWN, HandoffOutcome.TIMEOUT):
                    # What a forward to this owner would have found: skip it, as a forward does.
                    await self._mark_down(peer, f"handoff: {handed}")
                    failed = (
                        ForwardOutcome.OWNER_DOWN
                        if handed is HandoffOutcome.OWNER_DOWN
                        else ForwardOutcome.CONNECT_TIMEOUT
                    )
                    attempts += 1
                    if attempts >= 2:
                        break
                    continue
            answer, outcome = await self._forward(peer, request, body, rec)
            FORWARDS.labels(level, outcome).inc()
            self.sent[outcome] += 1
            if answer is not None:
                return answer
            failed = outcome
            attempts += 1
            if attempts >= 2 or outcome is ForwardOutcome.FAILED_BEFORE_ANSWER:
                break
        if failed is not None:
            OWNER_MISSES.labels(failed).inc()
        return None

    async def _proven(self, peer: Peer) -> bool:
        """Whether ``peer`` proved it holds the cluster secret (asked at most every
        :data:`~proxy.ingress.peerauth.PROOF_SECONDS`); always true without a secret."""
        if not self.auth.enabled or peer.proven_until > time.monotonic():
            return True
        why = await ask_proof(peer, self.auth, self.self_url, self._timeout)
        if why is not None:
            await self._mark_down(peer, why)
            return False
        peer.proven_until = time.monotonic() + PROOF_SECONDS
        return True

    async def _mark_down(self, peer: Peer, why: str) -> None:
        if peer.down_until <= time.monotonic():
            log.warning("cluster: %s skipped for %g s (%s)", peer.name, self.settings.cluster.down_seconds, why)
        peer.down_until = time.monotonic() + self.settings.cluster.down_seconds
        peer.proven_until = 0.0
        await peer.close()

    def _headers(self, peer: Peer, request: web.Request, body: bytes, rec: Record) -> CIMultiDict[str]:
        listed = {h.strip().lower() for v in request.headers.getall("Connection", []) for h in v.split(",")}
        headers: CIMultiDict[str] = CIMultiDict()
        for name, value in request.raw_headers:
            lowered = name.decode("latin-1").lower()
            if lowered in _REQUEST_DROP or lowered in listed:
                continue
            headers.add(name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
        if peer.level is Level.REPLICA:
            headers[MARKER] = self.auth.marker(request.method, request.raw_path, body, rec.request_id)
        return headers

    async def _forward(
        self, peer: Peer, request: web.Request, body: bytes, rec: Record
    ) -> tuple[web.StreamResponse | None, ForwardOutcome]:
        try:
            await asyncio.wait_for(peer.slots.acquire(), self._timeout)
        except TimeoutError:
            return None, ForwardOutcome.BUSY
        try:
            started = time.perf_counter()
            try:
                headers = self._headers(peer, request, body, rec)
                answer = await send(peer, request, headers, body, connect=self._timeout, idle=self._idle)
            except TimeoutError:
                await self._mark_down(peer, "no answer within the connect timeout")
                return None, ForwardOutcome.CONNECT_TIMEOUT
            except OSError as exc:
                await self._mark_down(peer, f"connect failed: {exc}")
                return None, ForwardOutcome.OWNER_DOWN
            except PeerError as exc:
                await self._mark_down(peer, f"connection lost before the answer: {exc}")
                return None, ForwardOutcome.FAILED_BEFORE_ANSWER
            finally:
                rec.upstream_time(time.perf_counter() - started)
            upshift = OWNER_HEADER in answer.headers
            if REFUSED_HEADER in answer.headers or (answer.status >= 500 and not upshift):
                answer.response.close()
                why = answer.headers.get(REFUSED_HEADER, "")
                if why == "forward_unauthenticated":
                    await self._mark_down(peer, "it refused our forward as unauthenticated (cluster.secret_file)")
                elif not why:
                    await self._mark_down(peer, f"answered {answer.status} without an upshift owner")
                return None, ForwardOutcome.REFUSED
            rec.sent_to(ForwardReason(peer.level.value))
            started = time.perf_counter()
            try:
                return await relay(peer, request, answer, self._idle)
            finally:
                rec.upstream_time(time.perf_counter() - started)
        finally:
            peer.slots.release()
