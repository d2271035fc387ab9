"""The pool: executes the planner's decisions on real upstream sockets.

Every decision (which lane, continue or full, open a socket, wait, HTTP, what to close) is made
synchronously by :class:`proxy.core.planner.Planner`; this module only opens and closes
sockets and hands out lanes. A lane is lent as an ``async with`` lease (:meth:`Pool.lease`),
httpcore-style: leaving the block ends the lane's turn on every path (completion, error,
cancellation, app disconnect), so nothing has to remember to release. A turn left before its
terminal event *drains*: its remaining events are read and dropped, the socket and its other
lanes go on (pitfall 20).

Opening runs in its own task (a cancelled request cannot interrupt a handshake other requests
wait for), and so does closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import orjson

from proxy.config import Settings
from proxy.core.conversation import HeadTable
from proxy.core.creators import OwnerRegistry
from proxy.core.demux import LaneSignal
from proxy.core.fair import tenant_of
from proxy.core.lanes import LaneKey, LaneState, SocketState
from proxy.core.planner import LaneLimits, Plan, PlanKind, Planner, Reseed
from proxy.core.request import ParsedRequest
from proxy.core.reseed import reseed_frame
from proxy.core.waiting import Send, Waiting
from proxy.errors import UpstreamClosed, UpstreamRefused, UpstreamTimeout, UpstreamUnavailable
from proxy.intake.identity import Identity
from proxy.observe.metrics import (
    LANES,
    LANES_FALLBACKS,
    POOL_WAIT,
    RESEEDS,
    SOCKET_AGE_AT_ROTATION,
    SOCKET_CAP,
    SOCKETS,
    UPGRADE_REFUSALS,
)
from proxy.reasons import PassthroughReason, ReplayCause
from proxy.upstream.caps import CapFile
from proxy.upstream.handshake import open_websocket
from proxy.upstream.passthrough import Forwarded
from proxy.upstream.ws import Inbox, UpstreamSocket
from proxy.wire import sse

__all__ = ["Pool", "SocketUse", "Turn", "completed_response"]

log = logging.getLogger(__name__)


def completed_response(body: bytes) -> dict[str, Any] | None:
    """The ``response`` of a ``response.completed`` in an SSE body, or a completed response
    object as a JSON body; ``None`` otherwise."""
    if body[:1] == b"{":
        try:
            found = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return found if isinstance(found, dict) and found.get("status") == "completed" else None
    try:
        events = sse.decode_all(body)
    except sse.EventTooLarge:
        return None
    for event in reversed(events):
        if event.event == "response.completed":
            try:
                found = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                return None
            response = found.get("response") if isinstance(found, dict) else None
            return response if isinstance(response, dict) and response.get("status") == "completed" else None
    return None


_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()
"""The pools of this process (tests run several): the gauges below add theirs up."""


def _gauge(count: Callable[[Planner], int]) -> Callable[[], float]:
    return lambda: float(sum(count(pool.planner) for pool in list(_POOLS)))


def _live(planner: Planner) -> int:
    return planner.socket_counts[SocketState.OPEN] + planner.socket_counts[SocketState.RETIRING]


# The socket and lane gauges are read from the planners when scraped: a turn pays
# nothing for them, and a scrape sees the counts as they are.
for _child, _count in (
    (SOCKETS.labels("open"), _live),
    (SOCKETS.labels("busy"), lambda p: p.busy_sockets),
    (SOCKETS.labels("idle"), lambda p: _live(p) - p.busy_sockets),
    (SOCKETS.labels("connecting"), lambda p: p.socket_counts[SocketState.CONNECTING]),
    (LANES.labels("busy"), lambda p: p.lane_counts[LaneState.BUSY]),
    (LANES.labels("idle"), lambda p: p.lane_counts[LaneState.IDLE]),
    (LANES.labels("draining"), lambda p: p.lane_counts[LaneState.DRAINING]),
):
    _child.set_function(_gauge(_count))


_MEASURED = {PlanKind.CONTINUE: Send.CONTINUE, PlanKind.FULL: Send.FULL}
"""What a turn's upstream time is a sample of, by its plan (a hydrated continuation: nothing)."""


