"""Lanes and sockets as data: their states, the legal transitions, and the records the planner keeps.

A *lane* is one upstream socket plus one ``stream_id`` (``None``: the socket's default lane).
The upstream runs a lane's responses one at a time (FIFO) and caches the lane's latest response,
so a lane holds at most one conversation head. Lanes of one socket run in parallel, at most
``max_active_per_socket`` at a time (protocol.md §1.4, §6).

Rule 1 (h11's): every state a lane or socket can be in, and every way it can change, is in the
two tables below; :func:`lane_step` and :func:`socket_step` are the only functions that change a
state, and an illegal step raises :class:`InvalidTransition` (a bug, never a network event).
``docs/architecture.md`` shows the same tables as a diagram (checked by a test).

Lane life::

    IDLE --begin--> BUSY --finish--> IDLE        (terminal event: head recorded or not)
                    BUSY --abandon--> DRAINING   (app gone or timed out: read to the terminal)
                                      DRAINING --finish--> IDLE
    any --close--> CLOSED                        (its socket closed)

Socket life::

    CONNECTING --opened--> OPEN --retire--> RETIRING --drained--> CLOSED
    CONNECTING --failed--> CLOSED      OPEN/RETIRING --lost--> CLOSED      OPEN --close--> CLOSED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from proxy.core.demux import Demux, LaneSignal
from proxy.errors import InvalidTransition

__all__ = [
    "EARLY_CLOSES_TO_REFUSE",
    "LANES_RETRY_SECONDS",
    "LANE_TRANSITIONS",
    "SOCKET_TRANSITIONS",
    "InvalidTransition",
    "Lane",
    "LaneEvent",
    "LaneKey",
    "LaneLimits",
    "LaneProof",
    "LaneState",
    "Socket",
    "SocketEvent",
    "SocketState",
    "lane_name",
    "lane_step",
    "socket_step",
    "state_diagram",
]

LaneKey = tuple[int, str | None]
"""``(socket id, stream_id)``; the head table's anchor. Socket ids are never reused, so the key
of a lane that is gone never names a live one."""


class LaneState(enum.StrEnum):
    """Where a lane is."""

    IDLE = "idle"
    BUSY = "busy"
    DRAINING = "draining"
    CLOSED = "closed"


class LaneEvent(enum.StrEnum):
    """What happens to a lane."""

    BEGIN = "begin"
    """A ``response.create`` is assigned to the lane."""
    FINISH = "finish"
    """The response's terminal event arrived."""
    ABANDON = "abandon"
    """The turn's reader went away before the terminal event (app disconnect, timeout)."""
    CLOSE = "close"
    """The socket closed."""


class SocketState(enum.StrEnum):
    """Where a socket is."""

    CONNECTING = "connecting"
    OPEN = "open"
    RETIRING = "retiring"
    """No new turns (aged, or told so by the upstream); closed once no lane is active."""
    CLOSED = "closed"


class SocketEvent(enum.StrEnum):
    """What happens to a socket."""

    OPENED = "opened"
    FAILED = "failed"
    RETIRE = "retire"
    DRAINED = "drained"
    LOST = "lost"
    CLOSE = "close"


LANE_TRANSITIONS: dict[tuple[LaneState, LaneEvent], LaneState] = {
    (LaneState.IDLE, LaneEvent.BEGIN): LaneState.BUSY,
    (LaneState.BUSY, LaneEvent.FINISH): LaneState.IDLE,
    (LaneState.BUSY, LaneEvent.ABANDON): LaneState.DRAINING,
    (LaneState.DRAINING, LaneEvent.FINISH): LaneState.IDLE,
    (LaneState.IDLE, LaneEvent.CLOSE): LaneState.CLOSED,
    (LaneState.BUSY, LaneEvent.CLOSE): LaneState.CLOSED,
    (LaneState.DRAINING, LaneEvent.CLOSE): LaneState.CLOSED,
}
"""Every legal lane step."""

SOCKET_TRANSITIONS: dict[tuple[SocketState, SocketEvent], SocketState] = {
    (SocketState.CONNECTING, SocketEvent.OPENED): SocketState.OPEN,
    (SocketState.CONNECTING, SocketEvent.FAILED): SocketState.CLOSED,
    (SocketState.CONNECTING, SocketEvent.CLOSE): SocketState.CLOSED,
    (SocketState.OPEN, SocketEvent.RETIRE): SocketState.RETIRING,
    (SocketState.OPEN, SocketEvent.LOST): SocketState.CLOSED,
    (SocketState.OPEN, SocketEvent.CLOSE): SocketState.CLOSED,
    (SocketState.RETIRING, SocketEvent.DRAINED): SocketState.CLOSED,
    (SocketState.RETIRING, SocketEvent.LOST): SocketState.CLOSED,
    (SocketState.RETIRING, SocketEvent.CLOSE): SocketState.CLOSED,
}
"""Every legal socket step."""


def lane_step(state: LaneState, event: LaneEvent) -> LaneState:
    """The state after ``event``.

    Raises:
        InvalidTransition: the step is not in :data:`LANE_TRANSITIONS`.
    """
    try:
        return LANE_TRANSITIONS[state, event]
    except KeyError:
        raise InvalidTransition(f"lane: {event} in state {state}") from None


