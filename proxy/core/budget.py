"""The memory budget: one number that everything the sidecar holds draws from.

Sans-I/O accounting (the async gate is :mod:`proxy.serve.memory`). Three kinds of holders:

* **in flight**: requests being received, parsed and sent (a :class:`Ticket` each, reserved
  before the body is read, by ``Content-Length`` times :data:`AMPLIFICATION`, settled down to
  the body once the frame is sent);
* **kept bodies**: previous request bodies a head keeps for the byte comparison of the next
  turn's prefix (:meth:`Budget.keep`); they give way first: a reservation that does not fit
  evicts the least recently kept ones (their heads fall back to the digest: same answer);
* **heads**: the conversation heads and their sockets (:meth:`Budget.set_heads`).

A reservation that does not fit waits in one FIFO queue (the gate does not read the body
meanwhile: TCP backpressure). One that could not fit even if nothing else were in flight and
no body kept is refused at once (:attr:`Verdict.TOO_LARGE`). The budget never takes memory
back from a ticket already granted: nothing that is streaming is cut for memory.

Every method returns what the caller must do (tickets to wake, kept bodies to drop); nothing
here waits, sleeps or reads a clock.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = [
    "AMPLIFICATION",
    "DEFAULT_MEMORY_BYTES",
    "HEAD_COST",
    "MIN_RESERVATION",
    "Budget",
    "Derived",
    "Effects",
    "Kind",
    "Ticket",
    "Verdict",
    "derive",
]

AMPLIFICATION = 4
"""Bytes reserved per body byte while a request is received, parsed and sent: the body, the
parsed items (about 1x for tool outputs), the frame, and the send buffers of the WebSocket
library (masked copy). Measured peak per in-flight byte, see bench/memory.py."""

MIN_RESERVATION = 128 * 1024
"""Added to every request's reservation: its connection's buffers and objects, held even
while it waits (bench: 200 connections at once cost ~25 MiB beyond their bodies)."""

HEAD_COST = 24 * 1024
"""Bytes per conversation head, its upstream socket included (bench: ~23 KB)."""

DEFAULT_MEMORY_BYTES = 1024 * 1024 * 1024
"""The budget when no container limit is found (1 GiB)."""

CGROUP_FRACTION = 0.85
"""Share of the container's memory limit the sidecar budgets for itself (the rest: the
kernel's socket buffers, allocator slack, the probes)."""

BASELINE_SLACK = 0.15
"""Share of the budget left unassigned on top of the idle process: the read buffers of connections
that arrive while the budget is taken (~0.15 MiB each, in memory before any handler runs) and
allocator fragmentation (bench: 200 connections at once)."""


class Kind(enum.StrEnum):
    """What the budget's bytes are held by (metric label values)."""

    IN_FLIGHT = "in_flight"
    KEPT = "kept_bodies"
    HEADS = "heads"
    BASELINE = "baseline"


class Verdict(enum.StrEnum):
    """The state of a :class:`Ticket`."""

    GRANTED = "granted"
    WAITING = "waiting"
    TOO_LARGE = "too_large"
    CANCELLED = "cancelled"
    RELEASED = "released"


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's share of the budget."""

    want: int
    """Bytes asked for (granted: held)."""
    held: int = 0
    """Bytes counted now: ``want`` once granted; while waiting, what the connection's buffers
    already hold of the unread body (see :meth:`Budget.ask`)."""
    verdict: Verdict = Verdict.WAITING
    waited: bool = False
    """Whether it had to queue."""


@dataclass(slots=True)
class Effects:
    """What the caller must do after a budget call."""

    granted: list[Ticket] = field(default_factory=list)
    """Tickets that were waiting and are granted now (wake them)."""
    evict: list[Hashable] = field(default_factory=list)
    """Kept bodies to let go of (already no longer counted)."""


@dataclass(frozen=True, slots=True)
class Derived:
    """Limits derived from the budget (when not set explicitly)."""

    memory_bytes: int
    capacity: int
    """What requests, kept bodies and heads share: the budget minus the idle process."""
    max_body_bytes: int
    """The largest body that fits an empty budget (at most 64 MiB)."""
    hot_prefix_bytes: int
    """Half the capacity: kept bodies give way to requests anyway."""