class SocketUse(enum.Enum):
    """A socket as the pool's counts see it (``busy``: at least one lane in flight)."""

    CONNECTING = "connecting"
    BUSY = "busy"
    IDLE = "idle"
    CLOSED = "closed"


class Turn:
    """One response on one lane, lent by :meth:`Pool.lease`."""

    __slots__ = (
        "inbox",
        "key",
        "measured",
        "prefix_state",
        "req",
        "response",
        "retire",
        "sent_at",
        "socket",
        "terminal",
    )

    def __init__(self, key: LaneKey, socket: UpstreamSocket, inbox: Inbox, measured: Send | None = None) -> None:
        self.key = key
        self.socket = socket
        self.inbox = inbox
        self.measured = measured
        """What the upstream's time for this response is a sample of (``None``: none)."""
        self.sent_at = 0.0
        """``time.perf_counter()`` when the frame was handed to the socket."""
        self.terminal = False
        self.response: dict[str, Any] | None = None
        self.req: ParsedRequest | None = None
        self.prefix_state: Any = None
        self.retire = False

    @property
    def stream_id(self) -> str | None:
        """The lane's ``stream_id``."""
        return self.key[1]

    async def send(self, frame: bytes) -> None:
        """Send the ``response.create`` frame."""
        self.sent_at = time.perf_counter()
        await self.socket.send(frame, self.key[1])

    @property
    def upstream_seconds(self) -> float:
        """The upstream's own time so far: from the frame's send to the arrival at the socket
        of the last event read (the terminal one once the response ended), wherever the
        sidecar's loop then was."""
        arrived = self.inbox.arrived
        return max(arrived - self.sent_at, 0.0) if self.sent_at and arrived else 0.0

    async def recv(self, timeout: float) -> tuple[bytes, dict[str, Any]]:
        """The lane's next event ``(raw, parsed)``."""
        return await self.inbox.get(timeout)

    async def burst(self, timeout: float) -> list[tuple[bytes, dict[str, Any]]]:
        """Every event already buffered, or those of the next read (:meth:`Inbox.burst`)."""
        return await self.inbox.burst(timeout)

    def finish(
        self,
        *,
        req: ParsedRequest | None = None,
        response: dict[str, Any] | None = None,
        prefix_state: Any = None,
        retire: bool = False,
    ) -> None:
        """The terminal event arrived; ``response`` (completed) becomes the lane's head."""
        self.terminal = True
        self.req, self.response, self.prefix_state, self.retire = req, response, prefix_state, retire


class Lease:
    """One lane lent for one response: ``async with pool.lease(plan) as turn`` (a plain class,
    not a generator-based context manager: it is entered and left on every turn)."""

    __slots__ = ("_plan", "_pool", "_turn")

    def __init__(self, pool: Pool, plan: Plan) -> None:
        self._pool, self._plan = pool, plan
        self._turn: Turn | None = None

    async def __aenter__(self) -> Turn:
        self._turn = self._pool._lent(self._plan)
        return self._turn

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._turn is not None
        self._pool._returned(self._turn, exc)


