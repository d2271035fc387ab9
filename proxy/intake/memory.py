"""The memory gate: the async shell around :class:`proxy.core.budget.Budget`.

Every ``POST /v1/responses`` holds a :class:`Lease` (``async with gate.lease(length, ...)``)
from before its body is read until its answer is written. A body pays as it arrives:
entering the lease reserves the request's headers, :data:`~proxy.core.budget.MIN_RESERVATION`
and :data:`~proxy.core.budget.AMPLIFICATION` times one :data:`~proxy.core.budget.STEP` of body
(all of a body smaller than that); :meth:`Lease.arrived` grows it a step at a time as the bytes
come in, up to ``Content-Length`` × the amplification. A declared length is a promise, not a
reservation: a head declaring 64 MiB and sending nothing holds one step. When a reservation or
a growth does not fit, the body is simply not read yet (the app's TCP connection backs up) and
the request waits, woken when memory frees, for at most ``limits.memory_wait_seconds`` (then 429
with ``retry-after``; an admission wait also ends at the body's deadline,
``limits.body_timeout_seconds``: 408). Waiters are admitted round-robin over identities and any
that fits is granted, so a large one never holds up small ones. A request that cannot fit even
into an empty budget is answered 503 with ``retry-after`` at once. Kept bodies (the heads'
byte-comparison copies) give way first. Once the frame is handed to the upstream socket the
lease shrinks to the body itself (needed for a replay and for the next turn's prefix check).

A body being read promises its declared length only as far as its observed rate (time waiting
for memory not counted) can deliver it before its deadline: the gate measures the bodies being
read when a large body asks, and every :data:`RECHECK_SECONDS` while anyone waits.

When the last lease ends, the gate hands freed memory back to the OS; the budget's size and the
allocator's tuning are :mod:`proxy.intake.sysmem`'s, the WebSocket relay's meter
:mod:`proxy.intake.meter`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Hashable, Sized

from proxy.core.budget import (
    AMPLIFICATION,
    HEAD_COST,
    MIN_RESERVATION,
    STEP,
    Budget,
    Derived,
    Effects,
    Kind,
    Ticket,
    Verdict,
)
from proxy.core.fastparse import PrefixCache
from proxy.errors import BodyTimeout, MemoryBusy, MemoryRefused, MemoryTooLarge
from proxy.intake.sysmem import cgroup_memory_limit, effective_settings, process_rss, trim, tune_allocator
from proxy.observe.metrics import MEMORY_BUDGET, MEMORY_BYTES, MEMORY_REFUSALS, MEMORY_WAITING, MEMORY_WAITS
from proxy.reasons import MemoryRefusal

__all__ = [
    "MESSAGE_AMPLIFICATION",
    "Lease",
    "MemoryBusy",
    "MemoryGate",
    "MemoryRefused",
    "MemoryTooLarge",
    "WHOLE_FRAME_EXTRA_ABOVE",
    "cgroup_memory_limit",
    "effective_settings",
    "process_rss",
    "trim",
    "tune_allocator",
]

log = logging.getLogger(__name__)

_BUFFERED = 256 * 1024
"""What a waiting connection's read buffers hold of its body before reading pauses (the API
listener's aiohttp read buffer is 16 KiB, proxy/server.py; measured: a connection waiting with
a 4 MB body adds ~124 KiB of RSS, 756 KiB with aiohttp's default 64 KiB buffer)."""
_TRIM_DELAY = 0.25
"""Seconds the gate must stay idle before memory is handed back to the OS."""
RECHECK_SECONDS = 0.5
"""While requests wait for memory, the bodies being read are measured again this often (their
promises shrink as their deadlines near; a waiter may fit then)."""
_RATE_WINDOW = 0.25
"""A body's rate is measured over at least this long (its first chunk arrives with its head)."""


MESSAGE_AMPLIFICATION = 3
"""Bytes a relayed message holds per byte read: assembled by the server (copied once as it
completes), then masked into a frame by the upstream client (~2.5x, :meth:`Lease.whole_frame`)."""


# -- the gate --------------------------------------------------------------------------------------


