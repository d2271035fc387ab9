"""The planner: one synchronous owner of "this socket and lane hold this conversation head".

Given an identity, a parsed request and ``now``, :meth:`Planner.plan` returns a :class:`Plan`:
continue on lane L with ``previous_response_id`` and the new items, send the full input on lane
L, wait for a lane, or go over HTTP, each with a reason. :meth:`Planner.finished`,
:meth:`Planner.abandon`, :meth:`Planner.socket_lost` and :meth:`Planner.tick` are the follow-ups;
they return the sockets to close. Nothing here does I/O or reads a clock: the pool
(``proxy/upstream/pool.py``) executes the plans, httpcore-style.

Lane choice for a request that needs a new head (a new conversation, a miss):

1. while the identity has fewer than ``spread_sockets`` sockets and no idle one, a new socket
   (conversations spread over a few sockets before they share one);
2. a free lane (idle, no head) of the identity's least active socket below
   ``max_active_per_socket`` (the limit places new heads; a head's own next turn goes on its lane
   whatever the socket's count, and the upstream queues it beyond 16);
3. a new socket, under ``max_sockets_per_identity`` and ``max_sockets_total`` (at the total, the
   least recently used socket with nothing in flight, of any identity, is closed);
4. the least recently used idle lane that holds a head (that head is let go: detached and still
   continuable through the upstream's store when ``store`` is true, else forgotten);
5. nothing: wait for a lane (the pool bounds the wait, then uses HTTP).

A refused upgrade (429, 426, 401/403) holds off only *new* sockets of that identity: turns whose
lane exists go on, and a request that needed a socket takes another socket's lane or waits.
A head whose lane is gone (socket closed, rotated, evicted) is continued on any lane when its
response was stored: the upstream hydrates it (protocol.md §6).

Scarce sockets:

- a socket whose lanes are not proven (``Socket.demux``, proxy/core/demux.py) carries one
  response at a time (:attr:`~proxy.core.lanes.Socket.exclusive`); its first named lane is the
  probe that proves or refuses them;
- a 429 (or ``websocket_connection_limit_reached``) on an upgrade teaches the identity's socket
  cap (:class:`SocketCap`): no upgrade before ``retry-after`` or the backoff (doubling, with the
  caller's jitter), whichever is later, none above the cap but one probe every ``cap_probe_seconds`` (a raised limit is
  found again); new sockets of an identity open with a slow start (at most as many handshakes
  at once as sockets open, at least one), never in a burst;
- a stored head whose lane cannot be had now is continued on another lane (hydrated), or the
  plan is a WAIT the pool may turn into an HTTP continuation (:attr:`PlanKind.HTTP_CONTINUE`,
  ``previous_response_id`` + the new items over plain HTTP) after a short wait; a ``store:
  false`` head waits for its own lane.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from proxy.core.conversation import Head, HeadTable
from proxy.core.creators import OwnerRegistry
from proxy.core.demux import LaneSignal
from proxy.core.fair import tenant_of
from proxy.core.lanes import (
    Lane,
    LaneEvent,
    LaneKey,
    LaneState,
    Socket,
    SocketEvent,
    SocketState,
    lane_name,
    lane_step,
    socket_step,
)
from proxy.core.reasons import Hit, MissReason, PassthroughReason, WaitOutcome
from proxy.core.request import ParsedRequest, build_frame
from proxy.core.reseed import Kept, KeptContexts
from proxy.core.waiting import Estimates, Send, Waiting, WaitRule, wait_seconds

__all__ = [
    "LaneLimits",
    "Plan",
    "PlanKind",
    "Planner",
    "Reseed",
    "SocketCap",
    "Tick",
    "hold_off_seconds",
    "is_cap_refusal",
]

LANES_RETRY_SECONDS = 600.0
"""How long named lanes stay off after the upstream refused one."""

EARLY_CLOSES_TO_REFUSE = 3
"""Once lanes are proven on the upstream, how many fresh sockets in a row (no lane proven in
between) must close before their first event on a named lane for that to count as a refusal."""

_HOLD_426 = 300.0
_HOLD_AUTH = 30.0
_HOLD_MAX = 300.0
_BACKOFF_BASE = 0.5
"""First backoff after a cap refusal without ``retry-after`` (doubling per refusal in a row)."""
_BACKOFF_MAX = 60.0
_SLOW_START = 4
"""Handshakes an identity may have under way at once before it has sockets open (then as many
as it has open): a cap is met by at most about as many refusals as it allows, never a burst."""


def is_cap_refusal(status: int | None, payload: bytes = b"") -> bool:
    """Whether a refused upgrade says the credential's socket cap is reached: HTTP 429, or a
    ``websocket_connection_limit_reached`` body (protocol.md §5.2: undocumented, so both)."""
    return status == 429 or b"websocket_connection_limit_reached" in payload


@dataclass(slots=True)
class SocketCap:
    """What an identity's refused upgrades taught (shared by the workers of one machine)."""

    limit: int | None = None
    """Sockets the upstream allows this credential (``None``: no refusal seen)."""
    until: float = 0.0
    """No upgrade before this (``retry-after``, backoff, jitter)."""
    refusals: int = 0
    """Cap refusals in a row (the backoff's exponent); a successful upgrade resets it."""
    probe_at: float = 0.0
    """When one upgrade above :attr:`limit` may try whether the limit was raised."""


def hold_off_seconds(status: int | None, headers: Mapping[str, str]) -> float:
    """How long an identity opens no new socket after its upgrade was refused with ``status``.

    426 ("use HTTP"): 5 minutes; a ``retry-after`` is honoured (at most 5 minutes); 401/403
    without it: 30 s; anything else (including a connect error, ``status=None``): nothing.
    """
    if status == 426:
        return _HOLD_426
    try:
        retry_after = float(headers.get("retry-after", ""))
    except ValueError:
        retry_after = 0.0
    if retry_after > 0:
        return min(retry_after, _HOLD_MAX)
    return _HOLD_AUTH if status in (401, 403) else 0.0