def derive(memory_bytes: int, baseline: int) -> Derived:
    """The capacity and the default size limits for a budget of ``memory_bytes`` (RSS) when the
    idle process takes ``baseline`` bytes."""
    slack = int(memory_bytes * BASELINE_SLACK)
    # A process already larger than its budget (a test runner hosting sidecars) still gets a
    # quarter of it rather than nothing.
    capacity = max(memory_bytes - baseline - slack, memory_bytes // 4)
    return Derived(
        memory_bytes=memory_bytes,
        capacity=capacity,
        max_body_bytes=min(64 * 1024 * 1024, (capacity - MIN_RESERVATION) // AMPLIFICATION),
        hot_prefix_bytes=capacity // 2,
    )


class Budget:
    """Grants and refuses reservations against ``capacity`` bytes; decides which kept bodies go.

    Args:
        capacity: Bytes shared by in-flight requests, kept bodies and heads.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.kept = 0
        self.heads = 0
        self._kept: OrderedDict[Hashable, int] = OrderedDict()
        self._queue: deque[Ticket] = deque()
        self.tickets = 0
        """Granted tickets not yet released."""

    def __repr__(self) -> str:
        return (
            f"<Budget {self.used}/{self.capacity} in_flight={self.in_flight} kept={self.kept} "
            f"heads={self.heads} waiting={len(self._queue)}>"
        )

    @property
    def used(self) -> int:
        return self.in_flight + self.kept + self.heads

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def waiting(self) -> int:
        """Tickets queued."""
        return len(self._queue)

    @property
    def idle(self) -> bool:
        """Nothing in flight and nobody waiting."""
        return self.tickets == 0 and not self._queue

    # -- requests --------------------------------------------------------------------------

    def ask(self, want: int, buffered: int = 0) -> tuple[Ticket, Effects]:
        """Reserve ``want`` bytes: granted now (maybe evicting kept bodies), queued, or refused
        because it could not fit even into an empty budget.

        ``buffered``: bytes the request holds even while it waits (the start of its body that
        the server's read buffers took in before backpressure set in); counted at once, even
        over the capacity, because they are in memory either way.
        """
        ticket = Ticket(max(want, 0))
        out = Effects()
        if ticket.want > self.capacity - self.heads:
            ticket.verdict = Verdict.TOO_LARGE
            return ticket, out
        if not self._queue and self._fits(ticket.want, out):
            self._grant(ticket)
            return ticket, out
        ticket.waited = True
        ticket.held = min(max(buffered, 0), ticket.want)
        self.in_flight += ticket.held
        self._queue.append(ticket)
        return ticket, out

    def grow(self, ticket: Ticket, more: int) -> tuple[bool, Effects]:
        """Add ``more`` bytes to a granted ticket if they fit now (evicting kept bodies), without
        queueing: for a chunked body reserved as it is read."""
        out = Effects()
        if ticket.verdict is not Verdict.GRANTED:
            raise ValueError(f"grow on a {ticket.verdict} ticket")
        if more <= 0:
            return True, out
        if not self._fits(more, out):
            return False, out
        ticket.want += more
        ticket.held += more
        self.in_flight += more
        return True, out

    def settle(self, ticket: Ticket, hold: int) -> Effects:
        """Lower a granted ticket to ``hold`` bytes (never raises it); wakes waiters that fit."""
        if ticket.verdict is not Verdict.GRANTED or hold >= ticket.want:
            return Effects()
        self.in_flight -= ticket.want - max(hold, 0)
        ticket.want = ticket.held = max(hold, 0)
        return self._admit()

    def release(self, ticket: Ticket) -> Effects:
        """The request is over (any way): its bytes return; a waiting ticket leaves the queue."""
        if ticket.verdict is Verdict.GRANTED:
            self.in_flight -= ticket.held
            self.tickets -= 1
            ticket.held, ticket.verdict = 0, Verdict.RELEASED
            return self._admit()
        if ticket.verdict is Verdict.WAITING:
            self.in_flight -= ticket.held
            ticket.held, ticket.verdict = 0, Verdict.CANCELLED
            head = bool(self._queue) and self._queue[0] is ticket
            self._queue.remove(ticket)
            if head:
                return self._admit()
        return Effects()

    # -- kept bodies and heads -------------------------------------------------------------

    def keep(self, key: Hashable, size: int) -> bool:
        """Whether a head may keep a body of ``size`` bytes: only into free memory and only
        while no request waits (kept bodies never make a request wait)."""
        if key in self._kept:
            self.unkeep(key)
        if self._queue or size > self.free:
            return False
        self._kept[key] = size
        self.kept += size
        return True

    def unkeep(self, key: Hashable) -> Effects:
        """A kept body was let go (expired, replaced, evicted); wakes waiters that fit."""
        size = self._kept.pop(key, None)
        if size is None:
            return Effects()
        self.kept -= size
        return self._admit()

    def set_heads(self, size: int) -> Effects:
        """The heads now take ``size`` bytes."""
        shrunk = size < self.heads
        self.heads = max(size, 0)
        return self._admit() if shrunk else Effects()

    # -- internals -------------------------------------------------------------------------

    def merge(self, ticket: Ticket, extra: Ticket) -> None:
        """Fold a granted ``extra`` ticket into ``ticket`` (a chunked body's growth)."""
        if ticket.verdict is not Verdict.GRANTED or extra.verdict is not Verdict.GRANTED:
            raise ValueError("merge of tickets not both granted")
        ticket.want += extra.want
        ticket.held += extra.held
        extra.want = extra.held = 0
        extra.verdict = Verdict.RELEASED
        self.tickets -= 1

    def _fits(self, want: int, out: Effects) -> bool:
        """Whether ``want`` fits, evicting kept bodies (oldest first) if that makes it fit."""
        if want <= self.free:
            return True
        if want > self.free + self.kept:
            return False
        while want > self.free:
            key, size = self._kept.popitem(last=False)
            self.kept -= size
            out.evict.append(key)
        return True

    def _grant(self, ticket: Ticket) -> None:
        ticket.verdict = Verdict.GRANTED
        self.in_flight += ticket.want - ticket.held
        ticket.held = ticket.want
        self.tickets += 1

    def _admit(self) -> Effects:
        """Grant queued tickets in order while the first one fits."""
        out = Effects()
        while self._queue:
            ticket = self._queue[0]
            if ticket.want > self.capacity - self.heads:
                self._queue.popleft()
                self.in_flight -= ticket.held
                ticket.held, ticket.verdict = 0, Verdict.TOO_LARGE
                out.granted.append(ticket)  # woken to be refused
                continue
            if not self._fits(ticket.want - ticket.held, out):
                break
            self._queue.popleft()
            self._grant(ticket)
            out.granted.append(ticket)
        return out
