"""The pool: executes the planner's plans on real upstream sockets.

Every decision (which lane, continue or full, open a socket, wait and until when, HTTP, what
to close) is made synchronously by :class:`proxy.core.planner.Planner` and arrives as a
:data:`~proxy.core.plans.Plan`; :meth:`Pool.plan` carries it out (``match plan``) and never
changes it. A lane is lent as an ``async with`` lease (:meth:`Pool.lease`), httpcore-style:
leaving the block ends the lane's turn on every path (completion, error, cancellation, app
disconnect), so nothing has to remember to release. A turn left before its terminal event
*drains*: its remaining events are read and dropped, the socket and its other lanes go on
(pitfall 20). Opening and closing sockets is :class:`~proxy.upstream.connect.Connector`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from types import TracebackType

from proxy.config import Settings
from proxy.core.conversation import HeadTable
from proxy.core.creators import OwnerRegistry
from proxy.core.demux import LaneSignal
from proxy.core.lanes import LaneKey, LaneState, SocketState
from proxy.core.planner import Planner
from proxy.core.plans import Continue, Full, Http, HttpContinue, OnLane, Ready, Wait
from proxy.core.request import ParsedRequest
from proxy.core.reseed import Reseed, reseed_frame
from proxy.core.tenants import tenant_of
from proxy.core.waiting import Send, Waiting
from proxy.errors import UpstreamClosed, UpstreamTimeout, UpstreamUnavailable
from proxy.intake.identity import Identity
from proxy.observe.metrics import LANES_FALLBACKS, POOL_WAIT, RESEEDS, SOCKET_AGE_AT_ROTATION
from proxy.reasons import PassthroughReason, ReplayCause
from proxy.upstream.caps import CapFile
from proxy.upstream.connect import Connector, lane_limits
from proxy.upstream.passthrough import Forwarded
from proxy.upstream.turns import SocketUse, Turn, completed_response
from proxy.upstream.ws import Inbox, UpstreamSocket

__all__ = ["Pool", "SocketUse", "Turn"]


class Lease:
    """One lane lent for one response: ``async with pool.lease(plan) as turn`` (a plain class,
    not a generator-based context manager: it is entered and left on every turn)."""

    __slots__ = ("_plan", "_pool", "_turn")

    def __init__(self, pool: Pool, plan: OnLane) -> None:
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


def _baton(waiter: asyncio.Future[int | None]) -> int | None:
    """The baton :meth:`Pool._wake_one` handed ``waiter``, if it was woken by one."""
    return waiter.result() if waiter.done() and not waiter.cancelled() else None


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
        self.planner = Planner(lane_limits(settings), heads, owners)
        self.owners = self.planner.owners
        """Who created each response id (:class:`~proxy.core.creators.OwnerRegistry`)."""
        self.caps = CapFile(p.cap_state_dir)
        """The learned socket caps shared with the other workers of this machine."""
        self._clock = clock
        self.connector = Connector(settings, self.planner, self.caps, clock, self._wake, self._lanes_signal)
        self._socks = self.connector.socks
        self._ready = self.connector.ready
        self._identities: dict[str, Identity] = {}
        """The identities seen, by digest (re-seeds open sockets with their headers)."""
        self._waiters: dict[int, asyncio.Future[int | None]] = {}
        """Turns waiting for a change, by when they began to (oldest first): see :meth:`_wake_one`."""
        self._waited = 0
        self.replans = 0
        """Plans made again after a wake (each one a head lookup): what tests of the wake order read."""
        self._housekeeper: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        c = self.planner.book.lane_counts
        return (
            f"<Pool [Sockets: {self.count(SocketUse.BUSY)} busy, {self.count(SocketUse.IDLE)} idle, "
            f"{self.count(SocketUse.CONNECTING)} connecting | Lanes: {c[LaneState.BUSY]} busy, "
            f"{c[LaneState.IDLE]} idle, {c[LaneState.DRAINING]} draining]>"
        )

    @property
    def close_code(self) -> int:
        """Close code for sockets retired from now on (1001 once the sidecar drains)."""
        return self.connector.close_code

    @close_code.setter
    def close_code(self, code: int) -> None:
        self.connector.close_code = code

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

    async def plan(self, identity: Identity, req: ParsedRequest, *, replay: bool = False) -> tuple[Ready, Waiting]:
        """The next attempt of ``req``, with its lane reserved and its socket open.

        Carries out the planner's plans: a :class:`Wait` is waited until the planner's deadline
        for the turn (:class:`~proxy.core.waiting.Waiting`) or until a lane frees, whichever is
        first, then the turn is planned again; a new socket's handshake is waited for; a
        refused or failed handshake never fails the request: it takes another lane or goes
        over HTTP.

        Returns:
            The plan (:class:`Continue`/:class:`Full` with a lane, :class:`Http` or
            :class:`HttpContinue`), and the turn's wait: how it ended and
            :attr:`Waiting.seconds`, the time spent waiting for a lane or a handshake.
        """
        waiting = Waiting(self._clock())
        self._identities[identity.digest] = identity
        try:
            plan = await self._plan(identity, req, replay, waiting)
        finally:
            self.planner.patience.unqueue(waiting)  # a request gone mid-wait leaves its queue too
        if waiting.deadline is not None:
            POOL_WAIT.labels("lanes").observe(waiting.seconds)
        return plan, waiting

    async def _plan(self, identity: Identity, req: ParsedRequest, replay: bool, waiting: Waiting) -> Ready:
        """Plan until a plan is ready; :attr:`Waiting.seconds` is the time that took."""
        may_open = True
        baton: int | None = None
        while True:
            now = self._clock()
            if self.connector.closed:
                waiting.seconds = now - waiting.started
                return Http(PassthroughReason.WS_UNAVAILABLE)
            plan = self.planner.plan(identity.digest, req, now, replay=replay, may_open=may_open, waiting=waiting)
            if plan.close:
                self.connector.close_soon(plan.close)
            if baton is not None and not isinstance(plan, (Continue, Full)):
                self._wake_one(baton)  # what freed was not for this turn: the next waiter's turn
            baton = None
            match plan:
                case Wait():
                    assert waiting.deadline is not None, "a wait without a deadline"
                    baton = await self._wait_change(waiting.deadline - now)
                    self.replans += 1
                case Http() | HttpContinue():
                    waiting.seconds = now - waiting.started
                    return plan
                case Continue() | Full():
                    if plan.warm is not None:
                        self.connector.start_open(plan.warm, identity)
                    if plan.open_socket:
                        self.connector.start_open(plan.lane[0], identity)
                    ready = self._ready.get(plan.lane[0])
                    if ready is not None:
                        try:
                            await asyncio.shield(ready)
                        except UpstreamUnavailable:
                            may_open = False  # the lane went with the socket; another one, or HTTP
                            continue
                        except asyncio.CancelledError:
                            self.planner.finished(plan.lane, self._clock())
                            raise
                    waiting.seconds = self._clock() - waiting.started
                    return plan

    async def _wait_change(self, timeout: float) -> int | None:
        """Wait until woken or ``timeout``; returns the baton of :meth:`_wake_one` if that woke
        this turn (it goes to the next waiter unless the turn takes a lane), else ``None``."""
        waiter: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._waited += 1
        place = self._waited
        self._waiters[place] = waiter
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            pass  # (woken in the same moment: the baton below is still this turn's)
        except asyncio.CancelledError:
            baton = _baton(waiter)
            if baton is not None:
                self._wake_one(baton)  # a turn gone mid-wait hands its baton on
            raise
        finally:
            self._waiters.pop(place, None)
        return _baton(waiter)

    def _wake(self) -> None:
        """Something changed for many turns (a socket opened or closed, or learned whether the
        upstream takes lanes): every waiter plans again."""
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def _wake_one(self, before: int | None = None) -> None:
        """One lane freed: the longest-waiting turn (among those waiting before ``before``) plans
        again, and hands this baton on if it does not take a lane. One plan per freed lane in
        the usual case, not one per waiting turn (hundreds of head lookups at every turn's end
        when many turns wait); a turn that came to wait after the lane freed is not handed the
        baton (it planned with the lane already free)."""
        limit = self._waited + 1 if before is None else before
        for place, waiter in self._waiters.items():
            if place >= limit:
                return
            if not waiter.done():
                del self._waiters[place]
                waiter.set_result(limit)
                return

    # -- leases --------------------------------------------------------------------------------

    def lease(self, plan: OnLane) -> Lease:
        """Lend the plan's lane for one response (``async with pool.lease(plan) as turn``).

        Raises:
            UpstreamClosed: the socket closed between the plan and the lease.
        """
        return Lease(self, plan)

    def _lent(self, plan: OnLane) -> Turn:
        key = plan.lane
        sock = self._socks.get(key[0])
        if sock is None or sock.error is not None:
            self.planner.finished(key, self._clock())
            raise sock.error if sock is not None and sock.error else UpstreamClosed("The upstream socket closed.")
        # What the upstream's time is a sample of (a hydrated continuation: nothing).
        measured = Send.FULL if isinstance(plan, Full) else None if plan.hydrated else Send.CONTINUE
        return Turn(key, sock, sock.open_inbox(key[1]), measured)

    def _returned(self, turn: Turn, exc: BaseException | None) -> None:
        """The lease of ``turn`` ended, by ``exc`` if it failed (which goes on up)."""
        if isinstance(exc, UpstreamClosed):
            key, sock = turn.key, turn.socket
            if key[1] is not None and not sock.demux.proven and not turn.inbox.seen:
                # Closed right after a named lane's first create on a socket that never routed
                # a stream_id: an upstream that refuses lanes by closing, or a lost socket.
                if self.planner.proof.closed_early(self._clock()):
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
            close = self.planner.finished(
                key,
                self._clock(),
                req=turn.req,
                response=turn.response,
                prefix_state=turn.prefix_state,
                retire=turn.retire,
                measured=turn.measured,
                # Measured as an HTTP send is (from the send until the answer was relayed), so
                # the two compare like with like, the sidecar's own loop in both.
                upstream_seconds=time.perf_counter() - turn.sent_at,
            )
            self._freed(close, sock.error is not None)
        else:
            # Left mid-response: read the rest of it and drop it; the lane is free after that.
            inbox.draining = True
            inbox.frames.clear()
            inbox.on_drained = lambda: self._drained(sock, inbox, key)
            self.planner.custody.abandon(key)
            self._wake()  # its head let go: a turn waiting for that lane goes elsewhere

    def _drained(self, sock: UpstreamSocket, inbox: Inbox, key: LaneKey) -> None:
        sock.close_inbox(inbox)
        self._freed(self.planner.finished(key, self._clock()))

    def _freed(self, close: list[int], socket_gone: bool = False) -> None:
        """A lane's response ended: the sockets the planner let go close. A socket going
        (``close``, or the lane's own socket failed) makes room for a new one, with lanes of its
        own: every waiting turn plans again; else one lane freed wakes one (:meth:`_wake_one`)."""
        self.connector.close_soon(close)
        if close or socket_gone:
            self._wake()
        else:
            self._wake_one()

    # -- what the upstream taught --------------------------------------------------------------

    def retire(self, socket_id: int) -> None:
        """No new turns on ``socket_id`` (a limit was reached); closed once drained."""
        self.connector.close_soon(self.planner.custody.retire(socket_id))

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
            self.planner.custody.adopt(identity.digest, req, response, self._clock())

    def _lanes_signal(self, signal: LaneSignal) -> None:
        """A socket's demux learned whether the upstream takes ``stream_id``."""
        if self.planner.proof.signal(signal, self._clock()):
            LANES_FALLBACKS.inc()
        # Proven: that socket may carry more responses now. Refused or ignored: the lanes a
        # moment away that new heads wait for will not come; they go now.
        self._wake()

    def replayed(self, cause: ReplayCause, lane: LaneKey | None) -> None:
        """What an attempt replayed for ``cause`` (on ``lane``) tells the pool: the upstream does
        not take ``stream_id`` (named lanes off for a while), or the lane's socket takes no more
        streams; other causes tell it nothing."""
        if cause is ReplayCause.LANES_UNSUPPORTED:
            if self.planner.proof.refused(self._clock()):
                LANES_FALLBACKS.inc()
        elif cause is ReplayCause.STREAM_LIMIT and lane is not None:
            self.planner.book.stream_limit(lane)

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

    def sweep(self) -> None:
        """One housekeeping pass (also run by tests)."""
        self.caps.merge_into(self.planner, self._clock())
        tick = self.planner.tick(self._clock())
        for age in tick.ages:
            SOCKET_AGE_AT_ROTATION.observe(age)
        self.connector.close_soon(tick.close)
        for job in tick.reseed:
            self.connector.spawn(self._reseed(job))
        if tick.close:
            self._wake()

    async def _reseed(self, job: Reseed) -> None:
        """Rebuild a rotated ``store: false`` head on a new lane with a ``generate: false`` create
        (proxy/core/reseed.py): off the app's path, never a generation. Any failure only lets the
        head go (the next turn is a full send, as without re-seeding)."""
        identity = self._identities.get(job.identity)
        plan = self.planner.reseed_lane(job.identity, self._clock()) if identity is not None else None
        if plan is None or identity is None:
            self.planner.reseeded(job.anchor, None, self._clock(), None)
            return
        response_id: str | None = None
        try:
            if plan.open_socket:
                self.connector.start_open(plan.lane[0], identity)
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
        self.connector.close_soon(self.planner.reseeded(job.anchor, plan.lane, self._clock(), response_id))

    async def close(self, code: int = 1001) -> None:
        """Close every socket (1001: going away) and stop housekeeping."""
        self.connector.closed = True
        self._wake()
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        await self.connector.close(code)