def socket_step(state: SocketState, event: SocketEvent) -> SocketState:
    """The state after ``event``.

    Raises:
        InvalidTransition: the step is not in :data:`SOCKET_TRANSITIONS`.
    """
    try:
        return SOCKET_TRANSITIONS[state, event]
    except KeyError:
        raise InvalidTransition(f"socket: {event} in state {state}") from None


def lane_name(slot: int) -> str | None:
    """The ``stream_id`` of lane slot ``slot``: slot 0 is the default lane (no ``stream_id``),
    the others are ``u1``, ``u2``, ... (valid ids: letters, digits, ``_ . -``)."""
    return None if slot == 0 else f"u{slot}"


@dataclass(slots=True, eq=False)
class Lane:
    """One lane of one socket."""

    key: LaneKey
    state: LaneState = LaneState.IDLE
    head: bool = False
    """The head table holds a head under :attr:`key` (this lane's latest completed response)."""
    used_at: float = 0.0
    from_head: LaneKey | None = None
    """The head a turn in flight continues from another lane (a hydration): dropped once this
    lane's own head replaces it."""


@dataclass(slots=True, eq=False)
class Socket:
    """One upstream socket and its lanes (created lazily, slot order)."""

    id: int
    identity: str
    created_at: float
    used_at: float
    state: SocketState = SocketState.CONNECTING
    lanes: dict[str | None, Lane] = field(default_factory=dict)
    active: int = 0
    """Lanes that are BUSY or DRAINING (counted against ``max_active_per_socket``)."""
    demux: Demux = field(default_factory=Demux)
    """Its lanes in flight and whether its upstream takes ``stream_id`` (the one owner of that
    fact: the socket's shell feeds it events, the planner reads :meth:`exclusive`)."""

    @property
    def exclusive(self) -> bool:
        """Whether the socket may carry no second response now: its lanes are not proven and
        one response is in flight (never two on a socket that may not multiplex)."""
        return self.active > 0 and not self.demux.proven

    @property
    def live(self) -> bool:
        """Whether new turns may be assigned to it."""
        return self.state in (SocketState.CONNECTING, SocketState.OPEN)


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


LANES_RETRY_SECONDS = 600.0
"""How long named lanes stay off after the upstream refused one."""

EARLY_CLOSES_TO_REFUSE = 3
"""Once lanes are proven on the upstream, how many fresh sockets in a row (no lane proven in
between) must close before their first event on a named lane for that to count as a refusal."""


class LaneProof:
    """Whether this upstream takes named lanes (``stream_id``), for every socket at once.

    Each socket's :class:`~proxy.core.demux.Demux` learns it for that socket; what one learns
    here turns named lanes off (a refusal) or marks them proven (a socket routed a ``stream_id``).
    Off lasts :data:`LANES_RETRY_SECONDS`, then lanes are tried again, so one misread close costs
    little. :attr:`now` is the latest time the planner saw (nothing here reads a clock).
    """

    __slots__ = ("_early_closes", "_multi", "_off_until", "now", "proven")

    def __init__(self, lanes_per_socket: int) -> None:
        self._multi = lanes_per_socket > 1
        self._off_until = 0.0
        self.proven = False
        """A socket routed a ``stream_id`` since named lanes were last turned off."""
        self._early_closes = 0
        """Fresh sockets closed before their first event on a named lane since the last proof."""
        self.now = 0.0

    @property
    def named(self) -> bool:
        """Whether named lanes are used now."""
        return self._multi and self.now >= self._off_until

    def refused(self, now: float) -> bool:
        """The upstream refused a named lane: default lanes only, for :data:`LANES_RETRY_SECONDS`.
        Returns whether they were on until now (a fallback)."""
        self.now = max(self.now, now)
        if not self.named:
            return False  # already off: the window is not extended
        self._off_until = now + LANES_RETRY_SECONDS
        self.proven, self._early_closes = False, 0  # the next try starts from nothing
        return True

    def closed_early(self, now: float) -> bool:
        """A socket that never routed a ``stream_id`` closed right after a named lane's first
        create, before any event: how an upstream without lanes may refuse one, and also how
        any socket is lost. Before lanes are proven it is a refusal; after, only the
        :data:`EARLY_CLOSES_TO_REFUSE`-th in a row with no proof in between is. Returns whether
        named lanes were turned off."""
        if self.proven:
            self._early_closes += 1
            if self._early_closes < EARLY_CLOSES_TO_REFUSE:
                return False
        return self.refused(now)

    def signal(self, signal: LaneSignal, now: float) -> bool:
        """What a socket's demux learned: proven, or a refusal (lanes refused or ignored).
        Returns whether named lanes were turned off."""
        if signal is LaneSignal.PROVEN:
            self.proven, self._early_closes = True, 0
            return False
        return self.refused(now)


def state_diagram() -> str:
    """The two transition tables as Mermaid state diagrams (``docs/architecture.md`` embeds this
    text; a test checks it is current)."""
    lines = ["```mermaid", "stateDiagram-v2", "    %% lane (LANE_TRANSITIONS)"]
    lines += [f"    lane_{a} --> lane_{b}: {e}" for (a, e), b in LANE_TRANSITIONS.items()]
    lines += ["    %% socket (SOCKET_TRANSITIONS)"]
    lines += [f"    socket_{a} --> socket_{b}: {e}" for (a, e), b in SOCKET_TRANSITIONS.items()]
    lines.append("```")
    return "\n".join(lines)
