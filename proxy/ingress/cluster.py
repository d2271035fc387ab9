"""Conversation affinity across processes: a request that reaches a non-owner is forwarded once.

Every process computes the owner of a ``POST /v1/responses`` from its body alone
(:mod:`proxy.core.affinity`), at two levels: first the *replica* (rendezvous over
``cluster.peers`` or the addresses of ``cluster.peers_dns``), then, on a machine running
``--workers N``, the *worker* (rendezvous over the N workers). A request on the wrong process is
forwarded, as its raw bytes, to the owner's API listener (a replica's URL, or a worker's
private unix socket) and the answer is streamed back unchanged, so the owner's conversation
heads keep continuing it.

Rules:

* **Once per level, never a loop.** A replica forward carries ``x-upshift-forwarded``; a request
  with that header is never forwarded to another replica again, whatever the receiver thinks
  of membership. A worker forward arrives on the private socket and is never forwarded again.
  So a request makes at most two hops (replica, then worker).
* **The marker grants nothing.** It only turns forwarding off, so a marker forged by an app just
  gets its request served where it landed, as without a cluster. With ``cluster.secret_file``
  the forwarder signs it (HMAC-SHA256 over the hop id), so owners count genuine forwards apart
  from forged ones (``upshift_forwards_received_total{verified}``); it is honoured either way,
  which is what keeps a secret mismatch between replicas from ever causing a loop.
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
import enum
import hashlib
import hmac
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.config import Settings, parse_hostport, peer_urls
from proxy.core.affinity import owner_key, rank, root_digest
from proxy.core.sse import encode_event, nested_error
from proxy.errors import ConfigError, UpstreamClosed
from proxy.ingress.handoff import HANDED_OFF, Handoff, HandoffOutcome, arrived_by_handoff
from proxy.ops.metrics import CLUSTER_PEERS, FORWARDS, FORWARDS_RECEIVED, HANDOFFS, OWNER_MISSES
from proxy.serve.identity import Identity
from proxy.serve.streaming import Record, json_body
from proxy.upstream.passthrough import HOP_BY_HOP

__all__ = [
    "MARKER",
    "OWNER_HEADER",
    "REFUSED_HEADER",
    "Cluster",
    "Level",
    "Outcome",
    "Resolver",
    "WorkerPlacement",
    "resolve_peers",
]

log = logging.getLogger(__name__)

MARKER = "x-upshift-forwarded"
"""Request header of a replica forward: ``replica;<hop id>;<signature or empty>``."""
OWNER_HEADER = "x-upshift-owner"
"""Response header an owner adds to every answer to a forwarded request."""
REFUSED_HEADER = "x-upshift-refused"
"""Response header of the listener's own refusal (``max_connections``)."""

_HOP_BY_HOP = HOP_BY_HOP
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "content-encoding", "expect", MARKER}
"""``content-encoding``: aiohttp already decoded the body that is forwarded."""
_RESPONSE_DROP = _HOP_BY_HOP | {"content-length", "date", "server"}
_IDLE_KEEP_SECONDS = 20.0
"""An idle forwarding connection older than this is closed instead of reused (owners close
keep-alive connections after ``listener.keepalive_seconds``)."""
_MAX_JSON_ANSWER = 512 * 1024 * 1024


class Level(enum.StrEnum):
    """Where a forward goes."""

    REPLICA = "replica"
    WORKER = "worker"


