"""The memory budget: one number that everything the sidecar holds draws from.

Sans-I/O accounting (the async gate is :mod:`proxy.intake.memory`). Three kinds of holders:

* **in flight**: requests being received, parsed and sent (a :class:`Ticket` each). A body pays
  as it arrives: a ticket is granted its headers, :data:`MIN_RESERVATION` and
  :data:`AMPLIFICATION` times at most one :data:`STEP` of body, and grows step by step as the
  bytes actually arrive, up to its ``need`` (``Content-Length`` times the amplification); it is
  settled down to the body once the frame is sent. A declared length is a promise, never a
  reservation: a connection that declares 64 MiB and sends nothing holds one step;
* **kept bodies**: previous request bodies a head keeps for the byte comparison of the next
  turn's prefix (:meth:`Budget.keep`); they give way first: a reservation that does not fit
  evicts the least recently kept ones (their heads fall back to the digest: same answer);
* **heads**: the conversation heads and their sockets (:meth:`Budget.set_heads`).

At the bounds on kept bodies and heads (their bytes, their count) the one that gives way is the
heaviest tenant's least recently used (:class:`FairShares`): a tenant that opens ten times its
share, or splits one credential into many identities, evicts its own, never another tenant's.

A reservation or a growth that does not fit waits (the body is not read meanwhile: TCP
backpressure). Waiters are admitted round-robin over their keys (the caller's identity), first
come first within a key, growths of bodies being read before new requests, and **any waiter that
fits is granted**: a large one never holds up small ones. A body larger than one step is admitted
only while it and every body being read could all grow to what they promise at once (promises are
counted against each other, never reserved, and one not kept is closed by the body deadline);
one that could not fit into an empty budget is refused at once (:attr:`Verdict.TOO_LARGE`).

A promise is backed by evidence: a body promises its declared need only as far as its observed
rate can deliver it before its deadline (:meth:`Budget.observe`: the caller measures), so a
trickle declaring the body limit promises a few MiB, not the limit. Bodies without a credential
(``keyless``) share :data:`KEYLESS_SHARE` of the capacity, promises included (one alone may take
more). A growth of a body too slow to finish in time waits behind new requests. Nothing granted
is ever taken back: nothing that is streaming is cut for memory.

Every method returns what the caller must do (tickets to wake, kept bodies to drop), or, called
by the prefix cache, holds it for the gate (:meth:`Budget.cooled`); nothing here waits, sleeps or
reads a clock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable

from proxy.core.sizing import (
    AMPLIFICATION,
    HEAD_COST,
    HEADER_ROOM,
    KEYLESS_SHARE,
    MIN_RESERVATION,
    STEP,
    Derived,
    Kind,
    derive,
)
from proxy.core.tenants import tenant_of
from proxy.core.tickets import Effects, Ticket, Verdict

__all__ = [
    "AMPLIFICATION",
    "HEAD_COST",
    "HEADER_ROOM",
    "KEYLESS_SHARE",
    "MIN_RESERVATION",
    "STEP",
    "Budget",
    "Derived",
    "Effects",
    "FairShares",
    "Kind",
    "Ticket",
    "Verdict",
    "derive",
]


class FairShares:
    """Per-group LRU order and weight totals; :meth:`victim` is the heaviest group's oldest.

    Items (conversation heads, kept bodies) belong to a group (the tenant of the identity they
    are given) and weigh something (1 for a head, its size for a kept body). Pure and
    O(log groups) per change (a lazy max-heap of group totals)."""

    def __init__(self) -> None:
        self._items: dict[str, OrderedDict[Hashable, int]] = {}
        self._group_of: dict[Hashable, str] = {}
        self._totals: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []

    def __len__(self) -> int:
        return len(self._group_of)

    def total(self, group: str) -> int:
        """The weight ``group`` (an identity's tenant) holds."""
        return self._totals.get(tenant_of(group), 0)

    def add(self, group: str, item: Hashable, weight: int = 1) -> None:
        """``item`` of ``group`` (an identity: its tenant is the group) now weighs ``weight``
        and is the group's most recent."""
        group = tenant_of(group)
        if self._group_of.get(item, group) != group:
            self.remove(item)
        self._group_of[item] = group
        items = self._items.setdefault(group, OrderedDict())
        old = items.pop(item, 0)
        items[item] = weight
        self._set(group, self._totals.get(group, 0) - old + weight)

    def touch(self, item: Hashable) -> None:
        """``item`` was used: its group's most recent."""
        group = self._group_of.get(item)
        if group is not None:
            self._items[group].move_to_end(item)

    def remove(self, item: Hashable) -> None:
        """``item`` is gone (no-op if unknown)."""
        group = self._group_of.pop(item, None)
        if group is None:
            return
        items = self._items[group]
        weight = items.pop(item)
        if not items:
            del self._items[group]
        self._set(group, self._totals.get(group, 0) - weight)

    def victim(self) -> Hashable | None:
        """The least recently used item of the group with the most weight (``None``: empty)."""
        while self._heap:
            negative, group = self._heap[0]
            if self._totals.get(group) == -negative and group in self._items:
                return next(iter(self._items[group]))
            heapq.heappop(self._heap)  # stale entry
        return None

    def _set(self, group: str, total: int) -> None:
        if total <= 0 and group not in self._items:
            self._totals.pop(group, None)
            return
        self._totals[group] = total
        heapq.heappush(self._heap, (-total, group))
        if len(self._heap) > 4 * len(self._totals) + 64:  # drop stale entries now and then
            self._heap = [(-t, g) for g, t in self._totals.items()]
            heapq.heapify(self._heap)


class Budget:
    """Grants and refuses reservations against ``capacity`` bytes; decides which kept bodies go.

    Args:
        capacity: Bytes shared by in-flight requests, kept bodies and heads.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keyless_share = capacity // KEYLESS_SHARE
        """What requests without a credential may hold and promise together."""
        self.keyless = 0
        """Bytes held by keyless tickets (part of :attr:`in_flight`)."""
        self.in_flight = 0
        self.kept = 0
        self.heads = 0
        self._kept: OrderedDict[Hashable, int] = OrderedDict()
        self._queues: OrderedDict[Hashable, deque[Ticket]] = OrderedDict()
        """Waiters by key, in the round-robin order of their keys."""
        self._waiting = 0
        self._reading: dict[Ticket, None] = {}
        """Granted tickets whose body is still arriving (``need`` above ``held``)."""
        self.tickets = 0
        """Granted tickets not yet released."""
        self.pending: list[Ticket] = []
        """Waiters let in by :meth:`cooled`, for the gate to wake (:meth:`take_pending`)."""

    def __repr__(self) -> str:
        return (
            f"<Budget {self.used}/{self.capacity} in_flight={self.in_flight} kept={self.kept} "
            f"heads={self.heads} waiting={self._waiting} reading={len(self._reading)}>"
        )

    @property
    def used(self) -> int:
        return self.in_flight + self.kept + self.heads

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def waiting(self) -> int:
        """Tickets (and growths) queued."""
        return self._waiting

    @property
    def idle(self) -> bool:
        """Nothing in flight and nobody waiting."""
        return self.tickets == 0 and not self._waiting

    # -- requests --------------------------------------------------------------------------

    @property
    def reading(self) -> list[Ticket]:
        """The granted tickets whose body is still arriving (to :meth:`observe`)."""
        return list(self._reading)

    def observe(self, ticket: Ticket, promise: int, *, slow: bool = False) -> None:
        """The evidence of a body being read: it may still grow by ``promise`` bytes as far as
        its observed rate shows, and whether that rate is too ``slow`` to finish it in time.
        Nothing is granted here: :meth:`recheck` does, once every body is observed."""
        ticket.promise = max(promise, 0)
        ticket.slow = slow

    def recheck(self) -> Effects:
        """Grant the waiters that fit now (after :meth:`observe` changed the promises)."""
        return self._admit()

    def ask(
        self,
        want: int,
        buffered: int = 0,
        *,
        key: Hashable = None,
        need: int = 0,
        keyless: bool = False,
        heads: int | None = None,
    ) -> tuple[Ticket, Effects]:
        """Reserve ``want`` bytes: granted now (maybe evicting kept bodies), queued, or refused
        because it could not fit even into an empty budget.

        ``buffered``: bytes the request holds even while it waits (the start of its body that
        the server's read buffers took in before backpressure set in); counted at once, even
        over the capacity, because they are in memory either way.

        ``need`` (above ``want``): the ticket is a body still arriving that will grow up to
        ``need`` (:meth:`grow`, :meth:`ask_more`) until :meth:`done_reading`; it is admitted only
        while every body being read can still complete (see the module docstring).
        ``key``: whose request it is (fair admission). ``keyless``: sent without a credential
        (the keyless quota). ``heads``: what the heads take now, measured as the request arrives
        (:meth:`set_heads` first: waiters that fit once they shrank are let in before this one).
        """
        ticket = Ticket(max(want, 0), key=key, keyless=keyless)
        ticket.need = max(need, ticket.want)
        out = self.set_heads(heads) if heads is not None else Effects()
        if ticket.need > self.capacity - self.heads:
            ticket.verdict = Verdict.TOO_LARGE
            return ticket, out
        if self._admissible(ticket, out):
            self._grant(ticket)
            return ticket, out
        ticket.waited = True
        self._count(ticket, min(max(buffered, 0), ticket.want))
        self._enqueue(ticket)
        return ticket, out

    def grow(self, ticket: Ticket, more: int) -> tuple[bool, Effects]:
        """Add ``more`` bytes to a granted ticket if they fit now (evicting kept bodies) and the
        bodies being read stay safe, without queueing."""
        out = Effects()
        if ticket.verdict is not Verdict.GRANTED:
            raise ValueError(f"grow on a {ticket.verdict} ticket")
        if more <= 0:
            return True, out
        if not self._growable(ticket, more, out):
            return False, out
        self._add(ticket, more)
        return True, out

    def ask_more(self, ticket: Ticket, more: int) -> tuple[bool, Effects]:
        """:meth:`grow`, or else queue the growth (granted later by a wake-up: the ticket is then
        in :attr:`Effects.granted` and its ``more`` is 0 again)."""
        ok, out = self.grow(ticket, more)
        if not ok:
            ticket.more = more
            self._enqueue(ticket)
        return ok, out

    def cancel_more(self, ticket: Ticket) -> Effects:
        """A queued growth is given up (the wait timed out)."""
        if ticket.more and self._dequeue(ticket):
            ticket.more = 0
            return self._admit()
        return Effects()

    def done_reading(self, ticket: Ticket, still: int = 0) -> Effects:
        """The ticket's body is complete: its body never grows again. It still promises the
        ``still`` bytes it was admitted for beyond the body (the copy of a frame sent whole),
        counted like a body's rest until taken or :meth:`settle`: bodies admitted together can
        all be sent, not only read (else each, read, waits for a frame step the others hold)."""
        ticket.need = max(min(ticket.need, ticket.held + max(still, 0)), ticket.held)
        ticket.promise, ticket.slow = -1, False
        if ticket in self._reading:
            if ticket.need <= ticket.held:
                del self._reading[ticket]
            return self._admit()
        return Effects()

    def settle(self, ticket: Ticket, hold: int) -> Effects:
        """Lower a granted ticket to ``hold`` bytes (never raises it); wakes waiters that fit."""
        if ticket.verdict is not Verdict.GRANTED or hold >= ticket.want:
            return Effects()
        self._reading.pop(ticket, None)
        self._count(ticket, max(hold, 0) - ticket.held)
        ticket.want = ticket.need = ticket.held
        return self._admit()

    def release(self, ticket: Ticket) -> Effects:
        """The request is over (any way): its bytes return; a waiting ticket leaves the queue."""
        if ticket.verdict is Verdict.GRANTED:
            if ticket.more:
                self._dequeue(ticket)
                ticket.more = 0
            self._reading.pop(ticket, None)
            self._count(ticket, -ticket.held)
            self.tickets -= 1
            ticket.verdict = Verdict.RELEASED
            return self._admit()
        if ticket.verdict is Verdict.WAITING:
            self._count(ticket, -ticket.held)
            ticket.verdict = Verdict.CANCELLED
            self._dequeue(ticket)
            return self._admit()
        return Effects()

    # -- kept bodies and heads -------------------------------------------------------------

    def keep(self, key: Hashable, size: int) -> bool:
        """Whether a head may keep a body of ``size`` bytes: only into free memory and only
        while no request waits (kept bodies never make a request wait)."""
        if key in self._kept:
            self.unkeep(key)
        if self._waiting or size > self.free:
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

    def cooled(self, key: Hashable) -> None:
        """The prefix cache let a kept body go (it is the cache's keeper, with :meth:`keep`): as
        :meth:`unkeep`, the waiters let in held for the gate, which takes them with its next
        call (:meth:`take_pending`): the core tells no shell, the shell asks."""
        self.pending += self.unkeep(key).granted

    def rekeep(self, old: Hashable | None, key: Hashable, size: int) -> bool:
        """:meth:`cooled` of ``old`` (if not ``None``), then :meth:`keep` of ``key``: a head's
        kept body replaced by its successor's in one call (the waiters the old one's memory
        lets in come first, then the new one is kept only if none still waits)."""
        if old is not None:
            self.cooled(old)
        return self.keep(key, size)

    def take_pending(self) -> list[Ticket]:
        """The waiters :meth:`cooled` let in since the last call (to wake), handed over once."""
        pending, self.pending = self.pending, []
        return pending

    def set_heads(self, size: int) -> Effects:
        """The heads now take ``size`` bytes."""
        shrunk = size < self.heads
        self.heads = max(size, 0)
        return self._admit() if shrunk else Effects()

    # -- internals -------------------------------------------------------------------------

    def _count(self, ticket: Ticket, delta: int) -> None:
        """``ticket`` holds ``delta`` bytes more (or fewer)."""
        ticket.held += delta
        self.in_flight += delta
        if ticket.keyless:
            self.keyless += delta

    def _promised(self) -> int:
        """What the bodies being read may still grow by: their declared needs as far as their
        observed rates can deliver them, not held; the keyless ones together at most what is
        left of their quota."""
        keyed = keyless = 0
        for t in self._reading:
            left = t.need - t.held
            if t.promise >= 0:
                left = min(left, t.promise)
            if t.keyless:
                keyless += left
            else:
                keyed += left
        if keyless:
            keyed += min(keyless, max(self.keyless_share - self.keyless, 0))
        return keyed

    def _over_keyless_share(self, ticket: Ticket, more: int) -> bool:
        """A keyless ticket would take the keyless tickets past their quota (and is not the only
        one holding anything)."""
        return ticket.keyless and self.keyless - ticket.held > 0 and self.keyless + more > self.keyless_share

    def _admissible(self, ticket: Ticket, out: Effects) -> bool:
        """A new ticket may be granted now (evicting kept bodies if that makes it fit). A body
        still to arrive is admitted only while it and every body being read could all grow to
        what they promise at once; its promise is counted against other such bodies only, never
        reserved: small requests and growths use the memory until the bytes arrive."""
        if self._over_keyless_share(ticket, ticket.want - ticket.held):
            return False
        if ticket.need > ticket.want:
            rest = ticket.need - ticket.held + self._promised()
            if rest > self.free + self.kept:
                return False
        return self._fits(ticket.want - ticket.held, out)

    def _growable(self, ticket: Ticket, more: int, out: Effects) -> bool:
        if ticket in self._reading:
            ticket.need = max(ticket.need, ticket.held + more)
        if self._over_keyless_share(ticket, more):
            return False
        return self._fits(more, out)

    def _add(self, ticket: Ticket, more: int) -> None:
        ticket.want += more
        self._count(ticket, more)

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
        self._count(ticket, ticket.want - ticket.held)
        self.tickets += 1
        if ticket.need > ticket.held:
            self._reading[ticket] = None

    def _enqueue(self, ticket: Ticket) -> None:
        self._queues.setdefault(ticket.key, deque()).append(ticket)
        self._waiting += 1

    def _dequeue(self, ticket: Ticket) -> bool:
        queue = self._queues.get(ticket.key)
        if queue is None or ticket not in queue:
            return False
        queue.remove(ticket)
        self._waiting -= 1
        if not queue:
            del self._queues[ticket.key]
        return True

    def _fair_order(self) -> list[Ticket]:
        """The waiters round-robin over their keys (in the keys' rotation order), first come
        first within a key."""
        queues = [list(q) for q in self._queues.values()]
        order: list[Ticket] = []
        depth = max((len(q) for q in queues), default=0)
        for i in range(depth):
            order.extend(q[i] for q in queues if i < len(q))
        return order

    def _admit(self) -> Effects:
        """Grant every waiter that fits now, in the fair order (a waiter that does not fit
        holds up nobody behind it)."""
        out = Effects()
        if not self._waiting:
            return out
        order = self._fair_order()
        # Growths first: they complete bodies already being read (and free memory soonest);
        # those of bodies too slow to finish in time after new requests.
        growths = [t for t in order if t.more and not t.slow]
        for ticket in growths + [t for t in order if not t.more] + [t for t in order if t.more and t.slow]:
            if ticket.verdict is Verdict.WAITING:
                if ticket.need > self.capacity - self.heads:
                    self._dequeue(ticket)
                    self._count(ticket, -ticket.held)
                    ticket.verdict = Verdict.TOO_LARGE
                    out.granted.append(ticket)  # woken to be refused
                    continue
                if not self._admissible(ticket, out):
                    continue
                self._dequeue(ticket)
                self._grant(ticket)
            elif ticket.more:
                if not self._growable(ticket, ticket.more, out):
                    continue
                self._dequeue(ticket)
                self._add(ticket, ticket.more)
                ticket.more = 0
            else:  # pragma: no cover - nothing else is ever queued
                continue
            out.granted.append(ticket)
            if ticket.key in self._queues:
                self._queues.move_to_end(ticket.key)  # the next grant goes to another key first
        return out
