"""One response on one lane, as the pool lends it: :class:`Turn` (send, read, finish), and what
a completed answer over plain HTTP adopts (:func:`completed_response`)."""

from __future__ import annotations

import enum
import time
from typing import Any

import orjson

from proxy.core.lanes import LaneKey
from proxy.core.request import ParsedRequest
from proxy.core.waiting import Send
from proxy.upstream.ws import Inbox, UpstreamSocket
from proxy.wire import sse

__all__ = ["SocketUse", "Turn", "completed_response"]


def completed_response(body: bytes) -> dict[str, Any] | None:
    """The ``response`` of a ``response.completed`` in an SSE body, or a completed response
    object as a JSON body; ``None`` otherwise."""
    if body[:1] == b"{":
        try:
            found = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return found if isinstance(found, dict) and found.get("status") == "completed" else None
    try:
        events = sse.decode_all(body)
    except sse.EventTooLarge:
        return None
    for event in reversed(events):
        if event.event == "response.completed":
            try:
                found = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                return None
            response = found.get("response") if isinstance(found, dict) else None
            return response if isinstance(response, dict) and response.get("status") == "completed" else None
    return None


class SocketUse(enum.Enum):
    """A socket as the pool's counts see it (``busy``: at least one lane in flight)."""

    CONNECTING = "connecting"
    BUSY = "busy"
    IDLE = "idle"
    CLOSED = "closed"


class Turn:
    """One response on one lane, lent by :meth:`Pool.lease`."""

    __slots__ = (
        "inbox",
        "key",
        "measured",
        "prefix_state",
        "req",
        "response",
        "retire",
        "sent_at",
        "socket",
        "terminal",
    )

    def __init__(self, key: LaneKey, socket: UpstreamSocket, inbox: Inbox, measured: Send | None = None) -> None:
        self.key = key
        self.socket = socket
        self.inbox = inbox
        self.measured = measured
        """What the upstream's time for this response is a sample of (``None``: none)."""
        self.sent_at = 0.0
        """``time.perf_counter()`` when the frame was handed to the socket."""
        self.terminal = False
        self.response: dict[str, Any] | None = None
        self.req: ParsedRequest | None = None
        self.prefix_state: Any = None
        self.retire = False

    @property
    def stream_id(self) -> str | None:
        """The lane's ``stream_id``."""
        return self.key[1]

    async def send(self, frame: bytes) -> None:
        """Send the ``response.create`` frame."""
        self.sent_at = time.perf_counter()
        await self.socket.send(frame, self.key[1])

    @property
    def upstream_seconds(self) -> float:
        """The upstream's own time so far: from the frame's send to the arrival at the socket
        of the last event read (the terminal one once the response ended), wherever the
        sidecar's loop then was."""
        arrived = self.inbox.arrived
        return max(arrived - self.sent_at, 0.0) if self.sent_at and arrived else 0.0

    async def recv(self, timeout: float) -> tuple[bytes, dict[str, Any]]:
        """The lane's next event ``(raw, parsed)``."""
        return await self.inbox.get(timeout)

    async def burst(self, timeout: float) -> list[tuple[bytes, dict[str, Any]]]:
        """Every event already buffered, or those of the next read (:meth:`Inbox.burst`)."""
        return await self.inbox.burst(timeout)

    def finish(
        self,
        *,
        req: ParsedRequest | None = None,
        response: dict[str, Any] | None = None,
        prefix_state: Any = None,
        retire: bool = False,
    ) -> None:
        """The terminal event arrived; ``response`` (completed) becomes the lane's head."""
        self.terminal = True
        self.req, self.response, self.prefix_state, self.retire = req, response, prefix_state, retire
