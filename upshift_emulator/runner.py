"""Play an :class:`~.engine.Execution` to a transport, paced by the latency model and cut by faults.

The same player serves WebSocket frames, SSE and non-streamed HTTP (a sink that only collects).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .config import LatencyModel
from .engine import Execution, Turn, failed_object, steered_object
from .events import lifecycle, stamp
from .faults import Fault, FaultQueue, Held

__all__ = ["CUT_KINDS", "Hold", "Interrupt", "Outcome", "Sink", "play"]

JSON = Any
CUT_KINDS = frozenset({"fail", "drop", "close"})


class Sink(Protocol):
    """Where events go."""

    async def send(self, payload: dict[str, JSON]) -> None:
        """Deliver one stamped event."""

    async def abort(self) -> None:
        """Drop the connection without a close handshake."""

    async def close(self, code: int) -> None:
        """Close the connection with ``code`` (HTTP: same as abort)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a played response ended: ``completed`` / ``incomplete`` / ``failed`` / ``dropped`` / ``closed``."""

    status: str
    response: dict[str, JSON]
    events_sent: int


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


class Interrupt(Protocol):
    """Asked at each safe output boundary whether to stop the response there (steering)."""

    def __call__(self, index: int) -> bool:
        """True: end the response before event ``index`` (an ``output_item.added`` or the terminal)."""


@dataclass(slots=True)
class Hold:
    """A ``hold`` fault to apply to this response, and where to wait for its release."""

    fault: Fault
    queue: FaultQueue
    connection_id: str | None = None


async def _hold(
    hold: Hold, turn: Turn, sink: Sink, index: int, settle: Callable[[dict[str, JSON]], object] | None
) -> Outcome | None:
    held = Held(hold.fault, hold.connection_id, turn.stream_id, index, asyncio.get_running_loop(), asyncio.Event())
    action = await hold.queue.wait_held(held)
    if action == "continue":
        return None
    cut = Fault(kind=action, close_code=hold.fault.close_code, message=hold.fault.message)
    return await _cut(cut, turn, sink, index, settle)


async def play(
    execution: Execution,
    turn: Turn,
    sink: Sink,
    *,
    latency: LatencyModel,
    fault: Fault | None = None,
    hold: Hold | None = None,
    interrupt: Interrupt | None = None,
    settle: Callable[[dict[str, JSON]], object] | None = None,
) -> Outcome:
    """Send the events with pacing; a ``fail``/``drop``/``close`` fault fires after ``events_before``.

    A safeguard review pauses ``execution.safeguard_s`` before ``execution.safeguard_at``.
    ``hold`` pauses before event ``hold.fault.events_before``; ``interrupt`` (steering) may end the
    response with ``response.incomplete`` (``steered``) at an item boundary. ``settle`` gets the
    final response object right before its terminal event is sent, so that whatever the caller
    records (the oracle record, the store) is there when a client sees the response end.
    """
    await _sleep(latency.overhead_ms / 1000.0)
    cut = fault.events_before if fault is not None and fault.kind in CUT_KINDS else None
    pause = hold.fault.events_before if hold is not None else None
    events = execution.events
    warmup = not turn.generate
    started = time.monotonic()
    tokens_sent = 0
    items_done = 0
    for index in range(len(events) + 1):
        if pause is not None and index == pause and hold is not None:
            ended = await _hold(hold, turn, sink, index, settle)
            if ended is not None:
                return ended
        if cut is not None and index == cut and fault is not None:
            return await _cut(fault, turn, sink, index, settle)
        if index == len(events):
            break
        if index == execution.safeguard_at:  # a safeguard review: seconds of silence mid-stream
            await _sleep(execution.safeguard_s)
        event = events[index]
        kind = event.payload["type"]
        boundary = index >= 2 and (kind == "response.output_item.added" or index == len(events) - 1)
        if interrupt is not None and boundary and turn.generate and interrupt(index):
            steered = steered_object(turn, execution.final, items_done)
            if settle is not None:
                settle(steered)
            await sink.send(stamp(lifecycle("response.incomplete", steered), index, turn.stream_id))
            return Outcome("incomplete", steered, index + 1)
        if kind == "response.output_item.done":
            items_done += 1
        if warmup and index == len(events) - 1:
            await _sleep(latency.rebuild_seconds(turn.rebuild_bytes))
        if event.output:
            await _sleep(latency.rebuild_seconds(turn.rebuild_bytes) + latency.ttft_ms / 1000.0)
            started = time.monotonic()
        if event.tokens and latency.tokens_per_second > 0:
            tokens_sent += event.tokens
            await _sleep(started + latency.token_seconds(tokens_sent) - time.monotonic())
        if settle is not None and index == len(events) - 1:
            settle(execution.final)
        await sink.send(stamp(event.payload, index, turn.stream_id))
    return Outcome(str(execution.final["status"]), execution.final, len(events))


async def _cut(
    fault: Fault, turn: Turn, sink: Sink, index: int, settle: Callable[[dict[str, JSON]], object] | None = None
) -> Outcome:
    if fault.kind == "fail":
        failed = failed_object(turn, fault.message or "An error occurred while processing your request.")
        if settle is not None:
            settle(failed)
        await sink.send(stamp(lifecycle("response.failed", failed), index, turn.stream_id))
        return Outcome("failed", failed, index + 1)
    failed = failed_object(turn, "connection dropped by fault injection")
    if fault.kind == "drop":
        await sink.abort()
        return Outcome("dropped", failed, index)
    await sink.close(fault.close_code)
    return Outcome("closed", failed, index)