class MemoryGate:
    """Admits requests into the memory budget; wakes waiters (fairly) as memory frees.

    Args:
        derived: The budget (see :func:`effective_settings`).
        prefixes: The prefix cache whose kept bodies draw from the budget (made its keeper here).
        heads: What counts the heads (``len``), each costing ``HEAD_COST``.
        wait_seconds: Longest wait for memory before a 429.
        max_body_bytes: Bodies declared larger are refused unread (0: the derived limit).
        whole_frames: Frames go upstream in one piece (``pool.fragment_bytes`` 0).
    """

    def __init__(
        self,
        derived: Derived,
        prefixes: PrefixCache | None,
        *,
        heads: Sized | None = None,
        wait_seconds: float,
        max_body_bytes: int = 0,
        whole_frames: bool = False,
    ) -> None:
        self.derived = derived
        self.whole_frames = whole_frames
        """Frames go upstream whole (``pool.fragment_bytes`` 0): a body's promise includes the
        frame's copy (:meth:`Lease.whole_frame`)."""
        self.max_body_bytes = max_body_bytes
        """Bodies declared larger are not reserved for: the reader refuses them (413) unread."""
        self.budget = Budget(derived.capacity)
        self.prefixes = prefixes
        self.heads = heads
        self.wait_seconds = wait_seconds
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self._reading: dict[Ticket, Lease] = {}
        """Leases whose body is still arriving (their promises are measured)."""
        self._recheck: asyncio.TimerHandle | None = None
        self._turns: asyncio.Semaphore | None = None
        self._trim: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        """Loop time the gate last went idle (a request released its lease)."""
        self.trims = 0
        """Times freed memory was handed back to the OS (``malloc_trim``)."""
        if prefixes is not None:
            prefixes.keeper = self.budget  # the cache asks the budget; the gate wakes who it lets in
        MEMORY_BUDGET.set(derived.memory_bytes)
        MEMORY_BYTES.labels(Kind.BASELINE).set(derived.memory_bytes - derived.capacity)
        self._publish()

    def __repr__(self) -> str:
        return f"<MemoryGate {self.budget!r}>"

    def lease(
        self,
        length: int | None,
        *,
        key: Hashable = None,
        headers: int = 0,
        deadline: float | None = None,
        keyless: bool = False,
        progress: Callable[[], int] | None = None,
    ) -> Lease:
        """A lease for one request whose body declares ``length`` bytes (``None``: chunked or
        encoded, its size known only once read).

        Args:
            key: Whose request it is (the caller's tenant): waiters are admitted fairly by key.
            headers: Bytes of the request's head (they count against the budget too).
            deadline: Loop time by which the body must be complete (an admission wait ends there).
            keyless: Sent without a credential (the keyless quota).
            progress: Bytes of the body the app sent so far (its rate's evidence; without it,
                the bytes read).
        """
        if length is not None and self.max_body_bytes and length > self.max_body_bytes:
            length = 0  # a 413, answered before anything is read
        return Lease(self, length, key=key, headers=headers, deadline=deadline, keyless=keyless, progress=progress)

    def message_turns(self, largest: int) -> asyncio.Semaphore:
        """The turns of WebSocket sessions receiving a large message (:class:`MessageMeter`): as
        many as messages of ``largest`` bytes fit the capacity, at least one."""
        if self._turns is None:
            cost = MESSAGE_AMPLIFICATION * max(largest, 1) + MIN_RESERVATION
            self._turns = asyncio.Semaphore(max(self.budget.capacity // cost, 1))
        return self._turns

    @property
    def body_limit(self) -> int:
        """The largest body: a body of unknown length may grow up to it."""
        return self.max_body_bytes or self.derived.max_body_bytes

    # -- internals -------------------------------------------------------------------------

    def _observe(self) -> None:
        """Measure every body being read: what it may still grow by is what its observed rate
        can deliver before its deadline."""
        if not self._reading:
            return
        now = asyncio.get_running_loop().time()
        for ticket, lease in self._reading.items():
            promise, slow = lease.evidence(now)
            self.budget.observe(ticket, promise, slow=slow)

    def _arm_recheck(self) -> None:
        if self._recheck is None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
                self._recheck = loop.call_at(loop.time() + RECHECK_SECONDS, self._rechecked)

    def _rechecked(self) -> None:
        self._recheck = None
        if not self.budget.waiting:
            return
        self._observe()
        self._apply(self.budget.recheck())
        self._arm_recheck()

    async def _acquire(
        self,
        want: int,
        buffered: int = 0,
        *,
        key: Hashable = None,
        need: int = 0,
        deadline: float | None = None,
        keyless: bool = False,
    ) -> Ticket:
        if need > want:  # a body larger than its first step: the promises it meets are measured
            self._observe()
        heads = len(self.heads) * HEAD_COST if self.heads is not None else None
        ticket, out = self.budget.ask(want, buffered, key=key, need=need, keyless=keyless, heads=heads)
        if _due(self.budget, out):
            self._apply(out)
        if ticket.verdict is Verdict.TOO_LARGE:
            MEMORY_REFUSALS.labels(MemoryRefusal.TOO_LARGE).inc()
            raise MemoryTooLarge(
                f"The request needs about {max(want, need)} bytes of memory, more than the sidecar's memory "
                f"budget can ever hold ({self.budget.capacity - self.budget.heads} bytes free when idle)."
            )
        if ticket.verdict is Verdict.GRANTED:
            return ticket
        loop = asyncio.get_running_loop()
        wait = self.wait_seconds if deadline is None else min(self.wait_seconds, deadline - loop.time())
        try:
            await self._wait(ticket, wait)
        except TimeoutError:
            self._apply(self.budget.release(ticket))  # granted in the same instant: given back
            if deadline is not None and loop.time() >= deadline - 0.001 and wait < self.wait_seconds:
                raise BodyTimeout("The request body did not arrive within the sidecar's body deadline.") from None
            MEMORY_REFUSALS.labels(MemoryRefusal.WAIT_TIMEOUT).inc()
            raise MemoryBusy(
                f"The sidecar's memory budget stayed taken for {self.wait_seconds:g} s; retry the request."
            ) from None
        except BaseException:
            self._apply(self.budget.release(ticket))  # the app went away while waiting
            raise
        if not _granted(ticket):  # woken to be refused: the heads grew meanwhile
            MEMORY_REFUSALS.labels(MemoryRefusal.TOO_LARGE).inc()
            raise MemoryTooLarge("The request no longer fits the sidecar's memory budget.")
        return ticket

    async def _more(self, ticket: Ticket, more: int) -> None:
        """Grow a granted ticket by ``more``, waiting (unread) for at most ``wait_seconds``."""
        ok, out = self.budget.ask_more(ticket, more)
        self._apply(out)
        if ok:
            return
        try:
            await self._wait(ticket, self.wait_seconds)
        except TimeoutError:
            if not ticket.more:  # granted in the same instant: keep it
                return
            self._apply(self.budget.cancel_more(ticket))
            MEMORY_REFUSALS.labels(MemoryRefusal.WAIT_TIMEOUT).inc()
            raise MemoryBusy(
                f"The sidecar's memory budget stayed taken for {self.wait_seconds:g} s; retry the request."
            ) from None
        except BaseException:
            self._apply(self.budget.cancel_more(ticket))
            raise

    async def _wait(self, ticket: Ticket, seconds: float) -> None:
        MEMORY_WAITS.inc()
        self._arm_recheck()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = future
        try:
            await asyncio.wait_for(future, max(seconds, 0.0))
        finally:
            self._waiters.pop(ticket, None)

    def _apply(self, out: Effects) -> None:
        """Wake granted waiters (also those a kept body let in as it went, :meth:`Budget.cooled
        <proxy.core.budget.Budget.cooled>`) and drop the kept bodies the budget gave away."""
        if self.budget.pending:
            out.granted += self.budget.take_pending()
        if out.evict and self.prefixes is not None:
            for anchor in out.evict:
                self.prefixes.cool(anchor)
        for ticket in out.granted:
            future = self._waiters.get(ticket)
            if future is not None and not future.done():
                future.set_result(None)
        if self.budget.idle:
            self._schedule_trim()

    def _schedule_trim(self) -> None:
        """The gate went idle now: trim once it has stayed idle for :data:`_TRIM_DELAY` (a gate
        busy again meanwhile, as under steady load, keeps its memory for the next request:
        ``malloc_trim`` walks the whole heap, ~1 % of a busy sidecar's CPU when it ran every
        :data:`_TRIM_DELAY` whatever happened in between)."""
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            self._idle_since = loop.time()
            if self._trim is None:
                self._trim = loop.call_at(self._idle_since + _TRIM_DELAY, self._trim_if_idle)

    def _trim_if_idle(self) -> None:
        self._trim = None
        if not self.budget.idle:
            return  # busy: the release that leaves it idle schedules again
        loop = asyncio.get_running_loop()
        due = self._idle_since + _TRIM_DELAY
        if loop.time() < due:  # busy in between: idle only since then
            self._trim = loop.call_at(due, self._trim_if_idle)
            return
        self.trims += 1
        trim()

    def _publish(self) -> None:
        """Point the budget gauges at this gate: they are read at scrape time, so a request
        costs no gauge update (the newest gate of a process is the one its metrics show)."""
        b = self.budget
        MEMORY_BYTES.labels(Kind.IN_FLIGHT).set_function(lambda: b.in_flight)
        MEMORY_BYTES.labels(Kind.KEPT).set_function(lambda: b.kept)
        MEMORY_BYTES.labels(Kind.HEADS).set_function(lambda: b.heads)
        MEMORY_WAITING.set_function(lambda: b.waiting)


def _due(budget: Budget, out: Effects) -> bool:
    """Whether :meth:`MemoryGate._apply` has work after ``out``: a waiter, a kept body, a trim."""
    return bool(out.granted or out.evict or budget.pending or budget.idle)


def _granted(ticket: Ticket) -> bool:
    return ticket.verdict is Verdict.GRANTED


WHOLE_FRAME_EXTRA_ABOVE = 1024 * 1024
"""Frames up to this size need nothing beyond :data:`AMPLIFICATION` (the slack of the body's
items and buffers covers them)."""


class Lease:
    """One request's memory, held from before its body is read until its answer is written.

    ``async with gate.lease(length) as lease`` waits for the first step (or raises
    :class:`MemoryRefused`); the reader calls :meth:`arrived` as bytes come in and :meth:`read`
    at the end; leaving the block returns it all on every path (completion, error,
    cancellation, the app going away).
    """

    def __init__(
        self,
        gate: MemoryGate,
        length: int | None,
        *,
        key: Hashable = None,
        headers: int = 0,
        deadline: float | None = None,
        keyless: bool = False,
        progress: Callable[[], int] | None = None,
    ) -> None:
        self.gate = gate
        self.length = length
        self.key = key
        self.keyless = keyless
        self.progress = progress
        self.began = asyncio.get_running_loop().time()
        """Loop time the head arrived (the body's rate is measured from here)."""
        self._waiting_since: float | None = None
        self.base = MIN_RESERVATION + max(headers, 0)
        """Held whatever the body: the connection's buffers and objects, and the head."""
        self.deadline = deadline
        self.body = 0
        """Bytes of body read so far."""
        self.covered = 0
        """Body bytes the reservation pays for (read so far plus the step ahead)."""
        self.waited = 0.0
        """Seconds spent waiting for memory (the body's rate clock does not run meanwhile)."""
        self._limit = length if length is not None else gate.body_limit
        self.frame = 0
        """Budget bytes promised beyond the body for its frame's copy (:meth:`whole_frame`)."""
        self._ticket: Ticket | None = None

    @property
    def held(self) -> int:
        """Bytes this request holds in the budget now."""
        return self._ticket.want if self._ticket is not None else 0

    async def __aenter__(self) -> Lease:
        first = min(self._limit, STEP)
        need = AMPLIFICATION * self._limit + self.base
        if self.length is None:  # a promise of unknown size: at most what an empty budget holds
            need = max(min(need, self.gate.budget.capacity - self.gate.budget.heads), AMPLIFICATION * first + self.base)
        elif self.gate.whole_frames and self.length > WHOLE_FRAME_EXTRA_ABOVE:
            # Its frame's copy comes after the body (whole_frame): promised with it (as far as
            # an empty budget holds it), so that admitted bodies can all be sent, not only read.
            self.frame = max(min(self.length // 2, self.gate.budget.capacity - self.gate.budget.heads - need), 0)
            need += self.frame
        # While it waits, the start of the body is in the server's read buffers already.
        buffered = min(self.length if self.length is not None else _BUFFERED, _BUFFERED) + MIN_RESERVATION
        loop = asyncio.get_running_loop()
        started = loop.time()
        ticket = await self.gate._acquire(
            AMPLIFICATION * first + self.base,
            buffered,
            key=self.key,
            need=need,
            deadline=self.deadline,
            keyless=self.keyless,
        )
        self._ticket = ticket
        self.waited += loop.time() - started
        self.covered = first
        if ticket.need > ticket.want:
            self.gate._reading[ticket] = self
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._ticket is not None:
            ticket, self._ticket = self._ticket, None
            self.gate._reading.pop(ticket, None)
            if _due(self.gate.budget, out := self.gate.budget.release(ticket)):
                self.gate._apply(out)

    def evidence(self, now: float) -> tuple[int, bool]:
        """What this body may still grow by (budget bytes) as far as its observed rate can
        deliver it before its deadline, and whether that rate is too slow to finish it in time
        (only a declared length can be judged so)."""
        sent = self.progress() if self.progress is not None else self.body
        paused = self.waited + (now - self._waiting_since if self._waiting_since is not None else 0.0)
        rate = sent / max(now - self.began - paused, _RATE_WINDOW)
        left = max(self.deadline - now, 0.0) if self.deadline is not None else math.inf
        deliverable = rate * left if rate > 0 else 0.0
        rest = max(self._limit - self.covered, 0)
        promise = AMPLIFICATION * int(min(rest, deliverable))
        slow = self.length is not None and sent + deliverable < self._limit
        return promise + (0 if slow else self.frame), slow

    async def arrived(self, size: int) -> None:
        """``size`` bytes of body are read: pay for the next step before more is read, waiting
        for memory like a new request if it is not free now (the rest of the body stays
        unread, in the kernel, meanwhile)."""
        self.body = size
        if size + _BUFFERED <= self.covered or self.covered >= self._limit:
            return
        ticket = self._ticket
        assert ticket is not None, "arrived outside the lease"
        most = (ticket.need - self.frame - self.base) // AMPLIFICATION  # the body this ticket may ever hold
        if size > most:
            MEMORY_REFUSALS.labels("too_large").inc()
            raise MemoryTooLarge("The request body grew larger than the sidecar's memory budget can hold.")
        target = min(size + STEP, self._limit, most)
        more = AMPLIFICATION * (target - self.covered)
        if more <= 0:
            return
        loop = asyncio.get_running_loop()
        started = self._waiting_since = loop.time()
        try:
            await self.gate._more(ticket, more)
        finally:
            self._waiting_since = None
            self.waited += loop.time() - started
        self.covered = target

    def read(self, size: int) -> None:
        """The whole body is read (``size`` bytes): it no longer grows, and a step paid ahead
        of a body of unknown length is given back."""
        self.body = size
        ticket = self._ticket
        if ticket is None:
            return
        budget = self.gate.budget
        if self.gate._reading.pop(ticket, None) is not None:  # admitted in steps: its promise ends
            self.gate._apply(budget.done_reading(ticket, self.frame))
        if self.covered > size:
            self.gate._apply(budget.settle(ticket, AMPLIFICATION * size + self.base))
            self.covered = size

    async def whole_frame(self, size: int) -> None:
        """A ``size``-byte frame is about to go upstream in one piece (``pool.fragment_bytes`` 0):
        masked into a copy, partly buffered by the transport, it costs ~2.5x its size
        (tracemalloc, 15 MiB frame), half a frame more than :data:`AMPLIFICATION` pays for
        beyond :data:`WHOLE_FRAME_EXTRA_ABOVE`. Reserve that half until :meth:`sent` (waiting
        like a body step). With a gate of ``whole_frames`` it was promised with the body
        (:attr:`frame`), so the bodies admitted together can all take it: a body read in full
        never waits for a frame step that only other bodies read in full could free."""
        ticket = self._ticket
        if ticket is None or size <= WHOLE_FRAME_EXTRA_ABOVE:
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self.gate._more(ticket, size // 2)
        self.waited += loop.time() - started

    def sent(self) -> None:
        """The frame went to the upstream socket: from now on the request holds its body only."""
        if self._ticket is not None:
            if _due(self.gate.budget, out := self.gate.budget.settle(self._ticket, self.body + self.base)):
                self.gate._apply(out)
