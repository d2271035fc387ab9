"""The socket book and head custody: every upstream socket and lane, and the heads they hold.

:class:`SocketBook` keeps the :class:`~proxy.core.lanes.Socket` and
:class:`~proxy.core.lanes.Lane` records by id and by identity, takes every state step through
:func:`~proxy.core.lanes.lane_step` / :func:`~proxy.core.lanes.socket_step` (and keeps the
counts the gauges read), opens and forgets sockets, and answers what a continuation asks on
every turn: is the head's lane idle (:meth:`SocketBook.idle_lane`), can the head be continued
at all (:meth:`SocketBook.usable`). A socket whose lanes are not proven (``Socket.demux``)
carries one response at a time (:attr:`~proxy.core.lanes.Socket.exclusive`); its first named
lane is the probe that proves or refuses them (:meth:`SocketBook.probe_first`).

:class:`Custody` is the only one that records, moves, detaches or drops heads in the head table
(:class:`~proxy.core.conversation.HeadTable`, which stores each under the key of the lane whose
upstream cache holds it), and it keeps :attr:`~proxy.core.lanes.Lane.head` and the owner
registry (who created each response id) in step with the table:

- a turn's completed response becomes its lane's head (:meth:`Custody.finished`); a failed one
  drops the lane's head (the upstream evicts the cached parent);
- a head let go to free its lane (eviction) stays continuable under a dead key when its
  response was stored (the upstream hydrates it), else it is forgotten (:meth:`Custody.let_go`);
- a closed socket's stored heads outlive it, the others go (:meth:`Custody.close`), except
  those being re-seeded (:mod:`proxy.core.rotation`), which move to their new lane
  (:meth:`Custody.reseeded`);
- a stored request answered over plain HTTP becomes a head without a lane (:meth:`Custody.adopt`).

The two share a module because every turn goes through both (its lane reserved and its head
looked up, then its lane freed and its head recorded): one module is one hop on a turn's path.
Where a new head goes is :mod:`proxy.core.placement`'s business. Nothing here reads a clock.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

from proxy.core.conversation import HeadTable
from proxy.core.creators import OwnerRegistry
from proxy.core.heads import Head
from proxy.core.lanes import (
    Lane,
    LaneEvent,
    LaneKey,
    LaneLimits,
    LaneProof,
    LaneState,
    Socket,
    SocketEvent,
    SocketState,
    lane_name,
    lane_step,
    socket_step,
)
from proxy.core.request import ParsedRequest
from proxy.core.reseed import KeptContexts

__all__ = ["Custody", "SocketBook", "lane_key"]


def lane_key(anchor: Hashable) -> LaneKey:
    """A head's anchor as the lane key the planner gave it."""
    assert isinstance(anchor, tuple), f"not a lane key: {anchor!r}"
    return anchor