class Outcome(enum.StrEnum):
    """How a forward ended (``upshift_forwards_total{outcome}``)."""

    OK = "ok"
    CUT = "cut"
    """The owner's answer started, then its connection broke."""
    OWNER_DOWN = "owner_down"
    """Connecting failed (refused, unreachable): served locally, owner skipped for a while."""
    CONNECT_TIMEOUT = "connect_timeout"
    """No connection or no ``100 Continue`` within the connect timeout."""
    BUSY = "busy"
    """The per-peer limit stayed full for the connect timeout."""
    REFUSED = "refused"
    """A 5xx not from an upshift request path, or the owner's listener was full."""
    FAILED_BEFORE_ANSWER = "failed_before_answer"
    """The owner accepted the request, then its connection broke before any answer."""


Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> peer base URLs``: how ``cluster.peers_dns`` is resolved."""


async def resolve_peers(host: str, port: int) -> list[str]:
    """The addresses of ``host`` as peer base URLs (``http://10.1.2.3:8080``, ``http://[fd00::1]:8080``)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    urls = set()
    for family, _, _, _, address in infos:
        ip = str(address[0])
        urls.add(f"http://[{ip}]:{port}" if family == socket.AF_INET6 else f"http://{ip}:{port}")
    return sorted(urls)


@dataclass(frozen=True, slots=True)
class WorkerPlacement:
    """This process's place among the workers of one machine."""

    index: int
    """This worker (0..count-1)."""
    sockets: tuple[str, ...]
    """Private API socket of every worker (unix paths; a leading NUL is an abstract name)."""
    handoffs: tuple[str, ...] = ()
    """Private handoff socket of every worker (:mod:`proxy.ingress.handoff`; empty: no handoffs)."""

    @property
    def count(self) -> int:
        return len(self.sockets)


class _PeerError(Exception):
    """The owner's connection failed or misbehaved."""


class _Conn:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


@dataclass(slots=True)
class _Peer:
    name: str
    level: Level
    host_header: bytes
    connect: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
    slots: asyncio.Semaphore
    down_until: float = 0.0
    idle: list[_Conn] = field(default_factory=list)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


@dataclass(slots=True)
class _Answer:
    status: int
    reason: bytes
    headers: CIMultiDict[str]
    conn: _Conn
    reusable: bool


def _replica_peer(url: str, limit: int) -> _Peer:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80

    def connect() -> Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        return asyncio.open_connection(host, port)

    return _Peer(url, Level.REPLICA, parts.netloc.encode(), connect, asyncio.Semaphore(limit))


def _worker_peer(index: int, path: str, limit: int) -> _Peer:
    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # Connected by hand: uvloop refuses abstract names (a leading NUL) in open_unix_connection.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, path)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_unix_connection(sock=sock)

    return _Peer(f"worker-{index}", Level.WORKER, b"localhost", connect, asyncio.Semaphore(limit))


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
        self.resolver: Resolver = resolver or resolve_peers
        self._timeout = c.connect_timeout_seconds
        self._idle = settings.timeouts.stream_idle_seconds
        self._limit = c.max_forwards_per_peer
        self._secret = b""
        self._members: tuple[str, ...] = ()
        self._replicas: dict[str, _Peer] = {}
        self._workers: dict[str, _Peer] = {}
        self._worker_names: tuple[str, ...] = ()
        self._refresh: asyncio.Task[None] | None = None
        self._websocket = settings.mode == "websocket"
        self._handoff: Handoff | None = None
        if c.peers:
            self.set_members(peer_urls(c.peers))
        if worker is not None and worker.count > 1:
            self._worker_names = tuple(f"worker-{i}" for i in range(worker.count))
            for i, path in enumerate(worker.sockets):
                if i != worker.index:
                    self._workers[f"worker-{i}"] = _worker_peer(i, path, self._limit)
            if c.handoff and len(worker.handoffs) == worker.count:
                self._handoff = Handoff(worker.handoffs, self._limit, self._timeout)
        self._gauges()

    def _gauges(self) -> None:
        """``upshift_cluster_peers`` for the levels in use (none for a single process)."""
        if self.settings.cluster.peers or self.settings.cluster.peers_dns:
            CLUSTER_PEERS.labels("replica", "up").set_function(lambda: self._count(self._replicas, up=True))
            CLUSTER_PEERS.labels("replica", "down").set_function(lambda: self._count(self._replicas, up=False))
        if self._workers:
            CLUSTER_PEERS.labels("worker", "up").set_function(lambda: self._count(self._workers, up=True))
            CLUSTER_PEERS.labels("worker", "down").set_function(lambda: self._count(self._workers, up=False))

    def _count(self, peers: dict[str, _Peer], *, up: bool) -> float:
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

    def set_members(self, urls: tuple[str, ...] | list[str]) -> None:
        """Replace the replica peer set (from DNS): only conversations whose owner changed move."""
        members = tuple(sorted({u.rstrip("/") for u in urls}))
        if members == self._members:
            return
        log.info("cluster peers: %d (%s)", len(members), ", ".join(members))
        for name in set(self._replicas) - set(members):
            self._replicas.pop(name).close()
        for name in members:
            if name != self.self_url and name not in self._replicas:
                self._replicas[name] = _replica_peer(name, self._limit)
        self._members = members

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the secret, resolve ``peers_dns`` once, start its refresh."""
        c = self.settings.cluster
        if c.secret_file:
            try:
                with open(c.secret_file, "rb") as fh:
                    self._secret = fh.read().strip()
            except OSError as exc:
                raise ConfigError(f"cluster.secret_file: cannot read {c.secret_file}: {exc.strerror or exc}") from None
        if c.peers_dns:
            await self._resolve()
            self._refresh = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        """Stop the refresh and close idle forwarding connections."""
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh
        for peer in [*self._replicas.values(), *self._workers.values()]:
            peer.close()

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

    # -- the marker ----------------------------------------------------------------------------

    def _sign(self, text: str) -> str:
        if not self._secret:
            return ""
        return hmac.new(self._secret, text.encode(), hashlib.sha256).hexdigest()[:32]

    def marker(self, hop: str) -> str:
        """The ``x-upshift-forwarded`` value of a replica forward."""
        text = f"{Level.REPLICA};{hop}"
        return f"{text};{self._sign(text)}"

    def verify(self, value: str) -> str:
        """``true``/``false`` (signature checked against the secret) or ``unsigned``."""
        if not self._secret:
            return "unsigned"
        text, _, sig = value.rpartition(";")
        return "true" if hmac.compare_digest(self._sign(text), sig) else "false"

    def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Mark answers to forwarded requests, so the forwarder knows an upshift answered."""
        if MARKER in request.headers or arrived_privately(request):
            # issue 21: the pod URL reaches the app only with logging.level debug.
            debug = self.settings.logging.level == "debug"
            response.headers[OWNER_HEADER] = (self.self_url or "1") if debug else "1"

    # -- the request path ------------------------------------------------------------------------

    async def maybe_forward(
        self, request: web.Request, body: bytes, identity: Identity, rec: Record
    ) -> web.StreamResponse | None:
        """Forward ``request`` to the owner of its conversation and return the answer, or
        ``None`` when this process serves it (it owns it, or the owner cannot be reached)."""
        if not self.enabled:
            return None
        if arrived_by_handoff(request):
            return None  # its connection was handed here because this worker owns it
        if arrived_privately(request):
            FORWARDS_RECEIVED.labels(Level.WORKER, "unsigned").inc()
            return None
        marker = request.headers.get(MARKER)
        if marker is not None:
            FORWARDS_RECEIVED.labels(Level.REPLICA, self.verify(marker)).inc()
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
        failed: Outcome | None = None
        attempts = 0
        for name in rank(key, members):
            if name == me:
                break
            peer = peers.get(name)
            if peer is None or peer.down_until > now:
                continue
            if level is Level.WORKER and self._handoff is not None:
                handed = await self._handoff.offer(int(name.removeprefix("worker-")), request, body)
                HANDOFFS.labels(handed).inc()
                if handed is HandoffOutcome.ADOPTED:
                    rec.mode, rec.reason = "forwarded", "handoff"
                    return HANDED_OFF()
                if handed in (HandoffOutcome.OWNER_DOWN, HandoffOutcome.TIMEOUT):
                    # What a forward to this owner would have found: skip it, as a forward does.
                    self._mark_down(peer, f"handoff: {handed}")
                    failed = Outcome.OWNER_DOWN if handed is HandoffOutcome.OWNER_DOWN else Outcome.CONNECT_TIMEOUT
                    attempts += 1
                    if attempts >= 2:
                        break
                    continue
            answer, outcome = await self._forward(peer, request, body, rec)
            FORWARDS.labels(level, outcome).inc()
            if answer is not None:
                return answer
            failed = outcome
            attempts += 1
            if attempts >= 2 or outcome is Outcome.FAILED_BEFORE_ANSWER:
                break
        if failed is not None:
            OWNER_MISSES.labels(failed).inc()
        return None

    def _mark_down(self, peer: _Peer, why: str) -> None:
        if peer.down_until <= time.monotonic():
            log.warning("cluster: %s skipped for %g s (%s)", peer.name, self.settings.cluster.down_seconds, why)
        peer.down_until = time.monotonic() + self.settings.cluster.down_seconds
        peer.close()

    async def _forward(
        self, peer: _Peer, request: web.Request, body: bytes, rec: Record
    ) -> tuple[web.StreamResponse | None, Outcome]:
        try:
            await asyncio.wait_for(peer.slots.acquire(), self._timeout)
        except TimeoutError:
            return None, Outcome.BUSY
        try:
            started = time.perf_counter()
            try:
                answer = await self._send(peer, request, body, rec)
            except TimeoutError:
                self._mark_down(peer, "no answer within the connect timeout")
                return None, Outcome.CONNECT_TIMEOUT
            except OSError as exc:
                self._mark_down(peer, f"connect failed: {exc}")
                return None, Outcome.OWNER_DOWN
            except _PeerError as exc:
                self._mark_down(peer, f"connection lost before the answer: {exc}")
                return None, Outcome.FAILED_BEFORE_ANSWER
            finally:
                rec.upstream_s += time.perf_counter() - started
            if answer.status >= 500 and (OWNER_HEADER not in answer.headers or REFUSED_HEADER in answer.headers):
                answer.conn.close()
                if REFUSED_HEADER not in answer.headers:
                    self._mark_down(peer, f"answered {answer.status} without an upshift owner")
                return None, Outcome.REFUSED
            rec.mode, rec.reason = "forwarded", peer.level.value
            started = time.perf_counter()
            try:
                return await self._relay(peer, request, answer)
            finally:
                rec.upstream_s += time.perf_counter() - started
        finally:
            peer.slots.release()

    # -- HTTP/1.1 towards the owner ------------------------------------------------------------

    def _head(self, peer: _Peer, request: web.Request, body: bytes, rec: Record) -> bytes:
        lines = [b"POST ", request.raw_path.encode(), b" HTTP/1.1\r\nHost: ", peer.host_header, b"\r\n"]
        listed = {h.strip().lower() for v in request.headers.getall("Connection", []) for h in v.split(",")}
        for name, value in request.raw_headers:
            lowered = name.decode("latin-1").lower()
            if lowered in _REQUEST_DROP or lowered in listed:
                continue
            lines += [name, b": ", value, b"\r\n"]
        if peer.level is Level.REPLICA:
            lines += [MARKER.encode(), b": ", self.marker(rec.request_id).encode(), b"\r\n"]
        lines += [b"Content-Length: ", str(len(body)).encode(), b"\r\n"]
        if peer.level is Level.REPLICA:
            lines.append(b"Expect: 100-continue\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _connection(self, peer: _Peer) -> tuple[_Conn, bool]:
        now = time.monotonic()
        while peer.idle:
            conn = peer.idle.pop()
            if now - conn.idle_since < _IDLE_KEEP_SECONDS and not conn.reader.at_eof():
                return conn, True
            conn.close()
        reader, writer = await peer.connect()
        return _Conn(reader, writer), False

    async def _send(self, peer: _Peer, request: web.Request, body: bytes, rec: Record) -> _Answer:
        """Connect, send the head, wait for ``100 Continue``, send the body, read the answer's head.

        A worker on the same machine is sent head and body at once (no ``Expect``): its unix
        socket refuses a connection when the worker is gone, and the supervisor's watchdog
        restarts a worker that hangs, so the round trip would buy nothing but latency.
        """
        head = self._head(peer, request, body, rec)
        if peer.level is Level.WORKER:
            return await self._send_at_once(peer, head + body)
        async with asyncio.timeout(self._timeout):
            for _ in range(2):
                conn, reused = await self._connection(peer)
                try:
                    conn.writer.write(head)
                    await conn.writer.drain()
                    answer = await _read_head(conn)
                    break
                except (_PeerError, OSError, asyncio.IncompleteReadError) as exc:
                    conn.close()
                    if not reused:  # a fresh connection that fails is the owner's failure
                        raise _PeerError(str(exc) or type(exc).__name__) from None
                    # a kept-alive connection the owner had closed meanwhile: once more, fresh
                except BaseException:
                    conn.close()  # the connect timeout (a cancellation) or a cancelled request
                    raise
            else:  # pragma: no cover - the loop always breaks or raises
                raise _PeerError("no connection")
        if answer.status != 100:
            answer.reusable = False  # answered without reading the body: the body is never sent
            return answer
        try:
            conn.writer.write(body)
            async with asyncio.timeout(self._idle):
                await conn.writer.drain()
                return await _read_head(conn)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            conn.close()
            raise _PeerError(str(exc) or type(exc).__name__) from None
        except BaseException:
            conn.close()  # the app went away while the owner worked
            raise

    async def _send_at_once(self, peer: _Peer, data: bytes) -> _Answer:
        for _ in range(2):
            async with asyncio.timeout(self._timeout):
                conn, reused = await self._connection(peer)
            try:
                conn.writer.write(data)
                async with asyncio.timeout(self._idle):
                    await conn.writer.drain()
                    return await _read_head(conn)
            except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
                conn.close()
                if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                    raise _PeerError(str(exc) or type(exc).__name__) from None
                # the worker had closed this kept-alive connection: once more, on a fresh one
            except (_PeerError, OSError, TimeoutError) as exc:
                conn.close()
                raise _PeerError(str(exc) or type(exc).__name__) from None
            except BaseException:
                conn.close()
                raise
        raise _PeerError("no connection")  # pragma: no cover - the second attempt is fresh

    async def _relay(self, peer: _Peer, request: web.Request, answer: _Answer) -> tuple[web.StreamResponse, Outcome]:
        headers = CIMultiDict((k, v) for k, v in answer.headers.items() if k.lower() not in _RESPONSE_DROP)
        listed = {h.strip().lower() for v in answer.headers.getall("Connection", []) for h in v.split(",")}
        for name in listed:
            headers.popall(name, None)
        if answer.headers.get("Content-Type", "").startswith("text/event-stream"):
            return await self._relay_stream(peer, request, answer, headers)
        try:
            async with asyncio.timeout(self._idle):
                data = b"".join([chunk async for chunk in _body(answer, _MAX_JSON_ANSWER)])
        except (OSError, asyncio.IncompleteReadError, TimeoutError, _PeerError) as exc:
            answer.conn.close()
            log.info("forwarded answer from %s cut: %s", peer.name, type(exc).__name__)
            err = UpstreamClosed("The connection to the owning process broke before the answer was complete.")
            response = web.Response(body=json_body(err.body()), status=err.status, content_type="application/json")
            return response, Outcome.CUT
        self._keep(peer, answer)
        return web.Response(body=data, status=answer.status, headers=headers), Outcome.OK

    async def _relay_stream(
        self, peer: _Peer, request: web.Request, answer: _Answer, headers: CIMultiDict[str]
    ) -> tuple[web.StreamResponse, Outcome]:
        response = web.StreamResponse(status=answer.status, headers=headers)
        await response.prepare(request)
        pending = b""
        last = b""
        chunks = _body(answer, None)
        try:
            while True:
                try:
                    async with asyncio.timeout(self._idle):
                        chunk = await anext(chunks, None)
                except (OSError, asyncio.IncompleteReadError, TimeoutError, _PeerError) as exc:
                    answer.conn.close()
                    log.info("forwarded stream from %s cut: %s", peer.name, type(exc).__name__)
                    await _write_cut(response, last)
                    return response, Outcome.CUT
                if chunk is None:
                    break
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end < 0:
                    continue
                ready, pending = pending[: end + 2], pending[end + 2 :]
                start = ready.rfind(b"\n\n", 0, len(ready) - 2)
                last = ready[start + 2 :] if start >= 0 else ready
                try:
                    await response.write(ready)
                except ConnectionResetError:
                    # The app left: stop reading; the owner sees its connection go and drains
                    # the upstream response itself.
                    answer.conn.close()
                    return response, Outcome.OK
            if pending:
                await response.write(pending)
            await response.write_eof()
        except ConnectionResetError:
            answer.conn.close()
            return response, Outcome.OK
        self._keep(peer, answer)
        return response, Outcome.OK

    def _keep(self, peer: _Peer, answer: _Answer) -> None:
        conn = answer.conn
        if not answer.reusable or len(peer.idle) >= self._limit or conn.reader.at_eof():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        peer.idle.append(conn)


async def _write_cut(response: web.StreamResponse, last: bytes) -> None:
    """End a cut stream with one nested error event numbered after the last relayed one."""
    sequence = 0
    data = b"".join(line[5:].strip() for line in last.splitlines() if line.startswith(b"data:"))
    with contextlib.suppress(orjson.JSONDecodeError, TypeError, ValueError):
        event: Any = orjson.loads(data)
        if isinstance(event, dict) and isinstance(event.get("sequence_number"), int):
            sequence = event["sequence_number"] + 1
    err = UpstreamClosed("The connection to the owning process broke before the response finished; retry the request.")
    out = nested_error(sequence, type=err.type, code=err.code, message=err.message)
    with contextlib.suppress(ConnectionResetError):
        await response.write(encode_event("error", orjson.dumps(out)))
        await response.write_eof()


async def _read_head(conn: _Conn) -> _Answer:
    """Read one response head; a ``100 Continue`` comes back as status 100."""
    raw = await conn.reader.readuntil(b"\r\n\r\n")
    lines = raw[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise _PeerError("not an HTTP/1.x answer")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise _PeerError("malformed header line")
        headers.add(name.strip().decode("latin-1"), value.strip().decode("utf-8", "surrogateescape"))
    keep = parts[0] == b"HTTP/1.1" and "close" not in headers.get("Connection", "").lower()
    return _Answer(int(parts[1]), parts[2] if len(parts) > 2 else b"", headers, conn, keep)


async def _body(answer: _Answer, limit: int | None) -> AsyncIterator[bytes]:
    """The answer's body, chunk by chunk (Content-Length, chunked, or up to the close)."""
    reader = answer.conn.reader
    headers = answer.headers
    size = 0
    if answer.status in (204, 304) or 100 <= answer.status < 200:
        return
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                length = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _PeerError("bad chunk size") from None
            if length == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return
            data = await reader.readexactly(length + 2)
            size += length
            if limit is not None and size > limit:
                raise _PeerError("answer too large")
            yield data[:-2]
    elif (declared := headers.get("Content-Length")) is not None:
        remaining = int(declared)
        if limit is not None and remaining > limit:
            raise _PeerError("answer too large")
        while remaining > 0:
            data = await reader.read(min(remaining, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(data)
            yield data
    else:
        answer.reusable = False
        while data := await reader.read(1 << 16):
            size += len(data)
            if limit is not None and size > limit:
                raise _PeerError("answer too large")
            yield data
