"""Play an :class:`~.engine.Execution` to a transport, paced by the latency model and cut by faults.

The same player serves WebSocket frames, SSE and non-streamed HTTP (a sink that only collects).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from .config import LatencyModel
from .engine import Execution, Turn, failed_object
from .events import lifecycle, stamp
from .faults import Fault

__all__ = ["CUT_KINDS", "Outcome", "Sink", "play"]

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


async def play(
    execution: Execution,
    turn: Turn,
    sink: Sink,
    *,
    latency: LatencyModel,
    fault: Fault | None = None,
) -> Outcome:
    """Send the events with pacing; a ``fail``/``drop``/``close`` fault fires after ``events_before``."""
    await _sleep(latency.overhead_ms / 1000.0)
    cut = fault.events_before if fault is not None and fault.kind in CUT_KINDS else None
    events = execution.events
    warmup = not turn.generate
    started = time.monotonic()
    tokens_sent = 0
    for index in range(len(events) + 1):
        if cut is not None and index == cut and fault is not None:
            return await _cut(fault, turn, sink, index)
        if index == len(events):
            break
        event = events[index]
        if warmup and index == len(events) - 1:
            await _sleep(latency.rebuild_seconds(turn.rebuild_bytes))
        if event.output:
            await _sleep(latency.rebuild_seconds(turn.rebuild_bytes) + latency.ttft_ms / 1000.0)
            started = time.monotonic()
        if event.tokens and latency.tokens_per_second > 0:
            tokens_sent += event.tokens
            await _sleep(started + latency.token_seconds(tokens_sent) - time.monotonic())
        await sink.send(stamp(event.payload, index, turn.stream_id))
    return Outcome(str(execution.final["status"]), execution.final, len(events))


async def _cut(fault: Fault, turn: Turn, sink: Sink, index: int) -> Outcome:
    if fault.kind == "fail":
        failed = failed_object(turn, fault.message or "An error occurred while processing your request.")
        await sink.send(stamp(lifecycle("response.failed", failed), index, turn.stream_id))
        return Outcome("failed", failed, index + 1)
    failed = failed_object(turn, "connection dropped by fault injection")
    if fault.kind == "drop":
        await sink.abort()
        return Outcome("dropped", failed, index)
    await sink.close(fault.close_code)
    return Outcome("closed", failed, index)
