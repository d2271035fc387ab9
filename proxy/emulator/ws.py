"""WebSocket mode (protocol.md §1, §4.2): one connection, its lanes, caches and limits.

Each lane (default = ``None``, or a named ``stream_id``) has a FIFO queue and one worker, so a
lane never overlaps itself while lanes run concurrently under a per-connection in-flight limit.
Each lane caches its latest finished response; any lane's latest is a hit (forks).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import WSMsgType, web

from . import errors
from .engine import execute, finish, new_id, prepare
from .errors import ApiError
from .faults import Fault, FaultQueue
from .network import DelayLine
from .oracle import Segment
from .runner import CUT_KINDS, play
from .state import ConnectionStats, EmulatorState, ResponseRecord
from .validation import validate_body
from .wsreplies import Miss, not_found_events, steer_failed

__all__ = ["WsConnection"]

JSON = Any
STREAM_ID: Final = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")


@dataclass(slots=True)
class Lane:
    """One FIFO lane and its cached latest response."""

    key: str | None
    queue: asyncio.Queue[tuple[dict[str, JSON], int]] = field(default_factory=asyncio.Queue)
    latest: ResponseRecord | None = None
    task: asyncio.Task[None] | None = None
    busy: bool = False


class _Gone(Exception):
    """The socket is closed; stop the worker."""


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

    # -- I/O -------------------------------------------------------------------------------------
    async def send(self, payload: dict[str, JSON]) -> None:
        """The single write path (one frame per event; through the RTT delay line when one is set)."""
        if self.ws.closed or (self._line is not None and self._line.failed is not None):
            raise _Gone
        data = orjson.dumps(payload).decode()
        if self._line is not None:
            self._line.put(data)
            return
        async with self._send_lock:
            try:
                await self.ws.send_str(data)
            except (ConnectionError, RuntimeError) as exc:
                raise _Gone from exc

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
                with contextlib.suppress(_Gone):
                    await self._on_text(msg.data, size)
            elif msg.type == WSMsgType.BINARY:
                error = ApiError(400, "Binary frames are not supported; send JSON text frames.")
                with contextlib.suppress(_Gone):
                    await self.send(error.ws_event())
                await self.ws.close(code=1003, message=b"binary frames are not supported")
                return
            else:
                return

    async def _delayed_text(self, data: str) -> None:
        with contextlib.suppress(_Gone):
            await self._on_text(data, len(data.encode()))

    async def _on_text(self, data: str, size: int) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            await self.send(ApiError(400, errors.INVALID_JSON_MESSAGE).ws_event())
            return
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.create":
            await self._on_create(event, size)
        elif kind == "response.steer":
            await self.send(steer_failed(event))
        else:
            message = f"Invalid value: '{kind}'. Supported values are: 'response.create' and 'response.steer'."
            await self.send(ApiError(400, message, param="type", code="invalid_value").ws_event())

    async def _on_create(self, event: dict[str, JSON], size: int) -> None:
        self.state.stats.requests["ws"] += 1
        self.stats.requests += 1
        if time.monotonic() - self.opened >= self.config.ws_max_age_s:
            self.state.stats.errors["ws"] += 1
            await self.send(errors.connection_limit_reached(self.config.ws_max_age_s).ws_event())
            if self.config.ws_close_on_age_limit:
                await self.ws.close(code=self.config.ws_age_limit_close_code)
            return
        stream_id = event.get("stream_id")
        if stream_id is not None and not (isinstance(stream_id, str) and STREAM_ID.match(stream_id)):
            self.state.stats.errors["ws"] += 1
            await self.send(errors.invalid_stream_id().ws_event())
            return
        if stream_id is not None and stream_id not in self.lanes:
            if sum(1 for key in self.lanes if key is not None) >= self.config.ws_max_named_streams:
                self.state.stats.errors["ws"] += 1
                error = errors.stream_limit_reached(self.config.ws_max_named_streams)
                await self.send(error.ws_event(stream_id))
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
                    await self._process(lane, event, size)
                except _Gone:
                    return
                finally:
                    lane.busy = False
                    self.stats.in_flight -= 1

    def _facts(self, lane: Lane, body: dict[str, JSON]) -> dict[str, JSON]:
        prev = body.get("previous_response_id")
        return {
            "previous_response_id_present": prev is not None,
            "previous_response_id": prev,
            "stream_id": lane.key,
            "connection_id": self.id,
            "store": body.get("store") is not False,
            "generate": body.get("generate") is not False,
            "model": body.get("model"),
        }

    def _fire(self, kinds: set[str], facts: dict[str, JSON]) -> Fault | None:
        fault = self.faults.take(kinds, "ws", facts)
        if fault is not None:
            self.state.stats.fault_fired(fault.kind)
        return fault

    def _resolve(self, prev: str | None, forced: Fault | None) -> tuple[Segment, bool, bool]:
        """(base chain, cache hit, hydrated) for ``previous_response_id``; raises :class:`Miss`."""
        if prev is None:
            return Segment.root(), False, False
        stats, conn = self.state.stats, self.stats
        stats.continuations["ws"] += 1
        conn.continuations += 1
        if forced is not None:
            for lane in self.lanes.values():
                if lane.latest is not None and lane.latest.id == prev:
                    lane.latest = None
        else:
            for lane in self.lanes.values():
                if lane.latest is not None and lane.latest.id == prev:
                    stats.cache_hits += 1
                    conn.cache_hits += 1
                    return lane.latest.chain, True, False
            record = self.state.get(prev, self.owner)
            if record is not None:
                stats.hydrations["ws"] += 1
                conn.hydrations += 1
                return record.chain, False, True
        stats.misses["ws"] += 1
        conn.misses += 1
        raise Miss(prev, forced.shape if forced is not None else "nested")

    def _lookup_item(self, item_id: str) -> JSON | None:
        for lane in self.lanes.values():
            if lane.latest is not None:
                for item in lane.latest.output:
                    if isinstance(item, dict) and item.get("id") == item_id:
                        return item
        return self.state.item(item_id, self.owner)

    def _evict(self, lane: Lane, prev: str | None) -> None:
        """A failed same-lane continuation evicts its parent (protocol.md §1.7)."""
        if prev is not None and lane.latest is not None and lane.latest.id == prev:
            lane.latest = None

    async def _process(self, lane: Lane, event: dict[str, JSON], size: int) -> None:
        body = {k: v for k, v in event.items() if k not in ("type", "stream", "stream_id")}
        facts = self._facts(lane, body)
        prev = body.get("previous_response_id")
        delay = self._fire({"delay"}, facts)
        if delay is not None:
            await asyncio.sleep(delay.seconds)
        try:
            outcome_fault = self._fire({"error", *CUT_KINDS}, facts)
            if outcome_fault is not None and outcome_fault.kind == "error":
                raise outcome_fault.to_error()
            if body.get("background"):
                raise errors.background_over_ws()
            validate_body(body, transport="ws", config=self.config)
            forced = self._fire({"miss"}, facts) if prev is not None else None
            base, cached, hydrated = self._resolve(prev, forced)
            turn = prepare(
                body,
                config=self.config,
                transport="ws",
                owner=self.owner,
                base=base,
                lookup_item=self._lookup_item,
                input_bytes=size,
                cached=cached,
                hydrated=hydrated,
                connection_id=self.id,
                stream_id=lane.key,
            )
        except Miss as miss:
            self.state.stats.errors["ws"] += 1
            self.stats.errors += 1
            for payload in not_found_events(miss, lane.key, body):
                await self.send(payload)
            return
        except ApiError as error:
            self.state.stats.errors["ws"] += 1
            self.stats.errors += 1
            self._evict(lane, prev)
            await self.send(error.ws_event(lane.key))
            return
        if not turn.generate:
            self.state.stats.generate_false += 1
        execution = execute(turn, self.config)
        outcome = await play(execution, turn, self, latency=self.state.latency, fault=outcome_fault)
        record = finish(self.state, turn, outcome.response)
        if outcome.status in ("completed", "incomplete"):
            lane.latest = record
        else:
            self._evict(lane, prev)
        if outcome.status in ("dropped", "closed"):
            raise _Gone