@dataclass(frozen=True, slots=True)
class LaneLimits:
    """The pool's limits, as the planner needs them (``pool.*`` settings)."""

    lanes_per_socket: int = 32
    """Lanes per socket, the default lane included (1: no ``stream_id`` at all)."""
    max_active_per_socket: int = 16
    max_sockets_per_identity: int = 32
    max_sockets_total: int = 256
    spread_sockets: int = 32
    idle_close_seconds: float = 900.0
    rotate_after_seconds: float = 3300.0
    reseed: bool = False
    """Re-seed ``store: false`` heads of a socket rotated while idle (``proxy/core/reseed.py``)."""
    reseed_bytes: int = 64 * 1024 * 1024
    cap_probe_seconds: float = 600.0
    """After a cap refusal, how long until one upgrade above the learned cap probes again."""
    wait_seconds: float = 1.0
    """The longest any turn waits for a lane (``pool.wait_seconds``)."""
    connect_seconds: float = 10.0
    """How much longer a wait for lanes a moment away (a handshake) may last (``timeouts.connect_seconds``)."""
    http_continuations: bool = True
    """A stored head with no lane may be continued over plain HTTP (``pool.http_continuations``)."""
    http_continuation_after_seconds: float = 0.01
    """How long a stored turn waits for lanes a moment away before its HTTP continuation."""


@dataclass(frozen=True, slots=True)
class Reseed:
    """Rebuild the ``store: false`` head kept under ``anchor`` on a new lane of ``identity``."""

    identity: str
    anchor: LaneKey
    kept: Kept


@dataclass(slots=True)
class Tick:
    """What housekeeping found to do."""

    close: list[int]
    """Sockets to close."""
    ages: list[float]
    """Ages of the sockets closed by rotation."""
    reseed: list[Reseed]
    """Heads to re-seed on a new lane (their socket was rotated)."""


class PlanKind(enum.StrEnum):
    """What the pool does with a request."""

    CONTINUE = "continue"
    FULL = "full"
    WAIT = "wait"
    HTTP = "http"
    HTTP_CONTINUE = "http_continue"
    """``previous_response_id`` + the new items over plain HTTP (a stored head, no lane now)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's decision for one attempt of one request."""

    kind: PlanKind
    reason: Hit | MissReason | PassthroughReason | None
    """``continuation``, a :class:`MissReason` or a :class:`PassthroughReason` (``None``: a replay's)."""
    lane: LaneKey | None = None
    """The lane reserved for this attempt (BUSY until ``finished``/``abandon``)."""
    open_socket: bool = False
    """The lane's socket is new: the caller opens it (``opened``/``open_failed``)."""
    response_id: str | None = None
    """``previous_response_id`` of a continuation."""
    new_items: list[Any] | None = None
    items_avoided: int = 0
    hydrated: bool = False
    """A continuation of a stored head whose lane is gone: the upstream hydrates it."""
    dropped_reasoning: int = 0
    dropped_phase: int = 0
    """Echoed assistant messages without their ``phase`` (a continuation only if tolerated)."""
    close: tuple[int, ...] = ()
    """Sockets to close first (the total limit's least recently used)."""
    warm: int | None = None
    """A spare socket to open in the background (nobody waits for it)."""
    over_http: bool = False
    """A WAIT that may become an HTTP continuation (the head is stored): the pool decides when."""
    growing: bool = False
    """A WAIT for lanes a moment away (a socket of the identity in its handshake or probing its
    lanes), not for busy ones: ``pool.wait_seconds`` counts from when the growing stops."""

    @property
    def stream_id(self) -> str | None:
        """The lane's ``stream_id`` (``None``: the default lane)."""
        return self.lane[1] if self.lane is not None else None

    def frame(self, req: ParsedRequest) -> bytes:
        """The attempt's ``response.create`` frame: a continuation's new items after its
        ``previous_response_id``, else the app's whole input."""
        if self.kind is PlanKind.CONTINUE:
            items = self.new_items or []
            return build_frame(req, previous_response_id=self.response_id, items=items, stream_id=self.stream_id)
        return build_frame(req, stream_id=self.stream_id)


def _lane_key(anchor: Hashable) -> LaneKey:
    """A head's anchor as the lane key the planner gave it."""
    assert isinstance(anchor, tuple), f"not a lane key: {anchor!r}"
    return anchor


