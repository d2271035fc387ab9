"""The inbox of one lane's response in flight on an upstream socket.

:class:`proxy.upstream.ws.UpstreamSocket` fills it as its reader places each event; the turn
that leased the lane reads it (:meth:`Inbox.burst`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from proxy.errors import UpstreamError, UpstreamTimeout

__all__ = ["TERMINAL", "Inbox"]

TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "response.done", "error"})


class Inbox:
    """The events of one lane's response in flight, filled by the socket's reader.

    A turn reads with :meth:`burst`: everything that arrived meanwhile, in order, so the turn
    writes a whole read's events to the app at once. The reader wakes the waiting turn once
    per read (:meth:`put` of the read's second event finds the waiter already woken). An abandoned turn's inbox
    *drains*: events are dropped until the terminal one, then ``on_drained`` runs.

    A wait times out at its own deadline, but the timer is not armed and cancelled per wait:
    one stays armed across waits and is re-armed only when it fires before the deadline of the
    wait then under way (a later one) or a wait asks for an earlier one. :meth:`close` (the
    socket's ``close_inbox``) cancels it, as does a wait that ends without events.
    """

    __slots__ = (
        "_deadline", "_loop", "_timer", "_timer_at", "_waiter", "arrived", "draining", "error", "frames", "lane",
        "on_drained", "seen",
    )  # fmt: skip

    def __init__(self, lane: str | None) -> None:
        self.lane = lane
        self.frames: deque[tuple[bytes, dict[str, Any]]] = deque()
        self.error: UpstreamError | None = None
        self.draining = False
        self.on_drained: Callable[[], None] | None = None
        self.seen = False
        """An event of this lane arrived."""
        self.arrived = 0.0
        """``time.perf_counter()`` when the kernel received the read that brought this lane's
        terminal event (the upstream's time ends there, however late the loop reads it), or
        when the loop read an earlier event's (a getsockopt per read is not worth it)."""
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        """Armed at ``_timer_at`` (loop time), no later than the waiting turn's ``_deadline``: kept
        across waits (an arm and a cancel per wait cost more than a rare early firing)."""
        self._timer_at = self._deadline = 0.0

    def put(self, raw: bytes, event: dict[str, Any], at: float = 0.0) -> None:
        """Hand on one event; ``at``: when the kernel received the read that brought it."""
        self.seen = True
        self.arrived = at or time.perf_counter()
        if self.draining:
            self.close()
            if event.get("type") in TERMINAL and self.on_drained is not None:
                callback, self.on_drained = self.on_drained, None
                callback()
            return
        self.frames.append((raw, event))
        self._wake()

    def fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()
        if self._waiter is None:
            self.close()  # no wait comes after an error that is not raised

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def burst(self, timeout: float) -> list[tuple[bytes, dict[str, Any]]]:
        """Every event already here, or, if none, every event of the next read that brings
        one: one wake-up per read of the socket, however many events it carried.

        Raises:
            UpstreamClosed | UpstreamProtocolError: the socket failed (and nothing is left).
            UpstreamTimeout: nothing arrived within ``timeout``.
        """
        if not self.frames:
            await self._wait(timeout)
        frames = list(self.frames)
        self.frames.clear()
        return frames

    async def _wait(self, timeout: float) -> None:
        """Until an event or the error is here (raised if no event is)."""
        if self.error is not None:
            raise self.error
        loop = self._loop = asyncio.get_running_loop()
        deadline = self._deadline = loop.time() + timeout
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at, self._timer = deadline, loop.call_at(deadline, self._due)
        waiter = self._waiter = loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
            if not self.frames:
                self.close()  # a timeout, an error or a cancelled wait: the turn stops waiting
        if not self.frames:
            if self.error is not None:
                raise self.error
            raise UpstreamTimeout(f"The upstream sent nothing for {timeout:g} s.")

    def _due(self) -> None:
        """The timer fired: the waiting turn's deadline passed, or it moved later (re-armed)."""
        self._timer = None
        if self._waiter is None or self._loop is None:
            return  # nobody waits: the next wait arms its own
        if self._deadline <= self._timer_at:
            self._wake()
        else:
            self._timer_at, self._timer = self._deadline, self._loop.call_at(self._deadline, self._due)

    def close(self) -> None:
        """No more waits: the timer goes (an armed one would keep the inbox alive until it fires)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def get(self, timeout: float) -> tuple[bytes, dict[str, Any]]:
        """The next event of this lane: ``(raw bytes, parsed object)``.

        Raises:
            UpstreamClosed | UpstreamProtocolError: the socket failed.
            UpstreamTimeout: nothing arrived within ``timeout``.
        """
        if not self.frames:
            await self._wait(timeout)
        return self.frames.popleft()