class Pool:
    """Upstream sockets and lanes of every identity.

    Args:
        settings: ``pool`` limits and timers, ``ws_url``, ``timeouts.connect_seconds``.
        heads: The head table (owned, through the planner).
        owners: Who created each response id (the planner notes every head's; default: a
            registry of its own).
        clock: Monotonic clock.
    """

    def __init__(
        self,
        settings: Settings,
        heads: HeadTable,
        *,
        owners: OwnerRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        p = settings.pool
        self.settings = settings
        self.heads = heads
        self.planner = Planner(
            LaneLimits(
                lanes_per_socket=p.lanes_per_socket,
                max_active_per_socket=p.max_active_per_socket,
                max_sockets_per_identity=p.max_sockets_per_identity,
                max_sockets_total=p.max_sockets_total,
                spread_sockets=p.spread_sockets,
                idle_close_seconds=p.idle_close_seconds,
                rotate_after_seconds=p.rotate_after_seconds,
                reseed=p.reseed,
                reseed_bytes=p.reseed_bytes,
                cap_probe_seconds=p.cap_probe_seconds,
                wait_seconds=p.wait_seconds,
                connect_seconds=settings.timeouts.connect_seconds,
                http_continuations=p.http_continuations,
                http_continuation_after_seconds=p.http_continuation_after_seconds,
            ),
            heads,
            owners,
        )
        self.owners = self.planner.owners
        """Who created each response id (:class:`~proxy.core.creators.OwnerRegistry`)."""
        self.caps = CapFile(p.cap_state_dir)
        """The learned socket caps shared with the other workers of this machine."""
        self._clock = clock
        self._socks: dict[int, UpstreamSocket] = {}
        self._identities: dict[str, Identity] = {}
        """The identities seen, by digest (re-seeds open sockets with their headers)."""
        self._ready: dict[int, asyncio.Future[None]] = {}
        self._waiters: set[asyncio.Future[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._opening: set[asyncio.Task[None]] = set()
        self._housekeeper: asyncio.Task[None] | None = None
        self._closed = False
        self.close_code = 1000
        """Close code for sockets retired from now on (1001 once the sidecar drains)."""
        _POOLS.add(self)

    def __repr__(self) -> str:
        c = self.planner.lane_counts
        return (
            f"<Pool [Sockets: {self.count(SocketUse.BUSY)} busy, {self.count(SocketUse.IDLE)} idle, "
            f"{self.count(SocketUse.CONNECTING)} connecting | Lanes: {c[LaneState.BUSY]} busy, "
            f"{c[LaneState.IDLE]} idle, {c[LaneState.DRAINING]} draining]>"
        )

    def count(
        self, state: SocketUse | None = None, identity: Identity | None = None, *, tenant: str | None = None
    ) -> int:
        """Sockets in ``state`` (all if ``None``), of ``identity`` (all if ``None``), of every
        identity of ``tenant`` (:attr:`Identity.tenant`; all if ``None``)."""
        total = 0
        for sock in self.planner.sockets(identity.digest if identity is not None else None):
            if tenant is not None and tenant_of(sock.identity) != tenant:
                continue
            if sock.state is SocketState.CONNECTING:
                mine = SocketUse.CONNECTING
            else:
                mine = SocketUse.BUSY if sock.active else SocketUse.IDLE
            total += state is None or mine is state
        return total

    def sockets_per_identity(self) -> dict[str, int]:
        """Live sockets by identity digest."""
        counts: dict[str, int] = {}
        for sock in self.planner.sockets():
            counts[sock.identity] = counts.get(sock.identity, 0) + 1
        return counts

    # -- plans ---------------------------------------------------------------------------------

    async def plan(self, identity: Identity, req: ParsedRequest, *, replay: bool = False) -> tuple[Plan, Waiting]:
        """The next attempt of ``req``, with its lane reserved and its socket open.

        Executes the planner's plans: a ``WAIT`` is waited until the planner's deadline for the
        turn (:class:`~proxy.core.waiting.Waiting`, decided by the waiting rule) or until a lane
        frees, whichever is first, then the turn is planned again; a new socket's handshake is
        waited for; a refused or failed handshake never fails the request: it takes another
        lane or goes over HTTP.

        Returns:
            The plan (``CONTINUE``/``FULL`` with a lane, ``HTTP`` or ``HTTP_CONTINUE``), and the
            turn's wait: how it ended and :attr:`Waiting.seconds`, the time spent waiting for a
            lane or a handshake (the sidecar's time, not the upstream's).
        """
        started = self._clock()
        waiting = Waiting(started)
        self._identities[identity.digest] = identity
        try:
            return await self._plan(identity, req, replay, waiting)
        finally:
            self.planner.unqueue(waiting)  # a request gone mid-wait leaves its queue too

    async def _plan(
        self, identity: Identity, req: ParsedRequest, replay: bool, waiting: Waiting
    ) -> tuple[Plan, Waiting]:
        may_open = True
        while True:
            now = self._clock()
            if self._closed:
                return self._planned(Plan(PlanKind.HTTP, PassthroughReason.WS_UNAVAILABLE), waiting, now)
            plan = self.planner.plan(identity.digest, req, now, replay=replay, may_open=may_open, waiting=waiting)
            self._close_soon(plan.close)
            if plan.kind is PlanKind.WAIT:
                assert waiting.deadline is not None, "a WAIT without a deadline"
                await self._wait_change(waiting.deadline - now)
                continue
            if plan.warm is not None:
                self._start_open(plan.warm, identity)
            if plan.lane is None:
                return self._planned(plan, waiting, now)
            sid = plan.lane[0]
            if plan.open_socket:
                self._start_open(sid, identity)
            ready = self._ready.get(sid)
            if ready is not None:
                try:
                    await asyncio.shield(ready)
                except UpstreamUnavailable:
                    may_open = False  # the lane went with the socket; another one, or HTTP
                    continue
                except asyncio.CancelledError:
                    self.planner.finished(plan.lane, self._clock())
                    raise
            return self._planned(plan, waiting, self._clock())

    @staticmethod
    def _planned(plan: Plan, waiting: Waiting, now: float) -> tuple[Plan, Waiting]:
        waiting.seconds = now - waiting.started
        if waiting.deadline is not None:
            POOL_WAIT.labels("lanes").observe(waiting.seconds)
        return plan, waiting

    async def _wait_change(self, timeout: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)

    def _wake(self) -> None:
        """Something was freed: every waiter plans again."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    # -- leases --------------------------------------------------------------------------------

    def lease(self, plan: Plan) -> Lease:
        """Lend the plan's lane for one response (``async with pool.lease(plan) as turn``).

        Raises:
            UpstreamClosed: the socket closed between the plan and the lease.
        """
        return Lease(self, plan)

    def _lent(self, plan: Plan) -> Turn:
        key = plan.lane
        assert key is not None, "lease of a plan without a lane"
        sock = self._socks.get(key[0])
        if sock is None or sock.error is not None:
            self.planner.finished(key, self._clock())
            raise sock.error if sock is not None and sock.error else UpstreamClosed("The upstream socket closed.")
        measured = None if plan.hydrated else _MEASURED.get(plan.kind)
        return Turn(key, sock, sock.open_inbox(key[1]), measured)

    def _returned(self, turn: Turn, exc: BaseException | None) -> None:
        """The lease of ``turn`` ended, by ``exc`` if it failed (which goes on up)."""
        if isinstance(exc, UpstreamClosed):
            key, sock = turn.key, turn.socket
            if key[1] is not None and not sock.demux.proven and not turn.inbox.seen:
                # Closed right after a named lane's first create on a socket that never routed
                # a stream_id: an upstream that refuses lanes by closing, or a lost socket.
                if self.planner.lanes_closed_early(self._clock()):
                    LANES_FALLBACKS.inc()
        self._end(turn)
        if isinstance(exc, UpstreamTimeout):
            # A stalled response makes the whole socket suspect: no new turns on it; it closes
            # once its other lanes are done.
            self.retire(turn.key[0])

    def _end(self, turn: Turn) -> None:
        """End a lease, synchronously (safe on cancellation)."""
        sock, inbox, key = turn.socket, turn.inbox, turn.key
        if turn.terminal or sock.error is not None:
            sock.close_inbox(inbox)
            record = self.planner.socket(key[0])
            if turn.response is not None and turn.req is not None and turn.measured is not None and record is not None:
                # Measured as an HTTP send is (from the send until the answer was relayed), so
                # the two compare like with like, the sidecar's own loop in both.
                self.planner.estimates.observe_upstream(
                    record.identity, turn.measured, len(turn.req.body), time.perf_counter() - turn.sent_at
                )
            close = self.planner.finished(
                key,
                self._clock(),
                req=turn.req,
                response=turn.response,
                prefix_state=turn.prefix_state,
                retire=turn.retire,
            )
            self._close_soon(close)
        else:
            # Left mid-response: read the rest of it and drop it; the lane is free after that.
            inbox.draining = True
            inbox.frames.clear()
            inbox.on_drained = lambda: self._drained(sock, inbox, key)
            self.planner.abandon(key)
        self._wake()

    def _drained(self, sock: UpstreamSocket, inbox: Inbox, key: LaneKey) -> None:
        sock.close_inbox(inbox)
        self._close_soon(self.planner.finished(key, self._clock()))
        self._wake()

    def retire(self, socket_id: int) -> None:
        """No new turns on ``socket_id`` (a limit was reached); closed once drained."""
        self._close_soon(self.planner.retire(socket_id))

    def lanes_refused(self) -> None:
        """The upstream does not take ``stream_id``: default lanes only for a while."""
        if self.planner.lanes_refused(self._clock()):
            LANES_FALLBACKS.inc()

    def measured_http(self, identity: Identity, req: ParsedRequest, fwd: Forwarded, *, continued: bool) -> None:
        """The upstream answered ``req`` over plain HTTP (an HTTP continuation if ``continued``
        and it did not fall back to the whole input): a sample of what a lane saves against it."""
        if fwd.status == 200:
            send = Send.HTTP_CONTINUE if continued and not fwd.fell_back else Send.HTTP_FULL
            self.planner.estimates.observe_upstream(identity.digest, send, len(req.body), fwd.upstream_seconds)

    def adopt_http(self, identity: Identity, req: ParsedRequest, body: bytes) -> None:
        """The answer of a stored request sent over plain HTTP (SSE or JSON): its completed
        response becomes a head without a lane (its later turns are continued)."""
        response = completed_response(body)
        if response is not None:
            self.planner.adopt(identity.digest, req, response, self._clock())

    def _lanes_signal(self, signal: LaneSignal) -> None:
        """A socket's demux learned whether the upstream takes ``stream_id``."""
        if self.planner.lanes_signal(signal, self._clock()):
            LANES_FALLBACKS.inc()
        if signal is LaneSignal.PROVEN:
            self._wake()  # that socket may carry more responses now

    def stream_limit(self, key: LaneKey) -> None:
        """``websocket_stream_limit_reached`` on ``key``'s socket."""
        self.planner.stream_limit(key)

    def replayed(self, cause: ReplayCause, lane: LaneKey | None) -> None:
        """What an attempt replayed for ``cause`` (on ``lane``) tells the pool: the upstream does
        not take ``stream_id`` (:meth:`lanes_refused`), or the lane's socket takes no more
        streams (:meth:`stream_limit`); other causes tell it nothing."""
        if cause is ReplayCause.LANES_UNSUPPORTED:
            self.lanes_refused()
        elif cause is ReplayCause.STREAM_LIMIT and lane is not None:
            self.stream_limit(lane)

    # -- sockets -------------------------------------------------------------------------------

    def _start_open(self, sid: int, identity: Identity) -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "not retrieved"
        self._ready[sid] = ready
        task = asyncio.get_running_loop().create_task(self._open(sid, identity, ready))
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)

    async def _open(self, sid: int, identity: Identity, ready: asyncio.Future[None]) -> None:
        try:
            ws = await open_websocket(identity.ws_url, identity.headers, self.settings)
        except BaseException as exc:
            refused = isinstance(exc, UpstreamRefused)
            status = exc.http_status if isinstance(exc, UpstreamRefused) else None
            headers = exc.headers if isinstance(exc, UpstreamRefused) else {}
            payload = exc.payload if isinstance(exc, UpstreamRefused) else b""
            planned = self.planner.socket(sid)
            capped = self.planner.open_failed(
                sid, self._clock(), status=status, headers=headers, payload=payload, jitter=random.random()
            )
            if refused:
                UPGRADE_REFUSALS.labels("cap" if capped else "other").inc()
            if capped and planned is not None:
                self.caps.publish(self.planner, planned.identity, self._clock())
                self._publish_cap(planned.identity)
            error = exc if isinstance(exc, UpstreamUnavailable) else UpstreamUnavailable("Connecting was cancelled.")
            ready.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            self._ready.pop(sid, None)
            self._wake()
        now = self._clock()
        record = self.planner.socket(sid)
        try:
            sock = UpstreamSocket(
                sid,
                ws,
                now,
                demux=record.demux if record is not None else None,
                on_closed=self._lost,
                on_signal=self._lanes_signal,
                ping_interval=self.settings.pool.ping_interval_seconds,
                ping_timeout=self.settings.pool.ping_timeout_seconds,
                fragment_bytes=self.settings.pool.fragment_bytes,
            )
        except Exception as exc:  # a library change the contracts did not foresee: never a hang
            log.exception("taking the upstream socket over failed")
            with contextlib.suppress(Exception):
                ws.transport.abort()
            self.planner.open_failed(sid, now, status=None, headers={})
            ready.set_exception(UpstreamUnavailable(f"The upstream socket could not be used: {exc}"))
            self._wake()
            return
        if self._closed or record is None:  # the pool closed meanwhile
            self._socks[sid] = sock
            self._close_soon([sid], 1001)
            ready.set_exception(UpstreamUnavailable("The sidecar is shutting down."))
            return
        self._socks[sid] = sock
        self.planner.opened(sid, now)
        ready.set_result(None)
        self._publish_cap(record.identity)

    def _lost(self, sock: UpstreamSocket) -> None:
        """The reader saw the connection end: every lane of it ends too."""
        if self._socks.get(sock.key) is sock:
            del self._socks[sock.key]
        self.planner.socket_lost(sock.key)
        self._wake()

    def _close_soon(self, ids: list[int] | tuple[int, ...], code: int | None = None) -> None:
        """Close sockets in their own tasks: a cancelled request cannot interrupt the cleanup."""
        code = code or self.close_code
        for sid in ids:
            sock = self._socks.pop(sid, None)
            if sock is None:
                continue
            task = asyncio.get_running_loop().create_task(sock.close(code))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- housekeeping --------------------------------------------------------------------------

    def start(self) -> None:
        """Start housekeeping: idle close, rotation, head expiry."""
        if self._housekeeper is None:
            self._housekeeper = asyncio.get_running_loop().create_task(self._housekeep())

    async def _housekeep(self) -> None:
        pool = self.settings.pool
        interval = min(max(min(pool.idle_close_seconds, pool.rotate_after_seconds) / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(interval)
            self.sweep()

    def _publish_cap(self, identity: str) -> None:
        if self.planner.learned_cap(identity) is not None:
            SOCKET_CAP.set(min(c.limit for c in self.planner.caps.values() if c.limit is not None))

    def sweep(self) -> None:
        """One housekeeping pass (also run by tests)."""
        self.caps.merge_into(self.planner, self._clock())
        tick = self.planner.tick(self._clock())
        for age in tick.ages:
            SOCKET_AGE_AT_ROTATION.observe(age)
        self._close_soon(tick.close)
        for job in tick.reseed:
            task = asyncio.get_running_loop().create_task(self._reseed(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if tick.close:
            self._wake()

    async def _reseed(self, job: Reseed) -> None:
        """Rebuild a rotated ``store: false`` head on a new lane with a ``generate: false`` create
        (proxy/core/reseed.py): off the app's path, never a generation. Any failure only lets the
        head go (the next turn is a full send, as without re-seeding)."""
        identity = self._identities.get(job.identity)
        plan = self.planner.reseed_lane(job.identity, self._clock()) if identity is not None else None
        if plan is None or plan.lane is None or identity is None:
            self.planner.reseeded(job.anchor, None, self._clock(), None)
            return
        response_id: str | None = None
        try:
            if plan.open_socket:
                self._start_open(plan.lane[0], identity)
            ready = self._ready.get(plan.lane[0])
            if ready is not None:
                await asyncio.shield(ready)
            async with self.lease(plan) as turn:
                await turn.send(reseed_frame(job.kept, plan.stream_id))
                while True:
                    _, event = await turn.recv(self.settings.timeouts.stream_idle_seconds)
                    kind = event.get("type")
                    if kind in ("response.completed", "response.failed", "response.incomplete", "error"):
                        break
                turn.finish()  # the lane's own head is set below, under the warm-up's id
                response = event.get("response") if kind == "response.completed" else None
                rid = response.get("id") if isinstance(response, dict) else None
                response_id = rid if isinstance(rid, str) else None
        except Exception:  # noqa: BLE001 - a re-seed is an optimisation; any failure just lets go
            response_id = None
        RESEEDS.labels("ok" if response_id else "failed").inc()
        self._close_soon(self.planner.reseeded(job.anchor, plan.lane, self._clock(), response_id))

    async def close(self, code: int = 1001) -> None:
        """Close every socket (1001: going away) and stop housekeeping."""
        self._closed = True
        self._wake()
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        for task in list(self._opening):
            task.cancel()
        await asyncio.gather(*self._opening, return_exceptions=True)
        self.planner.close_all()
        self._close_soon(list(self._socks), code)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