class SocketBook:
    """Sockets and lanes of every identity.

    Args:
        limits: The pool limits.
        proof: Whether named lanes are on (and the latest ``now`` the planner saw).
    """

    def __init__(self, limits: LaneLimits, proof: LaneProof) -> None:
        self.limits = limits
        self.proof = proof
        self.all: dict[int, Socket] = {}
        self.by_identity: dict[str, dict[int, Socket]] = {}
        self._ids = itertools.count(1)
        self._max_slots: dict[int, int] = {}
        self._names: tuple[str | None, ...] = tuple(map(lane_name, range(max(limits.lanes_per_socket, 1))))
        """The lane names of the slots a socket may have, in slot order (built once: every
        placement reads them)."""
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

    # -- queries -------------------------------------------------------------------------------

    def lane(self, key: LaneKey) -> Lane | None:
        """The record of a lane, if its socket is not closed."""
        sock = self.all.get(key[0])
        return sock.lanes.get(key[1]) if sock is not None else None

    def of(self, identity: str) -> dict[int, Socket]:
        """``identity``'s live sockets by id (a view: do not change it)."""
        return self.by_identity.get(identity, {})

    def stale(self, sock: Socket, now: float) -> bool:
        """Whether ``sock`` is due for rotation or idle close: it takes no new turn."""
        lim = self.limits
        if now - sock.created_at >= lim.rotate_after_seconds:
            return True
        return sock.active == 0 and now - sock.used_at >= lim.idle_close_seconds

    def idle_lane(self, key: LaneKey) -> Lane | None:
        """The lane ``key`` if its head's next turn can start on it now (idle, socket open and
        fresh). The socket's active limit does not apply: beyond it the upstream queues the
        response until one of the socket's others ends, which costs far less than the full send
        elsewhere (the whole history rebuilt upstream, maybe a new socket) that refusing would take."""
        sock = self.all.get(key[0])
        if sock is None or sock.state is not SocketState.OPEN or self.stale(sock, self.proof.now):
            return None
        lane = sock.lanes.get(key[1])
        if lane is None or lane.state is not LaneState.IDLE:
            return None
        return lane

    def usable(self, head: Head) -> bool:
        """Whether ``head`` can be continued now: its lane is idle, or its lane is gone and the
        response was stored (the upstream hydrates it on any lane)."""
        key = lane_key(head.anchor)
        if self.idle_lane(key) is not None:
            return True
        lane = self.lane(key)
        if lane is not None and lane.state is not LaneState.IDLE:
            return False  # its lane is busy: the cached state is moving on (a parallel branch)
        return head.store

    def open_count(self, identity: str) -> int:
        """``identity``'s sockets past their handshake."""
        return sum(1 for s in self.of(identity).values() if s.state is not SocketState.CONNECTING)

    def growing(self, identity: str) -> bool:
        """Whether one of ``identity``'s sockets is in its handshake or probing its lanes."""
        for sock in self.of(identity).values():
            if sock.state is SocketState.CONNECTING or sock.demux.probing:
                return True
        return False

    # -- lanes of a socket ---------------------------------------------------------------------

    def slots(self, sock: Socket) -> int:
        """How many lanes ``sock`` may use now (1 while named lanes are off)."""
        slots = self.limits.lanes_per_socket if self.proof.named else 1
        cap = self._max_slots.get(sock.id)
        return slots if cap is None or cap >= slots else cap

    def slot_lanes(self, sock: Socket) -> list[Lane]:
        """The lanes of ``sock`` in the slots it may use now (slot 0: the default lane)."""
        lanes = sock.lanes
        slots = self.slots(sock)
        if slots == 1:  # named lanes off: the default lane only
            lane = lanes.get(None)
            return [lane] if lane is not None else []
        return [lanes[name] for name in self._names[:slots] if name in lanes]

    def probe_first(self, sock: Socket) -> bool:
        """Whether ``sock``'s first response goes on a named lane, the probe of its lanes: it is
        not its identity's first socket (that one starts on the default lane), and named lanes
        are not off (refused). A fresh socket then learns at its first event, instead of
        carrying one response on its default lane before it can probe."""
        if not self.proof.named or sock.lanes or sock.demux.proven:
            return False
        return any(s is not sock for s in self.of(sock.identity).values())

    def room(self, sock: Socket) -> bool:
        """Whether ``sock`` has a slot it may use with no lane made yet: fewer lanes than slots,
        or, while named lanes are off, no default lane (a socket that opened on its named probe
        lane before they were refused makes its default lane then, instead of standing idle)."""
        return len(sock.lanes) < self.slots(sock) or (not self.proof.named and None not in sock.lanes)

    def new_lane(self, sock: Socket) -> Lane | None:
        """The next lane slot of ``sock``, created idle (``None``: every slot it may use is made)."""
        if not self.room(sock):
            return None
        slots = self.slots(sock)
        first = 1 if self.probe_first(sock) else 0
        name = next(n for n in self._names[first:slots] if n not in sock.lanes)
        lane = Lane((sock.id, name), used_at=self.proof.now)
        sock.lanes[name] = lane
        self.lane_counts[LaneState.IDLE] += 1
        return lane

    def stream_limit(self, key: LaneKey) -> None:
        """``websocket_stream_limit_reached`` on ``key``: that socket takes no more lanes."""
        sock = self.all.get(key[0])
        if sock is not None:
            self._max_slots[sock.id] = max(len(sock.lanes) - 1, 1)

    # -- steps ---------------------------------------------------------------------------------

    def step_lane(self, lane: Lane, event: LaneEvent) -> None:
        """Take ``event`` on ``lane`` (:func:`~proxy.core.lanes.lane_step`), counts kept."""
        if self.on_step is not None:
            self.on_step("lane", lane.state, event)
        new = lane_step(lane.state, event)
        self.lane_counts[lane.state] -= 1
        if new is not LaneState.CLOSED:
            self.lane_counts[new] += 1
        lane.state = new

    def step_socket(self, sock: Socket, event: SocketEvent) -> None:
        """Take ``event`` on ``sock`` (:func:`~proxy.core.lanes.socket_step`), counts kept."""
        if self.on_step is not None:
            self.on_step("socket", sock.state, event)
        new = socket_step(sock.state, event)
        self.socket_counts[sock.state] -= 1
        if new is not SocketState.CLOSED:
            self.socket_counts[new] += 1
        sock.state = new

    def begin(self, lane: Lane, now: float) -> None:
        """A turn starts on ``lane`` (reserved: BUSY)."""
        sock = self.all[lane.key[0]]
        self.step_lane(lane, LaneEvent.BEGIN)
        if sock.active == 0 and sock.state is not SocketState.CONNECTING:
            self.busy_sockets += 1
        sock.active += 1
        lane.used_at = sock.used_at = now

    def end(self, sock: Socket, lane: Lane) -> None:
        """The turn on ``lane`` reached its terminal event (it was BUSY or DRAINING)."""
        self.step_lane(lane, LaneEvent.FINISH)
        sock.active -= 1
        if sock.active == 0 and sock.state is not SocketState.CONNECTING:
            self.busy_sockets -= 1

    def open(self, identity: str, now: float, *, reserve: bool = True) -> Lane:
        """A new CONNECTING socket; with ``reserve`` its first lane is the one returned, else the
        socket is a spare (the returned lane is only its key holder, not reserved)."""
        sock = Socket(next(self._ids), identity, created_at=now, used_at=now)
        self.all[sock.id] = sock
        self.by_identity.setdefault(identity, {})[sock.id] = sock
        self.socket_counts[SocketState.CONNECTING] += 1
        if not reserve:
            return Lane((sock.id, None), used_at=now)
        name = lane_name(1) if self.probe_first(sock) else None
        lane = Lane((sock.id, name), used_at=now)
        sock.lanes[name] = lane
        self.lane_counts[LaneState.IDLE] += 1
        return lane

    def opened(self, socket_id: int, now: float) -> Socket | None:
        """The socket's handshake succeeded; returns it (``None``: not a socket in its handshake)."""
        sock = self.all.get(socket_id)
        if sock is None or sock.state is not SocketState.CONNECTING:
            return None
        self.step_socket(sock, SocketEvent.OPENED)
        sock.created_at = sock.used_at = now
        if sock.active > 0:
            self.busy_sockets += 1
        return sock

    def retire(self, sock: Socket) -> None:
        """No new turns on ``sock``; it closes once drained (:meth:`drained`)."""
        if sock.state is SocketState.OPEN:
            self.step_socket(sock, SocketEvent.RETIRE)

    @staticmethod
    def drained(sock: Socket) -> bool:
        """Whether ``sock`` is retiring and no lane of it is BUSY (draining lanes go with it)."""
        return sock.state is SocketState.RETIRING and not any(ln.state is LaneState.BUSY for ln in sock.lanes.values())

    def forget(self, sock: Socket, event: SocketEvent) -> None:
        """``sock`` is closed by ``event``: it and its lanes leave the book (the lanes' records
        stay on ``sock`` for the caller to read)."""
        if sock.active > 0 and sock.state is not SocketState.CONNECTING:
            self.busy_sockets -= 1
        self.step_socket(sock, event)
        for lane in sock.lanes.values():
            self.step_lane(lane, LaneEvent.CLOSE)
        del self.all[sock.id]
        self._max_slots.pop(sock.id, None)
        by_identity = self.by_identity[sock.identity]
        del by_identity[sock.id]
        if not by_identity:
            del self.by_identity[sock.identity]


