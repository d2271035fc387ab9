"""WebSocket mode (protocol.md §1, §4.2): one connection, its lanes, caches and limits.

Each lane (default = ``None``, or a named ``stream_id``) has a FIFO queue and one worker, so a
lane never overlaps itself while lanes run concurrently under a per-connection in-flight limit.
Each lane caches its latest finished response; any lane's latest is a hit (forks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson
from aiohttp import WSMsgType, web

from . import errors
from .engine import new_id
from .errors import ApiError
from .faults import FaultQueue
from .network import DelayLine
from .state import ConnectionStats, EmulatorState
from .steering import Steering
from .wslane import STREAM_ID, Gone, Lane, admission_facts
from .wsturn import process

__all__ = ["WsConnection"]

JSON = Any
_log = logging.getLogger("upshift_emulator")


def flat_create(event: dict[str, JSON]) -> dict[str, JSON]:
    """A ``response.create`` in either envelope (protocol.md §7): the flat one as it is; the nested
    ``{"type": "response.create", "response": {...}}`` as its body plus the envelope's other keys."""
    nested = event.get("response")
    if not isinstance(nested, dict) or "model" in event:
        return event
    return {**nested, **{k: v for k, v in event.items() if k != "response"}}


class WsConnection:
    """Serve one upgraded WebSocket until it closes."""

    def __init__(
        self,
        state: EmulatorState,
        faults: FaultQueue,
        ws: web.WebSocketResponse,
        request: web.Request,
        owner: str,
    ) -> None:
        self.state = state
        self.config = state.config
        self.faults = faults
        self.ws = ws
        self.request = request
        self.owner = owner
        self.id = new_id("conn", 8)
        self.opened = time.monotonic()
        self.lanes: dict[str | None, Lane] = {}
        self.stats = ConnectionStats(identity=owner, opened_at=time.time())
        self._send_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(self.config.ws_max_in_flight)
        one_way = state.latency.rtt_ms / 2000.0
        self._line = DelayLine(one_way, ws.send_str, state) if one_way > 0 else None
        self._inbound = DelayLine(one_way, self._delayed_text, state, "inbound_delays") if one_way > 0 else None
        self.steering = Steering(self)
        """``response.steer`` state of this connection (``steering.py``)."""

    # -- I/O -------------------------------------------------------------------------------------
    async def send(self, payload: dict[str, JSON]) -> None:
        """The single write path (one frame per event; through the RTT delay line when one is set)."""
        if self.ws.closed or (self._line is not None and self._line.failed is not None):
            raise Gone
        data = orjson.dumps(payload).decode()
        if self._line is not None:
            self._line.put(data)
            return
        async with self._send_lock:
            try:
                await self.ws.send_str(data)
            except (ConnectionError, RuntimeError) as exc:
                raise Gone from exc

    async def _flush(self) -> None:
        if self._line is not None:
            await self._line.flush()

    async def abort(self) -> None:
        """Drop the TCP connection (the client sees 1006) once the frames already sent have arrived."""
        await self._flush()
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    async def close(self, code: int, message: bytes = b"emulator fault") -> None:
        """Close with ``code`` (behind the frames already sent)."""
        await self._flush()
        await self.ws.close(code=code, message=message)

    # -- connection loop ------------------------------------------------------------------------
    async def run(self) -> None:
        """Read frames until the socket closes, then drop every lane's cache."""
        state = self.state
        state.stats.connections[self.id] = self.stats
        state.stats.ws_connections["opened"] += 1
        state.stats.ws_connections["open"] += 1
        try:
            await self._read_loop()
        finally:
            for lane in self.lanes.values():
                if lane.task is not None:
                    lane.task.cancel()
            for lane in self.lanes.values():
                if lane.task is not None:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await lane.task
            self.lanes.clear()
            for line in (self._inbound, self._line):
                if line is not None:
                    await line.stop()
            self.stats.open = False
            self.stats.close_code = self.ws.close_code
            state.stats.ws_connections["open"] -= 1
            state.stats.ws_connections["closed"] += 1

    async def _read_loop(self) -> None:
        idle = self.config.ws_idle_timeout_s
        while not self.ws.closed:
            try:
                msg = await self.ws.receive(timeout=idle or None)
            except TimeoutError:
                if not any(lane.busy or not lane.queue.empty() for lane in self.lanes.values()):
                    await self.ws.close(code=self.config.ws_idle_close_code, message=b"idle timeout")
                    return
                continue
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                size = len(msg.data.encode() if isinstance(msg.data, str) else msg.data)
                self.state.stats.bytes_received["ws"] += size
                self.state.stats.ws_frames_received += 1
                self.stats.bytes_received += size
                self.stats.frames_received += 1
            if msg.type == WSMsgType.TEXT and self._inbound is not None:
                self._inbound.put(msg.data)  # handled RTT/2 after arrival (network.py)
            elif msg.type == WSMsgType.TEXT:
                with contextlib.suppress(Gone):
                    await self._on_text(msg.data, size)
            elif msg.type == WSMsgType.BINARY:
                error = ApiError(400, "Binary frames are not supported; send JSON text frames.")
                with contextlib.suppress(Gone):
                    await self.send(error.ws_event())
                await self.close(1003, b"binary frames are not supported")
                return
            else:
                return

    async def _delayed_text(self, data: str) -> None:
        """A client frame handled RTT/2 after it arrived; a bug here must not stop the delay line."""
        try:
            await self._on_text(data, len(data.encode()))
        except Gone:
            pass
        except Exception:
            _log.exception("emulator: handling a delayed frame failed; closing the socket")
            await self.close(1011, b"internal error")

    async def _on_text(self, data: str, size: int) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            await self.send(ApiError(400, errors.INVALID_JSON_MESSAGE).ws_event())
            return
        self.state.received("ws", event)
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.create":
            await self._on_create(flat_create(event), size)
        elif kind == "response.steer":
            await self.steering.on_steer(event)
        else:
            message = f"Invalid value: '{kind}'. Supported values are: 'response.create' and 'response.steer'."
            await self.send(ApiError(400, message, param="type", code="invalid_value").ws_event())

    async def _refuse(self, error: ApiError, stream_id: str | None = None) -> None:
        self.state.stats.errors["ws"] += 1
        self.stats.errors += 1
        await self.send(error.ws_event(stream_id))

    async def _on_create(self, event: dict[str, JSON], size: int) -> None:
        """Admission (age limit, lanes and their limits), then the lane's FIFO queue."""
        self.state.stats.requests["ws"] += 1
        self.stats.requests += 1
        stream_id = event.get("stream_id")
        facts = {**admission_facts(event), "connection_id": self.id}
        aged = self.faults.take({"age_limit"}, "ws", facts)
        if aged is not None:
            self.state.stats.fault_fired("age_limit")
        if aged is not None or time.monotonic() - self.opened >= self.config.ws_max_age_s:
            await self._refuse(errors.connection_limit_reached(self.config.ws_max_age_s))
            if self.config.ws_close_on_age_limit:
                await self.close(self.config.ws_age_limit_close_code, b"connection age limit")
            return
        mode = self.config.ws_stream_ids
        if "stream_id" in event and mode != "lanes":  # a lane-less upstream (xAI, strict gateways)
            if mode == "close":
                self.state.stats.errors["ws"] += 1
                await self.close(self.config.ws_reject_close_code, b"unknown parameter: stream_id")
            else:
                await self._refuse(errors.unknown_parameter("stream_id"))
            return
        if stream_id is not None and not (isinstance(stream_id, str) and STREAM_ID.match(stream_id)):
            await self._refuse(errors.invalid_stream_id())
            return
        if stream_id is not None and stream_id not in self.lanes:
            if sum(1 for key in self.lanes if key is not None) >= self.config.ws_max_named_streams:
                await self._refuse(errors.stream_limit_reached(self.config.ws_max_named_streams), stream_id)
                return
            self.stats.named_streams += 1
        lane = self.lanes.get(stream_id)
        if lane is None:
            lane = self.lanes[stream_id] = Lane(stream_id)
            lane.task = asyncio.create_task(self._worker(lane))
        lane.queue.put_nowait((event, size))

    # -- lanes ----------------------------------------------------------------------------------
    async def _worker(self, lane: Lane) -> None:
        while True:
            event, size = await lane.queue.get()
            async with self._slots:
                lane.busy = True
                self.stats.in_flight += 1
                self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
                try:
                    await process(self, lane, event, size)
                except Gone:
                    return
                finally:
                    lane.busy = False
                    self.stats.in_flight -= 1
