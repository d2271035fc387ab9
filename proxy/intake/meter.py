"""The memory a downstream WebSocket session's messages hold, paid as their bytes arrive
(:class:`MessageMeter`, drawing from the :class:`~proxy.intake.memory.MemoryGate`)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

from proxy.core.budget import MIN_RESERVATION, STEP, Ticket
from proxy.errors import MemoryBusy
from proxy.intake.memory import MESSAGE_AMPLIFICATION, MemoryGate
from proxy.observe.metrics import MEMORY_REFUSALS
from proxy.reasons import MemoryRefusal

__all__ = ["IDLE_COVER", "MessageMeter"]


IDLE_COVER = 64 * 1024
"""Message bytes a WebSocket session's :class:`MessageMeter` pays for ahead while it waits for
the next message (about one read from its socket; more pauses it)."""


class MessageMeter:
    """Memory for the messages a downstream WebSocket session receives, paid as their bytes
    arrive (the frames' bytes are counted as the server reads them, before a message is
    assembled): the session holds :data:`MESSAGE_AMPLIFICATION` × what it read and has not
    finished with, plus :data:`IDLE_COVER` ahead; when bytes arrive beyond that, reading pauses
    (the app's TCP connection backs up) until the budget grants the next step, for at most
    ``limits.memory_wait_seconds`` (then :class:`MemoryBusy`). A message is finished once sent
    on (:meth:`done`), and the session shrinks back. Sessions receiving a message larger than
    the idle step take turns: at most as many at once as messages of ``largest`` bytes fit the
    capacity (at least one), so partly read messages never hold each other up.

    Args:
        gate: The memory gate.
        largest: The largest message a session may receive.
        key: Whose session it is (the caller's tenant).
        keyless: Opened without a credential (the keyless quota).
    """

    def __init__(self, gate: MemoryGate, largest: int, *, key: Hashable = None, keyless: bool = False) -> None:
        self.gate = gate
        self.key = key
        self.keyless = keyless
        self.read = 0
        """Bytes read and not yet finished with (the message being assembled, queued or sent)."""
        self.covered = 0
        """Bytes the session's ticket pays for."""
        self._ticket: Ticket | None = None
        self._turns = gate.message_turns(largest)
        self._turn = False

    @property
    def held(self) -> int:
        """Bytes the session holds in the budget now."""
        return self._ticket.want if self._ticket is not None else 0

    async def open(self) -> None:
        """Take the session's first step (waiting for memory like a request)."""
        self._ticket = await self.gate._acquire(
            MESSAGE_AMPLIFICATION * IDLE_COVER + MIN_RESERVATION, key=self.key, keyless=self.keyless
        )
        self.covered = IDLE_COVER

    def arrived(self, size: int) -> bool:
        """``size`` bytes were read; whether the session must pause (they go past what it paid)."""
        self.read += size
        return self.read > self.covered

    async def grow(self) -> None:
        """Pay for what was read and one step more (waits, unread; raises :class:`MemoryBusy`)."""
        ticket = self._ticket
        assert ticket is not None, "grow outside an open meter"
        if not self._turn:
            try:
                await asyncio.wait_for(self._turns.acquire(), self.gate.wait_seconds)
            except TimeoutError:
                MEMORY_REFUSALS.labels(MemoryRefusal.WAIT_TIMEOUT).inc()
                raise MemoryBusy(
                    f"The sidecar's memory budget stayed taken for {self.gate.wait_seconds:g} s; retry."
                ) from None
            self._turn = True
        while self.read > self.covered:
            target = self.read + STEP
            await self.gate._more(ticket, MESSAGE_AMPLIFICATION * (target - self.covered))
            self.covered = target

    def done(self, size: int) -> None:
        """A ``size``-byte message (frame headers included) was sent on or dropped."""
        self.read = max(self.read - size, 0)
        ticket = self._ticket
        if ticket is not None and self.covered > self.read + IDLE_COVER:
            self.covered = max(self.read, IDLE_COVER)
            hold = MESSAGE_AMPLIFICATION * self.covered + MIN_RESERVATION
            self.gate._apply(self.gate.budget.settle(ticket, hold))
        if self._turn and self.read <= IDLE_COVER:
            self._turn = False
            self._turns.release()

    def close(self) -> None:
        """The session is over: everything it held returns."""
        if self._turn:
            self._turn = False
            self._turns.release()
        if self._ticket is not None:
            ticket, self._ticket = self._ticket, None
            self.gate._apply(self.gate.budget.release(ticket))