class Custody:
    """Heads and the lanes that hold them.

    Args:
        limits: The pool limits (``reseed``, ``reseed_bytes``).
        heads: The head table.
        owners: The owner registry every recorded, moved or renamed head's id is noted in.
        book: The sockets and lanes.
    """

    def __init__(self, limits: LaneLimits, heads: HeadTable, owners: OwnerRegistry, book: SocketBook) -> None:
        self.heads = heads
        self.owners = owners
        self.book = book
        self.reseed = limits.reseed
        self.kept = KeptContexts(limits.reseed_bytes)
        """Contexts of ``store: false`` heads, for re-seeding (empty unless ``reseed``)."""
        self.reseeding: set[LaneKey] = set()
        """Lanes whose head is being re-seeded (kept when their socket closes)."""
        self._detached = itertools.count(1)

    def _owned(self, head: Head | None) -> None:
        """``head`` was recorded, moved or renamed: its response id is its identity's."""
        if head is not None:
            self.owners.note(head.identity, head.response_id)

    def holds(self, lane: Lane) -> bool:
        """Whether ``lane`` holds a head (clearing a stale mark)."""
        if lane.head and self.heads.has(lane.key):
            return True
        lane.head = False
        return False

    def let_go(self, lane: Lane) -> None:
        """Free ``lane`` of its head: a stored head stays continuable under a dead key."""
        head = self.heads.get(lane.key)
        if head is not None:
            if head.store:
                self._owned(self.heads.rekey(lane.key, (-next(self._detached), None)))
            else:
                self.heads.discard(lane.key)
        lane.head = False

    def close(self, sock: Socket, event: SocketEvent) -> None:
        """``sock`` is closed by ``event``: its lanes close; stored heads outlive it, the others
        go (unless being re-seeded)."""
        self.book.forget(sock, event)
        for lane in sock.lanes.values():
            head = self.heads.get(lane.key) if lane.head else None
            if head is not None and not head.store and lane.key not in self.reseeding:
                self.heads.discard(lane.key)
                self.kept.drop(head.response_id)

    def finished(
        self,
        identity: str,
        lane: Lane,
        now: float,
        req: ParsedRequest | None,
        response: dict[str, Any] | None,
        prefix_state: Any,
    ) -> None:
        """The turn on ``lane`` ended: a completed ``response`` to ``req`` becomes the lane's
        head (replacing the head it continued from another lane, if any); anything else drops
        the lane's head."""
        key = lane.key
        origin, lane.from_head = lane.from_head, None
        if response is None or req is None:
            self.heads.discard(key)
            lane.head = False
            return
        replaced = self.heads.get(key) if self.reseed else None  # kept only with re-seeding on
        if replaced is not None:
            self.kept.drop(replaced.response_id)
        self._owned(self.heads.record(identity, key, req, response, now, prefix_state))
        if self.reseed and not req.store and req.previous_response_id is None:
            output, rid = response.get("output"), response.get("id")
            if isinstance(output, list) and isinstance(rid, str):
                self.kept.keep(rid, req.body, output)
        lane.head = self.heads.has(key)
        if origin is not None and origin != key:
            self.heads.discard(origin)

    def abandon(self, key: LaneKey) -> None:
        """The turn's reader left before the terminal event: the lane drains (its events are
        read and dropped until the terminal one, then ``Planner.finished``); no head comes of it."""
        lane = self.book.lane(key)
        if lane is not None and lane.state is LaneState.BUSY:
            self.book.step_lane(lane, LaneEvent.ABANDON)
            lane.from_head = None
            self.heads.discard(key)
            lane.head = False

    def retire(self, socket_id: int) -> list[int]:
        """No new turns on this socket (it reached a limit); closed once nothing is in flight.
        Returns the sockets to close."""
        sock = self.book.all.get(socket_id)
        if sock is None:
            return []
        self.book.retire(sock)
        return self.close_if_drained(sock)

    def close_if_drained(self, sock: Socket) -> list[int]:
        """Close ``sock`` if it is retiring and drained; returns the sockets to close."""
        if self.book.drained(sock):
            self.close(sock, SocketEvent.DRAINED)
            return [sock.id]
        return []

    def lost(self, socket_id: int) -> None:
        """The socket closed (upstream close, drop, ping timeout): every lane with it."""
        sock = self.book.all.get(socket_id)
        if sock is not None:
            self.close(sock, SocketEvent.FAILED if sock.state is SocketState.CONNECTING else SocketEvent.LOST)

    def close_all(self) -> list[int]:
        """Forget every socket (shutdown); returns them all to close."""
        ids = list(self.book.all)
        for sock in list(self.book.all.values()):
            self.close(sock, SocketEvent.CLOSE)
        return ids

    def adopt(self, identity: str, req: ParsedRequest, response: dict[str, Any], now: float) -> None:
        """A stored request answered over plain HTTP completed with ``response``: it becomes a
        head without a lane (continued on any lane, the upstream hydrating it, or over HTTP)."""
        if req.store and req.previous_response_id is None:
            self._owned(self.heads.record(identity, (-next(self._detached), None), req, response, now))

    def reseeded(self, old: LaneKey, lane: Lane | None, response_id: str | None) -> None:
        """A re-seed of the head under ``old`` ended: on ``response_id`` it moves to ``lane``
        under that id, else it is let go."""
        self.reseeding.discard(old)
        head = self.heads.get(old)
        if head is None or lane is None or response_id is None or self.heads.has(lane.key):
            if head is not None:
                self.kept.drop(head.response_id)
            self.heads.discard(old)
            return
        self.kept.move(head.response_id, response_id)
        self._owned(self.heads.rekey(old, lane.key))
        self._owned(self.heads.rename(lane.key, response_id))
        lane.head = True
