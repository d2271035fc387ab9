"""The planner: one synchronous owner of "this socket and lane hold this conversation head".

Given an identity, a parsed request and ``now``, :meth:`Planner.plan` returns a
:data:`~proxy.core.plans.Plan` (continue on a lane, the full input on a lane, wait, or HTTP):
the one place plans are built. Nothing here does I/O or reads a clock: the pool
(``proxy/upstream/pool.py``) executes the plans. Each job is a module of its own, composed here:

- :mod:`proxy.core.sockets`: the sockets and lanes (``SocketBook``) and the heads they hold
  (``Custody``: recorded, let go, kept past a closed socket, adopted from HTTP);
- :mod:`proxy.core.lanes`: whether the upstream takes named lanes (``LaneProof``);
- :mod:`proxy.core.socketcaps`: what refused upgrades taught (caps, backoff, hold-offs);
- :mod:`proxy.core.placement`: the lane a new head goes on, and when a socket may open;
- :mod:`proxy.core.patience`: whether a turn waits for a lane (the waiting rule applied);
- :mod:`proxy.core.rotation`: idle close, rotation, re-seeding.

The follow-ups that involve several of them are here (:meth:`Planner.finished`,
:meth:`Planner.opened`, :meth:`Planner.open_failed`, :meth:`Planner.tick`, the re-seeds); one
that involves one part is that part's (``planner.custody.abandon``, ``planner.proof.signal``).

A stored head whose lane cannot be had now is continued on another lane (the upstream hydrates
it, protocol.md §6), or waits briefly and then goes over HTTP (``HttpContinue``); a ``store:
false`` head waits for its own lane while that pays, else goes in full now.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping
from typing import Any

from proxy.core.conversation import HeadTable
from proxy.core.creators import OwnerRegistry
from proxy.core.heads import Lookup
from proxy.core.lanes import LaneKey, LaneLimits, LaneProof, LaneState, Socket, SocketEvent
from proxy.core.patience import Patience
from proxy.core.placement import Placement
from proxy.core.plans import Continue, Full, Http, HttpContinue, Plan, Wait
from proxy.core.request import ParsedRequest
from proxy.core.reseed import Tick
from proxy.core.rotation import rotate
from proxy.core.socketcaps import Caps, SocketCap
from proxy.core.sockets import Custody, SocketBook, lane_key
from proxy.core.waiting import Send, Waiting, WaitRule
from proxy.reasons import Hit, MissReason, PassthroughReason, WaitOutcome

__all__ = ["Planner"]


class Planner:
    """Sockets, lanes and heads of every identity.

    Args:
        limits: The pool limits.
        heads: The head table; the planner is the only one that records or drops heads.
        owners: Who created each response id (every head's id is noted; default: a registry
            sized for ``heads``).
    """

    def __init__(self, limits: LaneLimits, heads: HeadTable, owners: OwnerRegistry | None = None) -> None:
        self.limits = limits
        self.heads = heads
        self.owners = owners if owners is not None else OwnerRegistry.for_heads(heads.max_heads)
        self.proof = LaneProof(limits.lanes_per_socket)
        self.book = SocketBook(limits, self.proof)
        """The sockets and lanes (``book.on_step``: the tests' seam on every state step)."""
        self.upgrades = Caps(limits.cap_probe_seconds)
        self.caps: dict[str, SocketCap] = self.upgrades.caps
        """Learned socket caps by identity."""
        self.custody = Custody(limits, heads, self.owners, self.book)
        self.outside: Counter[str] = Counter()
        """Upstream sockets an identity holds outside the pool (WebSocket relay sessions): they
        count against ``max_sockets_per_identity`` and ``max_sockets_total`` too."""
        self.placement = Placement(self.custody, self.upgrades, self.outside)
        self.patience = Patience(limits, self.book)
        self.estimates = self.patience.estimates
        """Measured lane busy times and upstream times, per identity (the waiting rule's inputs)."""

    def __repr__(self) -> str:
        c = self.book.lane_counts
        return (
            f"<Planner [Sockets: {len(self.book.all)} ({self.book.busy_sockets} busy) | "
            f"Lanes: {c[LaneState.BUSY]} busy, {c[LaneState.IDLE]} idle, {c[LaneState.DRAINING]} draining]>"
        )

    # -- queries ---------------------------------------------------------------------------

    @property
    def named_lanes(self) -> bool:
        """Whether named lanes are used: off for a while after the upstream refused a ``stream_id``."""
        return self.proof.named

    def socket(self, socket_id: int) -> Socket | None:
        """The live record of a socket, if it is not closed."""
        return self.book.all.get(socket_id)

    def sockets(self, identity: str | None = None) -> list[Socket]:
        """Live socket records (of ``identity``, or all)."""
        return list((self.book.all if identity is None else self.book.of(identity)).values())

    def held_off(self, identity: str, now: float) -> bool:
        """Whether new sockets of ``identity`` are held off after a refused upgrade."""
        return self.upgrades.held_off(identity, now)

    def learned_cap(self, identity: str) -> int | None:
        """The socket cap learned for ``identity`` (``None``: none seen)."""
        return self.upgrades.learned(identity)

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
                lane cannot be had now waits only while that is worth it
                (:class:`~proxy.core.patience.Patience`) and the plan says until when
                (:attr:`Waiting.deadline`); without it, a :class:`Wait` only says that no lane
                can be had now.
        """
        plan = self._situation(identity, req, now, replay, may_open, waiting)
        if waiting is not None:
            if not isinstance(plan, Wait):
                if waiting.deadline is not None:  # only a turn that waited is queued or a sample
                    self.patience.ended(waiting, now, isinstance(plan, (Continue, Full)))
            elif waiting.rule is WaitRule.BUSY:
                self.patience.queue(identity, waiting)
        if isinstance(plan, HttpContinue) and not self.limits.http_continuations:
            return Http(PassthroughReason.UPGRADE_REFUSED, plan.close)
        return plan

    def _situation(
        self, identity: str, req: ParsedRequest, now: float, replay: bool, may_open: bool, waiting: Waiting | None
    ) -> Plan:
        book = self.book
        self.proof.now = now
        if req.previous_response_id is not None:
            anchor = self.heads.anchor_for(identity, req.previous_response_id)
            lane = book.idle_lane(lane_key(anchor)) if anchor is not None else None
            if lane is not None and not book.all[lane.key[0]].exclusive:
                book.begin(lane, now)
                return Full(MissReason.APP_CHAINED, lane.key)
            return self._new_head(
                identity, req, now, self._full(identity, now, MissReason.APP_CHAINED, may_open), waiting
            )
        if replay:
            return self._new_head(identity, req, now, self._full(identity, now, None, may_open), waiting)
        self.heads.expire(now)
        lookup = self.heads.lookup(identity, req, now)
        busy: set[Hashable] = set()
        while lookup.match is not None and not book.usable(self.heads.head(lookup.match.anchor)):
            busy.add(lookup.match.anchor)  # its lane is busy: the next best match may serve
            lookup = self.heads.lookup(identity, req, now, busy)
        match = lookup.match
        if match is None:
            plan = self._full(identity, now, lookup.reason, may_open, lookup)
            return self._new_head(identity, req, now, plan, waiting)
        self.heads.touch(match.anchor, now)
        lane = book.idle_lane(lane_key(match.anchor))
        if lane is not None and not book.all[lane.key[0]].exclusive:  # the usual case
            book.begin(lane, now)
            return Continue(
                lane.key,
                match.response_id,
                match.new_items,
                match.items_avoided,
                lookup.dropped_reasoning,
                lookup.dropped_phase,
            )
        return self._elsewhere(identity, req, now, may_open, waiting, lookup)

    def _elsewhere(
        self, identity: str, req: ParsedRequest, now: float, may_open: bool, waiting: Waiting | None, lookup: Lookup
    ) -> Plan:
        """A matched head whose own lane cannot take its turn now: its lane is idle on a socket
        that may carry no second response, or busy, or gone."""
        match = lookup.match
        assert match is not None
        key, size, wait = lane_key(match.anchor), len(req.body), self.patience
        lane = self.book.idle_lane(key)
        head = self.heads.get(key)
        if lane is not None and (head is None or not head.store):
            # Its own lane is free but its socket carries another response and may not
            # multiplex: a store: false head waits for it while that is expected to pay off
            # (elsewhere it is a full send), then goes in full now.
            if waiting is None:
                return Wait(MissReason.NO_HEAD)
            expected = wait.remaining(identity, now - self.book.all[key[0]].used_at)
            if wait.wait(waiting, now, expected, wait.estimates.saving(identity, Send.FULL, size)):
                return Wait(MissReason.NO_HEAD)
            return self._go_now(identity, now, may_open, key)
        http = HttpContinue(match.response_id, match.new_items, match.items_avoided)
        if lane is not None and self.book.all[key[0]].demux.probing:
            # Its socket is probing its lanes (a named lane's first event is on its way): the
            # proof is a moment away, not a response's end, and its own lane keeps the cache.
            # A short wait, as for lanes a moment away, then HTTP.
            if waiting is None or wait.brief(waiting, now):
                return Wait(Hit.CONTINUATION)
            return http
        plan = self._full(identity, now, MissReason.NO_HEAD, may_open)
        if isinstance(plan, Http):
            return HttpContinue(match.response_id, match.new_items, match.items_avoided, plan.close)
        if isinstance(plan, Wait):
            if waiting is None or (
                wait.brief(waiting, now)
                if plan.growing  # lanes a moment away: a short wait, then HTTP
                else wait.wait(waiting, now, wait.soonest(identity, now, waiting), wait.stored_saving(identity, size))
            ):
                return Wait(Hit.CONTINUATION, plan.close, growing=plan.growing)
            return HttpContinue(match.response_id, match.new_items, match.items_avoided, plan.close)
        taken = self.book.lane(plan.lane)
        assert taken is not None
        taken.from_head = key
        return Continue(
            plan.lane,
            match.response_id,
            match.new_items,
            match.items_avoided,
            lookup.dropped_reasoning,
            lookup.dropped_phase,
            hydrated=True,
            open_socket=plan.open_socket,
            close=plan.close,
            warm=plan.warm,
        )

    def _new_head(
        self, identity: str, req: ParsedRequest, now: float, plan: Full | Wait | Http, waiting: Waiting | None
    ) -> Plan:
        """A request that needs a new head (new conversation, app-chained, replay) and found
        no lane now: it waits for lanes a moment away while that pays (its next turn continued
        in memory; bounded until measured: :meth:`Patience.grow`), for busy ones only while
        what a lane saves (the full send over a socket against plain HTTP) exceeds the expected
        wait; else plain HTTP now."""
        if not isinstance(plan, Wait) or waiting is None:
            return plan
        if plan.growing:
            # Lanes a moment away (a handshake, a probe): the new head waits for them, as its
            # next turns continue from the lane's memory (a head adopted from plain HTTP would
            # make its next turn a hydration, the upstream re-reading its store).
            if self.patience.grow(waiting, now, identity, len(req.body), req.store):
                return plan
            expired = waiting.outcome is WaitOutcome.WAIT_EXPIRED
            return Http(PassthroughReason.POOL_FULL if expired else PassthroughReason.WAIT_NOT_WORTH_IT, plan.close)
        # What the send itself gains on a lane; not what its later turns might, which a head
        # kept by a scarce lane seldom gets (the next new conversation evicts it).
        saving = self.estimates.saving(identity, Send.HTTP_FULL, len(req.body), on_lane=Send.FULL)
        if self.patience.wait(waiting, now, self.patience.soonest(identity, now, waiting), saving):
            return plan
        return Http(PassthroughReason.WAIT_NOT_WORTH_IT, plan.close)

    def _go_now(self, identity: str, now: float, may_open: bool, head: LaneKey) -> Plan:
        """A ``store: false`` head (on lane ``head``) that does not wait (on) for its busy
        lane: its full input on a free lane now (whose answer replaces the head: one head per
        conversation), else over plain HTTP."""
        plan = self._full(identity, now, MissReason.WAIT_NOT_WORTH_IT, may_open)
        if isinstance(plan, Wait):
            return Http(PassthroughReason.WAIT_NOT_WORTH_IT, plan.close)
        if isinstance(plan, Full):
            taken = self.book.lane(plan.lane)
            assert taken is not None
            taken.from_head = head
        return plan

    def _full(
        self, identity: str, now: float, reason: Hit | MissReason | None, may_open: bool, lookup: Lookup | None = None
    ) -> Full | Wait | Http:
        """The whole input on a new head's lane (:mod:`proxy.core.placement`), reserved here;
        else HTTP when the identity has no socket and may open none, else a wait."""
        close: list[int] = []
        found = self.placement.free_lane(identity, now, may_open, close)
        if found is not None:
            lane, opened, spare = found
            self.book.begin(lane, now)
            dropped = (lookup.dropped_reasoning, lookup.dropped_phase) if lookup is not None else (0, 0)
            return Full(reason, lane.key, *dropped, open_socket=opened, close=tuple(close), warm=spare)
        live = any(s.live for s in self.book.of(identity).values())
        if not live and self.upgrades.held_off(identity, now):
            return Http(PassthroughReason.UPGRADE_REFUSED, tuple(close))
        if not live and not may_open:
            return Http(PassthroughReason.WS_UNAVAILABLE, tuple(close))
        return Wait(reason, tuple(close), growing=self.placement.growing(identity))

    # -- follow-ups --------------------------------------------------------------------------

    def opened(self, socket_id: int, now: float) -> None:
        """The socket's handshake succeeded."""
        sock = self.book.opened(socket_id, now)
        if sock is not None:
            self.upgrades.opened(sock.identity, len(self.book.of(sock.identity)))

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
            jitter: A random fraction in [0, 1) from the caller (a cap refusal's backoff is
                stretched by up to a quarter of it, so workers do not retry in step).

        Returns:
            Whether it taught the identity's socket cap (a 429 or a connection-limit body).
        """
        sock = self.book.all.get(socket_id)
        if sock is None:
            return False
        capped = self.upgrades.refused(sock.identity, now, status, headers, payload)
        if capped:  # the sockets open now are the cap
            self.upgrades.capped(sock.identity, self.book.open_count(sock.identity), now, headers, jitter)
        self.custody.close(sock, SocketEvent.FAILED)
        return capped

    def finished(
        self,
        key: LaneKey,
        now: float,
        *,
        req: ParsedRequest | None = None,
        response: dict[str, Any] | None = None,
        prefix_state: Any = None,
        retire: bool = False,
        measured: Send | None = None,
        upstream_seconds: float = 0.0,
    ) -> list[int]:
        """The lane's response reached its terminal event; returns the sockets to close.

        Args:
            key: The lane.
            now: Monotonic time.
            req: With ``response``: the request whose ``response.completed`` becomes the head.
            response: The completed response (``None``: no head; the upstream evicted the
                lane's cached parent).
            prefix_state: :func:`~proxy.core.fastparse.hash_prefix` of a large body.
            retire: The upstream said the socket aged out: no new turns on it.
            measured: With ``response``: what the upstream's ``upstream_seconds`` for it are a
                sample of (:meth:`Estimates.observe_upstream`; ``None``: no sample).
        """
        sock = self.book.all.get(key[0])
        lane = sock.lanes.get(key[1]) if sock is not None else None
        if sock is None or lane is None:
            return []  # the socket closed meanwhile
        busy = lane.state in (LaneState.BUSY, LaneState.DRAINING)
        sample = measured if response is not None and req is not None else None
        took = now - lane.used_at if busy and response is not None else None  # since its begin
        if sample is not None or took is not None:
            size = len(req.body) if req is not None else 0
            self.estimates.observe_turn(sock.identity, took, sample, size, upstream_seconds)
        if busy:
            self.book.end(sock, lane)
        lane.used_at = now
        self.custody.finished(sock.identity, lane, now, req, response, prefix_state)
        if retire:
            self.book.retire(sock)
        return self.custody.close_if_drained(sock)

    def tick(self, now: float) -> Tick:
        """Housekeeping (:func:`~proxy.core.rotation.rotate`): idle close, rotation, re-seeds."""
        self.proof.now = now
        return rotate(self.custody, now)

    def reseed_lane(self, identity: str, now: float) -> Full | None:
        """A lane for a re-seed (reserved), or ``None``: then the head is let go."""
        self.proof.now = now
        plan = self._full(identity, now, None, may_open=True)
        return plan if isinstance(plan, Full) else None

    def reseeded(self, old: LaneKey, key: LaneKey | None, now: float, response_id: str | None) -> list[int]:
        """A re-seed ended: on ``response_id`` the head moves to lane ``key`` under that id, else
        it is let go. ``key`` is the re-seed's lane (freed here); returns sockets to close."""
        self.custody.reseeding.discard(old)
        close = self.finished(key, now) if key is not None else []
        self.custody.reseeded(old, self.book.lane(key) if key is not None else None, response_id)
        return close