class Planner:
    """Sockets, lanes and heads of every identity.

    Args:
        limits: The pool limits.
        heads: The head table; the planner is the only one that records or drops heads.
        owners: Who created each response id: every head's id is noted as its
            identity's when the planner records, moves or renames the head (default: a registry
            sized for ``heads``).
    """

    def __init__(self, limits: LaneLimits, heads: HeadTable, owners: OwnerRegistry | None = None) -> None:
        self.limits = limits
        self.heads = heads
        self.owners = owners if owners is not None else OwnerRegistry.for_heads(heads.max_heads)
        self._lanes_off_until = 0.0
        self._lanes_proven = False
        """A socket routed a ``stream_id`` since named lanes were last turned off."""
        self._early_closes = 0
        """Fresh sockets closed before their first event on a named lane since the last proof."""
        self._queued: Counter[str] = Counter()
        """Turns waiting for a busy lane, by identity (their queue)."""
        self.estimates = Estimates()
        """Measured lane busy times and upstream times, per identity (the waiting rule's inputs)."""
        self.kept = KeptContexts(limits.reseed_bytes)
        """Contexts of ``store: false`` heads, for re-seeding (empty unless ``reseed``)."""
        self._reseeding: set[LaneKey] = set()
        self._sockets: dict[int, Socket] = {}
        self._by_identity: dict[str, dict[int, Socket]] = {}
        self.outside: Counter[str] = Counter()
        """Upstream sockets an identity holds outside the pool (WebSocket relay sessions): they
        count against ``max_sockets_per_identity`` and ``max_sockets_total`` too."""
        self._ids = itertools.count(1)
        self._detached = itertools.count(1)
        self._hold_until: dict[str, float] = {}
        self._slow_start = False
        """The last open was held back by the slow start only."""
        self.caps: dict[str, SocketCap] = {}
        """Learned socket caps by identity."""
        self._max_slots: dict[int, int] = {}
        self._now = 0.0
        self.lane_counts: Counter[LaneState] = Counter()
        """Lanes by state (live sockets only)."""
        self.socket_counts: Counter[SocketState] = Counter()
        """Sockets by state (closed ones are forgotten)."""
        self.busy_sockets = 0
        """Open or retiring sockets with at least one active lane."""
        self.on_step: Callable[[str, enum.StrEnum, enum.StrEnum], None] | None = None
        """Told every step taken, as ``("lane" | "socket", state, event)`` before it is taken
        (tests check that every row of the tables is exercised): a seam of our own, since a
        monkeypatched ``lane_step`` would not reach the compiled build. ``None`` in production."""

    def __repr__(self) -> str:
        c = self.lane_counts
        return (
            f"<Planner [Sockets: {len(self._sockets)} ({self.busy_sockets} busy) | "
            f"Lanes: {c[LaneState.BUSY]} busy, {c[LaneState.IDLE]} idle, {c[LaneState.DRAINING]} draining]>"
        )

    # -- queries ---------------------------------------------------------------------------

    @property
    def named_lanes(self) -> bool:
        """Whether named lanes are used: off for ``LANES_RETRY_SECONDS`` after the upstream
        refused a ``stream_id`` (then tried again, so one misread close costs little)."""
        return self.limits.lanes_per_socket > 1 and self._now >= self._lanes_off_until

    def socket(self, socket_id: int) -> Socket | None:
        """The live record of a socket, if it is not closed."""
        return self._sockets.get(socket_id)

    def lane(self, key: LaneKey) -> Lane | None:
        """The record of a lane, if its socket is not closed."""
        sock = self._sockets.get(key[0])
        return sock.lanes.get(key[1]) if sock is not None else None

    def sockets(self, identity: str | None = None) -> list[Socket]:
        """Live socket records (of ``identity``, or all)."""
        if identity is None:
            return list(self._sockets.values())
        return list(self._by_identity.get(identity, {}).values())

    def held_off(self, identity: str, now: float) -> bool:
        """Whether new sockets of ``identity`` are held off after a refused upgrade (a
        ``retry-after`` or backoff of a cap refusal included)."""
        cap = self.caps.get(identity)
        if cap is not None and now < cap.until:
            return True
        until = self._hold_until.get(identity)
        if until is None:
            return False
        if now < until:
            return True
        del self._hold_until[identity]
        return False

    def _stale(self, sock: Socket, now: float) -> bool:
        lim = self.limits
        if now - sock.created_at >= lim.rotate_after_seconds:
            return True
        return sock.active == 0 and now - sock.used_at >= lim.idle_close_seconds

    def _idle_lane(self, key: LaneKey) -> Lane | None:
        """The lane ``key`` if its head's next turn can start on it now (idle, socket open and
        fresh). The socket's active limit does not apply: beyond it the upstream queues the
        response until one of the socket's others ends, which costs far less than the full send
        elsewhere (the whole history rebuilt upstream, maybe a new socket) that refusing would take."""
        sock = self._sockets.get(key[0])
        if sock is None or sock.state is not SocketState.OPEN or self._stale(sock, self._now):
            return None
        lane = sock.lanes.get(key[1])
        if lane is None or lane.state is not LaneState.IDLE:
            return None
        return lane

    def _usable(self, head: Head) -> bool:
        """Whether ``head`` can be continued now: its lane is idle, or its lane is gone and the
        response was stored (the upstream hydrates it on any lane)."""
        key = _lane_key(head.anchor)
        if self._idle_lane(key) is not None:
            return True
        sock = self._sockets.get(key[0])
        lane = sock.lanes.get(key[1]) if sock is not None else None
        if lane is not None and lane.state is not LaneState.IDLE:
            return False  # its lane is busy: the cached state is moving on (a parallel branch)
        return head.store

    # -- the plan --------------------------------------------------------------------------

    def plan(
        self,
        identity: str,
        req: ParsedRequest,
        now: float,
        *,
        replay: bool = False,
        may_open: bool = True,
        waiting: Waiting | None = None,
    ) -> Plan:
        """Decide the next attempt of ``req``; a returned lane is reserved (BUSY).

        Args:
            identity: The caller's identity digest.
            req: The parsed request.
            now: Monotonic time.
            replay: A replay after a failure: always the full input, never a continuation.
            may_open: Whether a new socket may be opened (false after one failed to open).
            waiting: The turn's wait, kept by the pool across its plans: with it, a turn whose
                lane cannot be had now waits only while that is worth it (:meth:`_wait`) and
                the plan says until when (:attr:`Waiting.deadline`); without it, a ``WAIT``
                plan only says that no lane can be had now.
        """
        plan = self._situation(identity, req, now, replay, may_open, waiting)
        if waiting is not None:
            if plan.kind is not PlanKind.WAIT:
                self.unqueue(waiting)
                if waiting.deadline is not None and plan.lane is not None:
                    waiting.outcome = WaitOutcome.LANE
            elif waiting.rule is WaitRule.BUSY:
                self.queue(identity, waiting)
        if plan.kind is PlanKind.HTTP_CONTINUE and not self.limits.http_continuations:
            return Plan(PlanKind.HTTP, PassthroughReason.UPGRADE_REFUSED, close=plan.close)
        return plan

    def _situation(
        self, identity: str, req: ParsedRequest, now: float, replay: bool, may_open: bool, waiting: Waiting | None
    ) -> Plan:
        self._now = now
        if req.previous_response_id is not None:
            anchor = self.heads.anchor_for(identity, req.previous_response_id)
            lane = self._idle_lane(_lane_key(anchor)) if anchor is not None else None
            if lane is not None and not self._sockets[lane.key[0]].exclusive:
                self._begin(lane, now)
                return Plan(PlanKind.FULL, MissReason.APP_CHAINED, lane.key)
            return self._new_head(
                identity, req, now, self._full(identity, now, MissReason.APP_CHAINED, may_open), waiting
            )
        if replay:
            return self._new_head(identity, req, now, self._full(identity, now, None, may_open), waiting)
        self.heads.expire(now)
        lookup = self.heads.lookup(identity, req, now, self._usable)
        match = lookup.match
        if match is None:
            plan = self._full(identity, now, lookup.reason, may_open)
            # Against an upstream without lanes (one response per socket: a lane frees only
            # when a whole response ends), a stored new conversation that must wait goes over
            # plain HTTP instead; its response is adopted as a head.
            over_http = plan.kind is PlanKind.WAIT and req.store and not self.named_lanes
            plan = replace(
                plan,
                dropped_reasoning=lookup.dropped_reasoning,
                dropped_phase=lookup.dropped_phase,
                over_http=over_http,
            )
            return self._new_head(identity, req, now, plan, waiting)
        self.heads.touch(match.anchor, now)
        key = _lane_key(match.anchor)
        lane = self._idle_lane(key)
        if lane is not None and not self._sockets[key[0]].exclusive:
            # the usual case: built once (dataclasses.replace costs ~10 µs)
            self._begin(lane, now)
            return Plan(
                PlanKind.CONTINUE,
                Hit.CONTINUATION,
                lane.key,
                response_id=match.response_id,
                new_items=match.new_items,
                items_avoided=match.items_avoided,
                dropped_reasoning=lookup.dropped_reasoning,
                dropped_phase=lookup.dropped_phase,
            )
        cont = Plan(
            PlanKind.CONTINUE,
            Hit.CONTINUATION,
            response_id=match.response_id,
            new_items=match.new_items,
            items_avoided=match.items_avoided,
            dropped_reasoning=lookup.dropped_reasoning,
            dropped_phase=lookup.dropped_phase,
        )
        head = self.heads.get(key)
        size = len(req.body)
        if lane is not None and (head is None or not head.store):
            # Its own lane is free but its socket carries another response and may not
            # multiplex: a store: false head waits for it while that is expected to pay off
            # (elsewhere it is a full send), then goes in full now.
            sock = self._sockets[key[0]]
            expected = self.estimates.remaining(identity, now - sock.used_at)
            saving = self.estimates.saving(identity, Send.FULL, size)
            if waiting is None:
                return Plan(PlanKind.WAIT, MissReason.NO_HEAD)
            if self._wait(waiting, now, expected, saving, self.limits.wait_seconds):
                return Plan(PlanKind.WAIT, MissReason.NO_HEAD)
            return self._go_now(identity, now, may_open, key)
        if lane is not None and self._sockets[key[0]].demux.probing:
            # Its socket is probing its lanes (a named lane's first event is on its way): the
            # proof is a moment away and its own lane keeps the cache.
            wait = replace(cont, kind=PlanKind.WAIT, over_http=True)
            if waiting is None:
                return wait
            sock = self._sockets[key[0]]
            expected = self.estimates.remaining(identity, now - sock.used_at)
            saving = self._stored_saving(identity, size)
            if self._wait(waiting, now, expected, saving, self.limits.wait_seconds):
                return wait
            return replace(cont, kind=PlanKind.HTTP_CONTINUE)
        plan = self._full(identity, now, MissReason.NO_HEAD, may_open)
        if plan.lane is None:
            if plan.kind is not PlanKind.WAIT:
                return replace(cont, kind=PlanKind.HTTP_CONTINUE, close=plan.close)
            wait = replace(cont, kind=PlanKind.WAIT, close=plan.close, over_http=True, growing=plan.growing)
            if waiting is None:
                return wait
            if plan.growing:  # lanes a moment away: a short wait, then HTTP
                if self._brief(waiting, now):
                    return wait
            elif self._wait(
                waiting,
                now,
                self._soonest(identity, now, waiting),
                self._stored_saving(identity, size),
                self.limits.wait_seconds,
            ):
                return wait
            return replace(cont, kind=PlanKind.HTTP_CONTINUE, close=plan.close)
        taken = self.lane(plan.lane)
        assert taken is not None
        taken.from_head = _lane_key(match.anchor)
        return replace(
            cont, lane=plan.lane, open_socket=plan.open_socket, hydrated=True, close=plan.close, warm=plan.warm
        )

    # -- waiting (proxy/core/waiting.py) ------------------------------------------------------

    def _wait(self, waiting: Waiting, now: float, expected: float, saving: float, limit: float) -> bool:
        """Whether the turn waits (on) for a busy lane: its deadline is set when it starts to
        (:func:`~proxy.core.waiting.wait_seconds`, the time already spent counted against the
        saving and the bound), and it waits until then."""
        if waiting.rule is not WaitRule.BUSY:
            spent = now - waiting.started if waiting.deadline is not None else 0.0
            seconds = wait_seconds(expected, saving - spent, limit - spent)
            if seconds <= 0.0:
                waiting.outcome = WaitOutcome.WAIT_NOT_WORTH_IT
                return False
            waiting.rule, waiting.deadline = WaitRule.BUSY, now + seconds
        assert waiting.deadline is not None
        if now < waiting.deadline:
            return True
        waiting.outcome = WaitOutcome.WAIT_EXPIRED
        return False

    def _brief(self, waiting: Waiting, now: float) -> bool:
        """A stored turn whose lanes are a moment away (a handshake, a probe: nothing measured
        says how long) waits ``pool.http_continuation_after_seconds`` at most (from when it
        asked), then goes over HTTP, which it can at once."""
        if waiting.rule is not WaitRule.BRIEF:
            waiting.rule = WaitRule.BRIEF
            waiting.deadline = waiting.started + self.limits.http_continuation_after_seconds
        assert waiting.deadline is not None
        if now < waiting.deadline:
            return True
        waiting.outcome = WaitOutcome.WAIT_EXPIRED
        return False

    def _grow(self, waiting: Waiting, now: float) -> bool:
        """A wait for lanes a moment away (a handshake, a probe): ``pool.wait_seconds`` counts
        from when the growing stops, at most ``timeouts.connect_seconds`` later."""
        lim = self.limits
        cap = waiting.started + lim.wait_seconds + lim.connect_seconds
        waiting.rule, waiting.deadline = WaitRule.GROW, min(now + lim.wait_seconds, cap)
        waiting.growing = True
        if now < waiting.deadline:
            return True
        waiting.outcome = WaitOutcome.WAIT_EXPIRED
        return False

    def _stored_saving(self, identity: str, size: int) -> float:
        """What a stored head's lane saves against the alternative it has now (an HTTP
        continuation, or the full input over HTTP when those are off)."""
        alternative = Send.HTTP_CONTINUE if self.limits.http_continuations else Send.HTTP_FULL
        return self.estimates.saving(identity, alternative, size)

    def _soonest(self, identity: str, now: float, waiting: Waiting) -> float:
        """Expected seconds until a lane of ``identity``'s busy sockets frees for this turn:
        the turns already waiting for one go first (each socket frees one after another, every
        busy time, in the order its current response is expected to end)."""
        ahead = self._queued[identity] - (1 if waiting.queued else 0)
        busy = self.estimates.busy(identity)
        left = sorted(
            self.estimates.remaining(identity, now - s.used_at)
            for s in self._by_identity.get(identity, {}).values()
            if s.live and s.active
        )
        if not left:
            return busy
        rounds, slot = divmod(max(ahead, 0), len(left))
        return left[slot] + rounds * busy

    def queue(self, identity: str, waiting: Waiting) -> None:
        """``waiting`` waits for one of ``identity``'s busy lanes (its place in the queue)."""
        if not waiting.queued:
            waiting.queued = True
            waiting.identity = identity
            self._queued[identity] += 1

    def unqueue(self, waiting: Waiting) -> None:
        """The turn's wait ended (a plan, or the request went away): it leaves the queue."""
        if waiting.queued:
            waiting.queued = False
            self._queued[waiting.identity] -= 1
            if self._queued[waiting.identity] <= 0:
                del self._queued[waiting.identity]

    def _new_head(self, identity: str, req: ParsedRequest, now: float, plan: Plan, waiting: Waiting | None) -> Plan:
        """A request that needs a new head (new conversation, app-chained, replay) and found
        no lane now: it waits for lanes a moment away (bounded), for busy ones only while what
        a lane saves (the full send over a socket against plain HTTP) exceeds the expected
        wait; else plain HTTP now."""
        if plan.kind is not PlanKind.WAIT or waiting is None:
            return plan
        if plan.growing:
            # Lanes a moment away (a handshake, a probe): the new head waits for them, as its
            # next turns continue from the lane's memory (a head adopted from plain HTTP would
            # make its next turn a hydration, the upstream re-reading its store).
            if self._grow(waiting, now):
                return plan
            return Plan(PlanKind.HTTP, PassthroughReason.POOL_FULL, close=plan.close)
        # What the send itself gains on a lane; not what its later turns might, which a head
        # kept by a scarce lane seldom gets (the next new conversation evicts it).
        saving = self.estimates.saving(identity, Send.HTTP_FULL, len(req.body), on_lane=Send.FULL)
        if self._wait(waiting, now, self._soonest(identity, now, waiting), saving, self.limits.wait_seconds):
            return plan
        return Plan(PlanKind.HTTP, PassthroughReason.WAIT_NOT_WORTH_IT, close=plan.close)

    def _go_now(self, identity: str, now: float, may_open: bool, head: LaneKey) -> Plan:
        """A ``store: false`` head (on lane ``head``) that does not wait (on) for its busy
        lane: its full input on a free lane now (whose answer replaces the head: one head per
        conversation), else over plain HTTP."""
        plan = self._full(identity, now, MissReason.WAIT_NOT_WORTH_IT, may_open)
        if plan.kind is PlanKind.WAIT:
            return Plan(PlanKind.HTTP, PassthroughReason.WAIT_NOT_WORTH_IT, close=plan.close)
        if plan.lane is None:
            return plan
        taken = self.lane(plan.lane)
        assert taken is not None
        taken.from_head = head
        return plan

    def _full(self, identity: str, now: float, reason: Hit | MissReason | None, may_open: bool) -> Plan:
        close: list[int] = []
        found = self._free_lane(identity, now, may_open, close)
        if found is not None:
            lane, opened, spare = found
            self._begin(lane, now)
            return Plan(PlanKind.FULL, reason, lane.key, open_socket=opened, close=tuple(close), warm=spare)
        live = [s for s in self._by_identity.get(identity, {}).values() if s.live]
        if not live and self.held_off(identity, now):
            return Plan(PlanKind.HTTP, PassthroughReason.UPGRADE_REFUSED, close=tuple(close))
        if not live and not may_open:
            return Plan(PlanKind.HTTP, PassthroughReason.WS_UNAVAILABLE, close=tuple(close))
        return Plan(PlanKind.WAIT, reason, close=tuple(close), growing=self._growing(identity))

    def _growing(self, identity: str) -> bool:
        """Whether ``identity``'s sockets are still growing: the slow start held its last open
        back, or one is in its handshake, or probing its lanes (its first named lane's first
        event proves or refuses them). Lanes are a moment away, not taken: a burst of new
        conversations waits for them, it evicts no head (a ``store: false`` one would be
        forgotten) and is not yet ``pool_full``."""
        if self._slow_start:
            return True
        for sock in self._by_identity.get(identity, {}).values():
            if sock.state is SocketState.CONNECTING or sock.demux.probing:
                return True
        return False

    def _slots(self, sock: Socket) -> int:
        slots = self.limits.lanes_per_socket if self.named_lanes else 1
        return min(slots, self._max_slots.get(sock.id, slots))

    def _slot_lanes(self, sock: Socket) -> list[Lane]:
        """The lanes of ``sock`` in the slots it may use now (slot 0: the default lane)."""
        lanes = sock.lanes
        return [lanes[name] for name in map(lane_name, range(self._slots(sock))) if name in lanes]

    def _probe_first(self, sock: Socket) -> bool:
        """Whether ``sock``'s first response goes on a named lane, the probe of its lanes: it is
        not its identity's first socket (that one starts on the default lane), and named lanes
        are not off (refused). A fresh socket then learns at its first event, instead of
        carrying one response on its default lane before it can probe."""
        if not self.named_lanes or sock.lanes or sock.demux.proven:
            return False
        return any(s is not sock for s in self._by_identity.get(sock.identity, {}).values())

    def _free_slot(self, sock: Socket) -> Lane | None:
        """An idle lane of ``sock`` with no head (creating the next slot if allowed)."""
        slots = self._slots(sock)
        for lane in self._slot_lanes(sock):
            if lane.state is LaneState.IDLE and not (lane.head and self.heads.has(lane.key)):
                lane.head = False
                return lane
        if len(sock.lanes) < slots:
            first = 1 if self._probe_first(sock) else 0
            name = next(n for n in map(lane_name, range(first, slots)) if n not in sock.lanes)
            lane = Lane((sock.id, name), used_at=self._now)
            sock.lanes[name] = lane
            self.lane_counts[LaneState.IDLE] += 1
            return lane
        return None

    def _free_lane(
        self, identity: str, now: float, may_open: bool, close: list[int]
    ) -> tuple[Lane, bool, int | None] | None:
        """A lane for a new head: ``(lane, its socket is new, a spare socket to open meanwhile)``."""
        lim = self.limits
        socks = [
            s
            for s in self._by_identity.get(identity, {}).values()
            if s.live and not self._stale(s, now) and s.active < lim.max_active_per_socket and not s.exclusive
        ]
        # Open sockets first (no handshake to wait for), the least busy first.
        socks.sort(key=lambda s: (s.state is not SocketState.OPEN, s.active, -s.used_at))
        mine = self._by_identity.get(identity, {}).values()
        spread = len(mine) < lim.spread_sockets and not any(s.active == 0 for s in mine)
        if may_open and spread and self._can_open(identity, now, close):
            opened = [s for s in socks if s.state is SocketState.OPEN]
            lane = self._free_slot(opened[0]) if opened else None
            if lane is None:
                return self._open(identity, now), True, None
            # A free lane now, and the socket of its own opened in the background for the
            # next new conversation: nobody waits for a handshake.
            return lane, False, self._open(identity, now, reserve=False).key[0]
        for sock in socks:
            lane = self._free_slot(sock)
            if lane is not None:
                return lane, False, None
        self._slow_start = False
        if may_open and self._can_open(identity, now, close):
            return self._open(identity, now), True, None
        if self._growing(identity):
            return None  # a socket will open or prove its lanes in a moment: wait, evict no head
        victim: Lane | None = None
        for sock in socks:
            if sock.state is not SocketState.OPEN:
                continue
            for lane in self._slot_lanes(sock):
                if lane.state is LaneState.IDLE and (victim is None or lane.used_at < victim.used_at):
                    victim = lane
        if victim is None:
            return None
        self._let_go(victim)
        return victim, False, None

    def _can_open(self, identity: str, now: float, close: list[int]) -> bool:
        lim = self.limits
        if self.held_off(identity, now):
            return False
        mine = self._by_identity.get(identity, {})
        held = self._tenant_sockets()  # the quota is the tenant's: query strings split no credential
        own = None
        if held[tenant_of(identity)] >= lim.max_sockets_per_identity:
            own = self._own_idle(identity)  # at its quota a tenant gives up one of its own
            if own is None:
                return False
        connecting = sum(1 for s in mine.values() if s.state is SocketState.CONNECTING)
        if connecting >= max(_SLOW_START, len(mine) - connecting):
            self._slow_start = True  # a moment's wait, not a limit: no head is evicted for it
            return False  # slow start: at most as many handshakes at once as sockets open
        cap = self.caps.get(identity)
        if cap is not None:
            if cap.limit is not None and len(mine) >= cap.limit:
                if now < cap.probe_at or connecting:
                    return False  # above the learned cap: one probe at a time, now and then
                cap.probe_at = now + lim.cap_probe_seconds
        if own is not None:
            self._forget(own, SocketEvent.CLOSE)
            close.append(own.id)
            return True
        if len(self._sockets) + sum(self.outside.values()) < lim.max_sockets_total:
            return True
        idle = [s for s in self._sockets.values() if s.active == 0 and s.state is SocketState.OPEN]
        if not idle:
            return False

        # the least recently used idle socket of the tenant holding the most,
        # counting the one asked for (at equal shares the asker gives up one of its own).
        mine_tenant = tenant_of(identity)

        def share(s: Socket) -> tuple[int, float]:
            tenant = tenant_of(s.identity)
            return -(held[tenant] + (tenant == mine_tenant)), s.used_at

        oldest = min(idle, key=share)
        self._forget(oldest, SocketEvent.CLOSE)
        close.append(oldest.id)
        return True

    def _own_idle(self, identity: str) -> Socket | None:
        """The least recently used idle socket of another identity of ``identity``'s tenant."""
        tenant = tenant_of(identity)
        own = [
            s
            for s in self._sockets.values()
            if s.identity != identity
            and tenant_of(s.identity) == tenant
            and s.active == 0
            and s.state is SocketState.OPEN
        ]
        return min(own, key=lambda s: s.used_at) if own else None

    def _tenant_sockets(self) -> Counter[str]:
        """Upstream sockets by tenant (:func:`~proxy.core.fair.tenant_of`), relays included."""
        held: Counter[str] = Counter()
        for ident, socks in self._by_identity.items():
            held[tenant_of(ident)] += len(socks)
        for ident, n in self.outside.items():
            held[tenant_of(ident)] += n
        return held

    def _open(self, identity: str, now: float, *, reserve: bool = True) -> Lane:
        """A new CONNECTING socket; with ``reserve`` its default lane is the one returned, else the
        socket is a spare (the returned lane is only its key holder, not reserved)."""
        sock = Socket(next(self._ids), identity, created_at=now, used_at=now)
        self._sockets[sock.id] = sock
        self._by_identity.setdefault(identity, {})[sock.id] = sock
        self.socket_counts[SocketState.CONNECTING] += 1
        if not reserve:
            return Lane((sock.id, None), used_at=now)
        name = lane_name(1) if self._probe_first(sock) else None
        lane = Lane((sock.id, name), used_at=now)
        sock.lanes[name] = lane
        self.lane_counts[LaneState.IDLE] += 1
        return lane

    # -- transitions -------------------------------------------------------------------------

    def _lane(self, lane: Lane, event: LaneEvent) -> None:
        if self.on_step is not None:
            self.on_step("lane", lane.state, event)
        new = lane_step(lane.state, event)
        self.lane_counts[lane.state] -= 1
        if new is not LaneState.CLOSED:
            self.lane_counts[new] += 1
        lane.state = new

    def _socket(self, sock: Socket, event: SocketEvent) -> None:
        if self.on_step is not None:
            self.on_step("socket", sock.state, event)
        new = socket_step(sock.state, event)
        self.socket_counts[sock.state] -= 1
        if new is not SocketState.CLOSED:
            self.socket_counts[new] += 1
        sock.state = new

    def _begin(self, lane: Lane, now: float) -> None:
        sock = self._sockets[lane.key[0]]
        self._lane(lane, LaneEvent.BEGIN)
        if sock.active == 0 and sock.state is not SocketState.CONNECTING:
            self.busy_sockets += 1
        sock.active += 1
        lane.used_at = sock.used_at = now

    def _end(self, sock: Socket, lane: Lane, event: LaneEvent) -> None:
        self._lane(lane, event)
        if event is LaneEvent.FINISH:
            sock.active -= 1
            if sock.active == 0 and sock.state is not SocketState.CONNECTING:
                self.busy_sockets -= 1

    def _owned(self, head: Head | None) -> None:
        """``head`` was recorded, moved or renamed: its response id is its identity's."""
        if head is not None:
            self.owners.note(head.identity, head.response_id)

    def _let_go(self, lane: Lane) -> None:
        """Free ``lane`` of its head: a stored head stays continuable under a dead key."""
        head = self.heads.get(lane.key)
        if head is not None:
            if head.store:
                self._owned(self.heads.rekey(lane.key, (-next(self._detached), None)))
            else:
                self.heads.discard(lane.key)
        lane.head = False

    def _forget(self, sock: Socket, event: SocketEvent) -> None:
        """``sock`` is closed: its lanes close; stored heads outlive it, the others go."""
        if sock.active > 0 and sock.state is not SocketState.CONNECTING:
            self.busy_sockets -= 1
        self._socket(sock, event)
        for lane in sock.lanes.values():
            self._lane(lane, LaneEvent.CLOSE)
            head = self.heads.get(lane.key) if lane.head else None
            if head is not None and not head.store and lane.key not in self._reseeding:
                self.heads.discard(lane.key)
                self.kept.drop(head.response_id)
        del self._sockets[sock.id]
        self._max_slots.pop(sock.id, None)
        by_identity = self._by_identity[sock.identity]
        del by_identity[sock.id]
        if not by_identity:
            del self._by_identity[sock.identity]

    # -- follow-ups --------------------------------------------------------------------------

    def opened(self, socket_id: int, now: float) -> None:
        """The socket's handshake succeeded."""
        sock = self._sockets.get(socket_id)
        if sock is None or sock.state is not SocketState.CONNECTING:
            return
        self._socket(sock, SocketEvent.OPENED)
        sock.created_at = sock.used_at = now
        if sock.active > 0:
            self.busy_sockets += 1
        cap = self.caps.get(sock.identity)
        if cap is not None:
            cap.refusals = 0
            mine = len(self._by_identity.get(sock.identity, {}))
            if cap.limit is not None and mine > cap.limit:
                cap.limit = mine  # a probe above the cap got through: the limit was raised

    def open_failed(
        self,
        socket_id: int,
        now: float,
        *,
        status: int | None,
        headers: Mapping[str, str],
        payload: bytes = b"",
        jitter: float = 0.0,
    ) -> bool:
        """The handshake failed; the lanes reserved on it are gone (their requests plan again).

        Args:
            jitter: A random fraction in [0, 1) from the caller: the backoff of a cap refusal
                (when longer than its ``retry-after``) is stretched by up to a quarter of it, so
                workers do not retry in step.

        Returns:
            Whether it taught the identity's socket cap (a 429 or a connection-limit body).
        """
        sock = self._sockets.get(socket_id)
        if sock is None:
            return False
        if is_cap_refusal(status, payload):
            self._cap_refused(sock.identity, now, headers, jitter)
            self._forget(sock, SocketEvent.FAILED)
            return True
        hold = hold_off_seconds(status, headers)
        if hold > 0:
            self._hold_until[sock.identity] = max(self._hold_until.get(sock.identity, 0.0), now + hold)
        self._forget(sock, SocketEvent.FAILED)
        return False

    def _cap_refused(self, identity: str, now: float, headers: Mapping[str, str], jitter: float) -> None:
        """The upstream counts this identity's sockets and refused one more: the open ones are
        the cap (at least one), and no upgrade before ``retry-after`` or the backoff."""
        cap = self.caps.setdefault(identity, SocketCap())
        open_now = sum(1 for s in self._by_identity.get(identity, {}).values() if s.state is not SocketState.CONNECTING)
        cap.limit = max(1, open_now) if cap.limit is None else max(1, min(cap.limit, max(open_now, 1)))
        try:
            retry_after = max(0.0, float(headers.get("retry-after", "")))
        except ValueError:
            retry_after = 0.0
        backoff = min(_BACKOFF_BASE * 2.0**cap.refusals, _BACKOFF_MAX)
        cap.refusals += 1
        # The upstream's retry-after exactly; our own backoff stretched by the jitter.
        cap.until = max(cap.until, now + max(retry_after, backoff * (1.0 + 0.25 * jitter)))
        cap.probe_at = max(cap.probe_at, now + self.limits.cap_probe_seconds)

    def learned_cap(self, identity: str) -> int | None:
        """The socket cap learned for ``identity`` (``None``: none seen)."""
        cap = self.caps.get(identity)
        return cap.limit if cap is not None else None

    def merge_cap(self, identity: str, shared: SocketCap) -> None:
        """Another worker's knowledge of ``identity``'s cap: the stricter of the two holds."""
        cap = self.caps.setdefault(identity, SocketCap())
        if shared.limit is not None:
            cap.limit = shared.limit if cap.limit is None else min(cap.limit, shared.limit)
        cap.until = max(cap.until, shared.until)
        cap.probe_at = max(cap.probe_at, shared.probe_at)
        cap.refusals = max(cap.refusals, shared.refusals)

    def finished(
        self,
        key: LaneKey,
        now: float,
        *,
        req: ParsedRequest | None = None,
        response: dict[str, Any] | None = None,
        prefix_state: Any = None,
        retire: bool = False,
    ) -> list[int]:
        """The lane's response reached its terminal event; returns the sockets to close.

        Args:
            key: The lane.
            now: Monotonic time.
            req: With ``response``: the request whose ``response.completed`` becomes the head.
            response: The completed response (``None``: failed, incomplete or error: no head,
                and the lane's cached parent is evicted upstream).
            prefix_state: :func:`~proxy.core.fastparse.hash_prefix` of a large body.
            retire: The upstream said the socket aged out: no new turns on it.
        """
        sock = self._sockets.get(key[0])
        lane = sock.lanes.get(key[1]) if sock is not None else None
        if sock is None or lane is None:
            return []  # the socket closed meanwhile
        if lane.state in (LaneState.BUSY, LaneState.DRAINING):
            self._end(sock, lane, LaneEvent.FINISH)
            if response is not None:
                self.estimates.observe_busy(sock.identity, now - lane.used_at)  # since its _begin
        lane.used_at = now
        origin, lane.from_head = lane.from_head, None
        if response is not None and req is not None:
            replaced = self.heads.get(key)
            if replaced is not None:
                self.kept.drop(replaced.response_id)
            self._owned(self.heads.record(sock.identity, key, req, response, now, prefix_state))
            output, rid = response.get("output"), response.get("id")
            if self.limits.reseed and not req.store and req.previous_response_id is None:
                if isinstance(output, list) and isinstance(rid, str):
                    self.kept.keep(rid, req.body, output)
            lane.head = self.heads.has(key)
            if origin is not None and origin != key:
                self.heads.discard(origin)
        else:
            self.heads.discard(key)
            lane.head = False
        if retire and sock.state is SocketState.OPEN:
            self._socket(sock, SocketEvent.RETIRE)
        return self._close_if_drained(sock)

    def abandon(self, key: LaneKey) -> None:
        """The turn's reader left before the terminal event: the lane drains (its events are
        read and dropped until the terminal one, then :meth:`finished`)."""
        sock = self._sockets.get(key[0])
        lane = sock.lanes.get(key[1]) if sock is not None else None
        if lane is None or lane.state is not LaneState.BUSY:
            return
        self._lane(lane, LaneEvent.ABANDON)
        lane.from_head = None
        self.heads.discard(key)
        lane.head = False

    def retire(self, socket_id: int) -> list[int]:
        """No new turns on this socket (it reached a limit); closed once nothing is in flight."""
        sock = self._sockets.get(socket_id)
        if sock is None:
            return []
        if sock.state is SocketState.OPEN:
            self._socket(sock, SocketEvent.RETIRE)
        return self._close_if_drained(sock)

    def _close_if_drained(self, sock: Socket) -> list[int]:
        """A retiring socket closes once no lane is BUSY (draining lanes go with it)."""
        if sock.state is SocketState.RETIRING and not any(ln.state is LaneState.BUSY for ln in sock.lanes.values()):
            self._forget(sock, SocketEvent.DRAINED)
            return [sock.id]
        return []

    def socket_lost(self, socket_id: int) -> None:
        """The socket closed (upstream close, drop, ping timeout): every lane with it."""
        sock = self._sockets.get(socket_id)
        if sock is not None:
            event = SocketEvent.FAILED if sock.state is SocketState.CONNECTING else SocketEvent.LOST
            self._forget(sock, event)

    def lanes_refused(self, now: float) -> bool:
        """The upstream refused a named lane (``invalid_stream_id``, unknown parameter, or a close
        before any event on a socket that never routed a ``stream_id``): default lanes only, for
        :data:`LANES_RETRY_SECONDS`. Returns whether they were on until now (a fallback)."""
        self._now = max(self._now, now)
        if not self.named_lanes:
            return False  # already off: the window is not extended
        self._lanes_off_until = now + LANES_RETRY_SECONDS
        self._lanes_proven, self._early_closes = False, 0  # the next try starts from nothing
        return True

    def lanes_closed_early(self, now: float) -> bool:
        """A socket that never routed a ``stream_id`` closed right after a named lane's first
        create, before any event: how an upstream without lanes may refuse one, and also how
        any socket is lost (a reset, a restarted server). Before lanes are proven on this
        upstream it is a refusal (:meth:`lanes_refused`); after, only the
        :data:`EARLY_CLOSES_TO_REFUSE`-th in a row with no lane proven in between is. Returns
        whether named lanes were turned off."""
        if self._lanes_proven:
            self._early_closes += 1
            if self._early_closes < EARLY_CLOSES_TO_REFUSE:
                return False
        return self.lanes_refused(now)

    def adopt(self, identity: str, req: ParsedRequest, response: dict[str, Any], now: float) -> None:
        """A stored request answered over plain HTTP completed with ``response``: it becomes a
        head without a lane (continued on any lane, the upstream hydrating it, or over HTTP)."""
        if req.store and req.previous_response_id is None:
            self._owned(self.heads.record(identity, (-next(self._detached), None), req, response, now))

    def lanes_signal(self, signal: LaneSignal, now: float) -> bool:
        """What a socket's demux learned about ``stream_id`` (the fact itself stays in that
        socket's :class:`~proxy.core.demux.Demux`): a refusal, or lanes ignored, turns named
        lanes off for every socket (:meth:`lanes_refused`). Returns whether that was a fallback."""
        if signal is LaneSignal.PROVEN:
            self._lanes_proven, self._early_closes = True, 0
            return False
        return self.lanes_refused(now)

    def stream_limit(self, key: LaneKey) -> None:
        """``websocket_stream_limit_reached`` on ``key``: that socket takes no more lanes."""
        sock = self._sockets.get(key[0])
        if sock is not None:
            self._max_slots[sock.id] = max(len(sock.lanes) - 1, 1)

    def tick(self, now: float) -> Tick:
        """Housekeeping: close idle and aged sockets (re-seeding their kept ``store: false``
        heads), retire aged busy ones, expire heads."""
        self._now = now
        done = Tick([], [], [])
        for sock in list(self._sockets.values()):
            if sock.state is SocketState.CONNECTING:
                continue
            age = now - sock.created_at
            aged = age >= self.limits.rotate_after_seconds
            if sock.active == 0 and (aged or now - sock.used_at >= self.limits.idle_close_seconds):
                if aged:
                    done.ages.append(age)
                    done.reseed += self._to_reseed(sock)
                self._forget(sock, SocketEvent.CLOSE)
                done.close.append(sock.id)
            elif aged and sock.state is SocketState.OPEN:
                self._socket(sock, SocketEvent.RETIRE)
        self.heads.expire(now)
        return done

    def _to_reseed(self, sock: Socket) -> list[Reseed]:
        found = []
        for lane in sock.lanes.values():
            head = self.heads.get(lane.key) if lane.head else None
            kept = self.kept.get(head.response_id) if head is not None and not head.store else None
            if kept is not None:
                self._reseeding.add(lane.key)
                found.append(Reseed(sock.identity, lane.key, kept))
        return found

    def reseed_lane(self, identity: str, now: float) -> Plan | None:
        """A lane for a re-seed (reserved), or ``None``: then the head is let go."""
        self._now = now
        plan = self._full(identity, now, None, may_open=True)
        return plan if plan.lane is not None else None

    def reseeded(self, old: LaneKey, key: LaneKey | None, now: float, response_id: str | None) -> list[int]:
        """A re-seed ended: on ``response_id`` the head moves to lane ``key`` under that id, else
        it is let go. ``key`` is the re-seed's lane (freed here); returns sockets to close."""
        self._reseeding.discard(old)
        close = self.finished(key, now) if key is not None else []
        lane = self.lane(key) if key is not None else None
        head = self.heads.get(old)
        if head is None or lane is None or response_id is None or self.heads.has(lane.key):
            if head is not None:
                self.kept.drop(head.response_id)
            self.heads.discard(old)
            return close
        self.kept.move(head.response_id, response_id)
        self._owned(self.heads.rekey(old, lane.key))
        self._owned(self.heads.rename(lane.key, response_id))
        lane.head = True
        return close

    def close_all(self) -> list[int]:
        """Forget every socket (shutdown); returns them all to close."""
        ids = list(self._sockets)
        for sock in list(self._sockets.values()):
            self._forget(sock, SocketEvent.CLOSE)
        return ids
