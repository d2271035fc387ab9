"""Placement: the lane a new head goes on, and whether a new socket may be opened for it.

Lane choice for a request that needs a new head (a new conversation, a miss, a replay):

1. while the identity has fewer than ``spread_sockets`` sockets and no idle one, a new socket
   (conversations spread over a few sockets before they share one);
2. a free lane (idle, no head) of the identity's least active socket below
   ``max_active_per_socket`` (the limit places new heads; a head's own next turn goes on its lane
   whatever the socket's count, and the upstream queues it beyond 16);
3. a new socket, under ``max_sockets_per_identity`` (per tenant) and ``max_sockets_total`` (at
   the total, the least recently used socket with nothing in flight, of the tenant holding the
   most, is closed);
4. the least recently used idle lane that holds a head (that head is let go:
   :meth:`~proxy.core.sockets.Custody.let_go`);
5. nothing: the planner makes the turn wait, or go over HTTP.

New sockets of an identity open with a slow start (at most as many handshakes at once as
sockets open, at least :data:`SLOW_START`), never in a burst, and never above a learned cap
but for one probe now and then (:class:`~proxy.core.socketcaps.Caps`). While sockets of the
identity are growing (a handshake, a lane probe, the slow start), no head is evicted: lanes are
a moment away. Nothing here reads a clock.
"""

from __future__ import annotations

from collections import Counter

from proxy.core.lanes import Lane, LaneState, Socket, SocketEvent, SocketState
from proxy.core.socketcaps import Caps
from proxy.core.sockets import Custody
from proxy.core.tenants import tenant_of

__all__ = ["SLOW_START", "Placed", "Placement"]

SLOW_START = 4
"""Handshakes an identity may have under way at once before it has sockets open (then as many
as it has open): a cap is met by at most about as many refusals as it allows, never a burst."""

Placed = tuple[Lane, bool, int | None]
"""``(lane reserved for the new head, its socket is new, a spare socket to open meanwhile)``."""


