"""Network distance between the client and the emulator (``LatencyModel.rtt_ms`` / ``connect_ms``).

The model, chosen to be faithful and simple:

* **RTT** is split evenly: a message takes ``rtt_ms / 2`` in each direction. A client message
  (an HTTP request, a WebSocket frame) is handled ``rtt/2`` after it arrived; a server message
  (the start of an HTTP response, i.e. its headers; each WebSocket frame) reaches the wire ``rtt/2``
  after the emulator produced it. Delivery is *pipelined*: a stream is shifted by ``rtt/2``, not
  stretched by ``rtt/2`` per event (a delay line per WebSocket, the header delay for SSE, after
  which the body follows at the generator's own pace). A plain HTTP request therefore costs one
  RTT more, and so does the upgrade request/101 exchange of a WebSocket.
* **Connection setup** (``connect_ms``: TCP + TLS handshakes, typically 2 x RTT with TLS 1.3) is paid
  once per TCP connection, before its first request is handled: every WebSocket upgrade made on a
  fresh connection (as the SDK and ``websockets`` always do) and the first HTTP request of a new
  connection, never a request on a kept-alive one.

Control endpoints (``/_emulator``) are never delayed. Counters: ``stats.network``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .state import EmulatorState

__all__ = ["DelayLine", "delay_inbound", "delay_outbound"]


def _first_request(state: EmulatorState, transport: Any) -> bool:
    """True the first time a TCP connection is seen (closed ones are forgotten; transports are not
    always weak-referenceable, hence a table keyed by ``id`` that holds them until they close)."""
    seen = state.transports
    key = id(transport)
    if seen.get(key) is transport:
        return False
    for other in [k for k, t in seen.items() if t.is_closing()]:
        del seen[other]
    seen[key] = transport
    return True


async def delay_inbound(request: web.Request, state: EmulatorState) -> None:
    """Before handling a request: the handshake of a new connection, then the request's RTT/2."""
    latency = state.latency
    if request.transport is not None and _first_request(state, request.transport):
        state.stats.network["new_connections"] += 1
        if latency.connect_ms > 0:
            state.stats.network["connect_delays"] += 1
            await asyncio.sleep(latency.connect_ms / 1000.0)
    if latency.rtt_ms > 0:
        state.stats.network["inbound_delays"] += 1
        await asyncio.sleep(latency.rtt_ms / 2000.0)


async def delay_outbound(state: EmulatorState) -> None:
    """Before a response's headers (HTTP, and the WebSocket 101) leave: RTT/2."""
    if state.latency.rtt_ms > 0:
        state.stats.network["outbound_delays"] += 1
        await asyncio.sleep(state.latency.rtt_ms / 2000.0)


class DelayLine:
    """Deliver WebSocket frames ``one_way_s`` after they were produced, in order (pipelined).

    Used both ways: server frames (``write`` sends them; counter ``outbound_delays``) and client frames
    (``write`` handles them; ``inbound_delays``).
    """

    def __init__(
        self,
        one_way_s: float,
        write: Callable[[str], Awaitable[None]],
        state: EmulatorState,
        counter: str = "outbound_delays",
    ) -> None:
        self._counter = counter
        self._delay = one_way_s
        self._write = write
        self._state = state
        self._queue: collections.deque[tuple[float, str]] = collections.deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.failed: BaseException | None = None
        self._task = asyncio.create_task(self._run())

    def put(self, data: str) -> None:
        """Queue one frame; it is written ``one_way_s`` from now."""
        self._queue.append((time.monotonic() + self._delay, data))
        self._state.stats.network[self._counter] += 1
        self._idle.clear()
        self._wake.set()

    async def flush(self) -> None:
        """Wait until every queued frame was written (or writing failed)."""
        if self._idle.is_set() or self._task.done():
            return
        waiter = asyncio.ensure_future(self._idle.wait())
        try:
            await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            deadline, data = self._queue[0]
            wait = deadline - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._queue.popleft()
            try:
                await self._write(data)
            except (ConnectionError, RuntimeError) as exc:
                self.failed = exc
                self._queue.clear()
                self._idle.set()
                return

    async def stop(self) -> None:
        """Cancel the writer (frames not yet written are lost, like bytes in flight on a closed socket)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