class Placement:
    """Where new heads go.

    Args:
        custody: The heads and, through it, the socket book.
        caps: What refused upgrades taught.
        outside: Upstream sockets each identity holds outside the pool (WebSocket relay
            sessions): they count against the socket limits too.
    """

    def __init__(self, custody: Custody, caps: Caps, outside: Counter[str]) -> None:
        self.custody = custody
        self.book = custody.book
        self.limits = custody.book.limits
        self.caps = caps
        self.outside = outside
        self.slow_start = False
        """The last open was held back by the slow start only."""

    def growing(self, identity: str) -> bool:
        """Whether ``identity``'s sockets are still growing: the slow start held its last open
        back, or one is in its handshake, or probing its lanes (its first named lane's first
        event proves or refuses them). Lanes are a moment away, not taken: a burst of new
        conversations waits for them, it evicts no head (a ``store: false`` one would be
        forgotten) and is not yet ``pool_full``."""
        return self.slow_start or self.book.growing(identity)

    def free_slot(self, sock: Socket) -> Lane | None:
        """An idle lane of ``sock`` with no head (creating the next slot if allowed)."""
        for lane in self.book.slot_lanes(sock):
            if lane.state is LaneState.IDLE and not self.custody.holds(lane):
                return lane
        return self.book.new_lane(sock)

    def free_lane(self, identity: str, now: float, may_open: bool, close: list[int]) -> Placed | None:
        """A lane for a new head of ``identity``, reserved by the caller; sockets closed to
        make room are added to ``close``."""
        lim, book = self.limits, self.book
        mine = book.of(identity).values()
        most = lim.max_active_per_socket
        socks = [s for s in mine if s.active < most and not s.exclusive and s.live and not book.stale(s, now)]
        if len(socks) > 1:
            # Open sockets first (no handshake to wait for), the least busy first.
            socks.sort(key=lambda s: (s.state is not SocketState.OPEN, s.active, -s.used_at))
        # Spread: fewer sockets than spread_sockets and none idle (asked only when it may open).
        spread = may_open and len(mine) < lim.spread_sockets and not any(s.active == 0 for s in mine)
        if spread and self._can_open(identity, now, close):
            opened = [s for s in socks if s.state is SocketState.OPEN]
            lane = self.free_slot(opened[0]) if opened else None
            if lane is None:
                return book.open(identity, now), True, None
            # A free lane now, and the socket of its own opened in the background for the
            # next new conversation: nobody waits for a handshake.
            return lane, False, book.open(identity, now, reserve=False).key[0]
        # One pass over the slots: the first free one, else the least recently used idle lane
        # of an open socket (every idle lane left holds a head), in the same order.
        victim: Lane | None = None
        holds = self.custody.holds
        for sock in socks:
            if sock.active >= len(sock.lanes) and not book.room(sock):
                continue  # every lane active (``active`` counts them) and no slot to make: none free
            is_open = sock.state is SocketState.OPEN
            for lane in book.slot_lanes(sock):
                if lane.state is not LaneState.IDLE:
                    continue
                if not holds(lane):
                    return lane, False, None
                if is_open and (victim is None or lane.used_at < victim.used_at):
                    victim = lane
            lane = book.new_lane(sock)
            if lane is not None:
                return lane, False, None
        self.slow_start = False
        if may_open and self._can_open(identity, now, close):
            return book.open(identity, now), True, None
        if victim is None or self.growing(identity):
            return None  # growing: a socket will open or prove its lanes in a moment: wait, evict no head
        self.custody.let_go(victim)
        return victim, False, None

    def _can_open(self, identity: str, now: float, close: list[int]) -> bool:
        lim, book = self.limits, self.book
        if self.caps.held_off(identity, now):
            return False
        mine = book.of(identity)
        held = self.tenant_sockets()  # the quota is the tenant's: query strings split no credential
        own = None
        if held[tenant_of(identity)] >= lim.max_sockets_per_identity:
            own = self._own_idle(identity)  # at its quota a tenant gives up one of its own
            if own is None:
                return False
        connecting = sum(1 for s in mine.values() if s.state is SocketState.CONNECTING)
        if connecting >= max(SLOW_START, len(mine) - connecting):
            self.slow_start = True  # a moment's wait, not a limit: no head is evicted for it
            return False  # slow start: at most as many handshakes at once as sockets open
        if not self.caps.allows(identity, len(mine), connecting, now):
            return False
        if own is not None:
            self.custody.close(own, SocketEvent.CLOSE)
            close.append(own.id)
            return True
        if len(book.all) + sum(self.outside.values()) < lim.max_sockets_total:
            return True
        idle = [s for s in book.all.values() if s.active == 0 and s.state is SocketState.OPEN]
        if not idle:
            return False

        # the least recently used idle socket of the tenant holding the most,
        # counting the one asked for (at equal shares the asker gives up one of its own).
        mine_tenant = tenant_of(identity)

        def share(s: Socket) -> tuple[int, float]:
            tenant = tenant_of(s.identity)
            return -(held[tenant] + (tenant == mine_tenant)), s.used_at

        oldest = min(idle, key=share)
        self.custody.close(oldest, SocketEvent.CLOSE)
        close.append(oldest.id)
        return True

    def _own_idle(self, identity: str) -> Socket | None:
        """The least recently used idle socket of another identity of ``identity``'s tenant."""
        tenant = tenant_of(identity)
        own = [
            s
            for s in self.book.all.values()
            if s.identity != identity
            and tenant_of(s.identity) == tenant
            and s.active == 0
            and s.state is SocketState.OPEN
        ]
        return min(own, key=lambda s: s.used_at) if own else None

    def tenant_sockets(self) -> Counter[str]:
        """Upstream sockets by tenant (:func:`~proxy.core.tenants.tenant_of`), relays included."""
        held: Counter[str] = Counter()
        for ident, socks in self.book.by_identity.items():
            held[tenant_of(ident)] += len(socks)
        for ident, n in self.outside.items():
            held[tenant_of(ident)] += n
        return held
