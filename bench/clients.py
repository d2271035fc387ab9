"""Bench clients: one agent per conversation, three kinds.

* :class:`SdkHttpAgent` (setups **A** and **B**): the openai SDK, ``responses.create(stream=True)``
  with the full history each turn, echoing output as ``input += [item.model_dump() for item in
  output]``. A and B run this very class; only ``base_url`` differs.
* :class:`SdkWsAgent` (setup **C**): the SDK's ``responses.connect()``, sending only the new items
  with ``previous_response_id`` (OpenAI's WebSocket mode, as a native client uses it).
* :class:`RawHttpAgent` / :class:`RawWsAgent`: the same protocols on bare aiohttp / websockets,
  for measurements where the SDK's own client CPU would blur the sidecar's (overhead, sweeps).
  :class:`RawHttpAgent` sends byte-for-byte what the SDK path sends (same dicts, same echo).

Every turn yields a :class:`TurnRecord`; times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import aiohttp
import orjson
import websockets
from openai import AsyncOpenAI
from openai._models import construct_type
from openai.types.responses.response_output_item import ResponseOutputItem

__all__ = [
    "TERMINAL",
    "Agent",
    "RawHttpAgent",
    "RawWsAgent",
    "SdkHttpAgent",
    "SdkWsAgent",
    "SseResult",
    "TurnRecord",
    "echo_items",
    "post_sse",
    "WsTurn",
    "note_request_sent",
    "sdk_headers",
    "ws_create",
    "ws_turn",
]

JSON = Any
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
LIFECYCLE = frozenset({"response.created", "response.in_progress", "response.queued"})
"""Events before output: the first event of any other type is the "first token"."""
API_KEY = "sk-bench-0000"
READ_TIMEOUT = 120.0
"""Longest wait for the next event of a turn before the bench gives up on it (never hang)."""


def sdk_headers(api_key: str = API_KEY) -> dict[str, str]:
    """The headers the openai Python SDK sends (client-echo.md §2.1), for the raw clients."""
    return {
        "Authorization": f"Bearer {api_key}",
        "Content-Type": "application/json",
        "Accept": "application/json",
        "User-Agent": "OpenAI/Python 3.57.0",
        "X-Stainless-Lang": "python",
        "X-Stainless-Package-Version": "3.57.0",
        "X-Stainless-OS": "Linux",
        "X-Stainless-Arch": "x64",
        "X-Stainless-Runtime": "CPython",
        "X-Stainless-Runtime-Version": "3.11.9",
        "X-Stainless-Async": "async:asyncio",
        "x-stainless-retry-count": "0",
        "x-stainless-read-timeout": "600",
    }


def echo_items(output: list[JSON]) -> list[JSON]:
    """How an SDK app echoes raw output dicts: typed items, then ``model_dump()`` (adds nulls)."""
    typed: list[Any] = [construct_type(value=item, type_=cast(Any, ResponseOutputItem)) for item in output]
    return [item.model_dump() for item in typed]


@dataclass(slots=True)
class TurnRecord:
    """One model turn as the client saw it."""

    start: float
    ttfb: float
    """Seconds until the first event (SSE bytes or WS frame)."""
    total: float
    """Seconds until the terminal event."""
    request_bytes: int
    """Body (HTTP) or frame (WS) size the client sent."""
    response_id: str
    status: str
    overhead_ms: float | None = None
    """The sidecar's ``x-upshift-overhead-ms`` (B only)."""
    mode: str | None = None
    """The sidecar's ``x-upshift-mode``: continuation / full / passthrough (B only)."""
    max_gap: float = 0.0
    """Longest silence between two events of this turn."""
    client_s: float = 0.0
    """The client's own time before its request left (the SDK serialising the input and building
    the HTTP request; for a WebSocket turn, serialising and writing the frame)."""


_REQUEST_SENT: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("request_sent", default=None)


async def note_request_sent(request: Any) -> None:
    """httpx ``request`` event hook: when the SDK's request leaves, for :attr:`TurnRecord.client_s`."""
    box = _REQUEST_SENT.get()
    if box is not None:
        box.append(time.perf_counter())


class Agent(Protocol):
    """One conversation's client."""

    async def turn(self, new_items: list[JSON]) -> tuple[TurnRecord, list[JSON]]:
        """Send the new items, wait for the terminal event; return the record and the output items."""

    async def close(self) -> None:
        """Release the connection."""


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def _deadline(source: Any, seconds: float) -> AsyncIterator[Any]:
    """Iterate an async iterable, giving up when one item takes longer than ``seconds``."""
    iterator = source.__aiter__()
    while True:
        try:
            item = await asyncio.wait_for(iterator.__anext__(), seconds)
        except StopAsyncIteration:
            return
        yield item


class SdkHttpAgent:
    """Full history over HTTP through the SDK (setup A: emulator; setup B: sidecar)."""

    def __init__(self, client: AsyncOpenAI, fields: dict[str, JSON]) -> None:
        self.client = client
        self.fields = fields
        self.input: list[JSON] = []

    async def turn(self, new_items: list[JSON]) -> tuple[TurnRecord, list[JSON]]:
        self.input += new_items
        sent: list[float] = []
        token = _REQUEST_SENT.set(sent)
        start = time.perf_counter()
        try:
            raw = await self.client.responses.with_raw_response.create(input=self.input, **self.fields)
        finally:
            _REQUEST_SENT.reset(token)
        stream: Any = raw.parse()
        ttfb = last = 0.0
        gap = 0.0
        final: Any = None
        async for event in stream:
            now = time.perf_counter() - start
            if ttfb == 0.0:
                ttfb = last = now
            gap, last = max(gap, now - last), now
            if event.type in TERMINAL:
                final = event
                break
        total = time.perf_counter() - start
        await stream.close()
        response = getattr(final, "response", None)
        output = list(response.output) if response is not None else []
        self.input += [item.model_dump() for item in output]
        size = int(raw.http_request.headers.get("content-length", "0") or 0)
        rec = TurnRecord(
            start, ttfb, total, size, getattr(response, "id", ""), getattr(final, "type", "none"),
            _float(raw.headers.get("x-upshift-overhead-ms")), raw.headers.get("x-upshift-mode"), gap,
            (sent[0] - start) if sent else 0.0,
        )  # fmt: skip
        return rec, [item.model_dump() for item in output]

    async def close(self) -> None:
        return None


class SdkWsAgent:
    """Native WebSocket mode through the SDK: only new items plus ``previous_response_id`` (setup C)."""

    def __init__(self, client: AsyncOpenAI, fields: dict[str, JSON]) -> None:
        self.client = client
        self.fields = {k: v for k, v in fields.items() if k not in ("stream", "stream_options")}
        self.manager: Any = None
        self.conn: Any = None
        self.previous: str | None = None

    async def turn(self, new_items: list[JSON]) -> tuple[TurnRecord, list[JSON]]:
        if self.conn is None:
            self.manager = self.client.responses.connect()
            self.conn = await self.manager.enter()
        frame = {"type": "response.create", **self.fields, "input": new_items, "previous_response_id": self.previous}
        size = len(orjson.dumps(frame))
        start = time.perf_counter()
        await self.conn.send(frame)
        client_s = time.perf_counter() - start
        ttfb = last = gap = 0.0
        final: Any = None
        async for event in _deadline(self.conn, READ_TIMEOUT):
            now = time.perf_counter() - start
            if ttfb == 0.0:
                ttfb = last = now
            gap, last = max(gap, now - last), now
            if event.type in TERMINAL:
                final = event
                break
        total = time.perf_counter() - start
        response = getattr(final, "response", None)
        self.previous = getattr(response, "id", None)
        output = [item.model_dump() for item in (response.output if response is not None else [])]
        return TurnRecord(
            start, ttfb, total, size, self.previous or "", getattr(final, "type", "none"), max_gap=gap,
            client_s=client_s,
        ), output  # fmt: skip

    async def close(self) -> None:
        if self.manager is not None:
            await self.manager.__aexit__(None, None, None)


@dataclass(slots=True)
class SseResult:
    """What :func:`post_sse` saw."""

    ttfb: float
    total: float
    terminal: str
    response: JSON
    headers: dict[str, str]
    max_gap: float
    events: int
    times: list[float] | None = None
    """``perf_counter()`` at each event, when asked for."""
    first_output: float = 0.0
    """Seconds until the first event that is not ``response.created``/``in_progress`` (first token)."""


async def post_sse(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    keep_times: bool = False,
) -> SseResult:
    """POST ``body`` and read the SSE stream to its terminal event (parsing only that event's JSON)."""
    start = time.perf_counter()
    ttfb = last = gap = first_output = 0.0
    buffer = b""
    terminal, response, count = "none", None, 0
    times: list[float] | None = [] if keep_times else None
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            text = await resp.text()
            raise RuntimeError(f"HTTP {resp.status} from {url}: {text[:300]}")
        async for chunk in resp.content.iter_any():
            now = time.perf_counter() - start
            if ttfb == 0.0:
                ttfb = last = now
            buffer += chunk
            while (end := buffer.find(b"\n\n")) >= 0:
                block, buffer = buffer[:end], buffer[end + 2 :]
                count += 1
                if times is not None:
                    times.append(start + now)
                gap, last = max(gap, now - last), now
                name = block[7 : block.find(b"\n")] if block.startswith(b"event: ") else b""
                if not first_output and name.decode() not in LIFECYCLE:
                    first_output = now
                if name.decode() in TERMINAL:
                    terminal = name.decode()
                    data = block[block.find(b"data: ") + 6 :]
                    response = orjson.loads(data).get("response")
        total = time.perf_counter() - start
        return SseResult(ttfb, total, terminal, response, dict(resp.headers), gap, count, times, first_output)


async def post_json(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> SseResult:
    """POST a ``stream: false`` ``body`` and read its JSON answer (the times of an answer that
    arrives at once: first byte, first output and end are one)."""
    start = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as resp:
        data = await resp.read()
        total = time.perf_counter() - start
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {url}: {data[:300]!r}")
        response = orjson.loads(data)
        return SseResult(total, total, f"response.{response.get('status')}", response, dict(resp.headers), 0.0, 0,
                         None, total)  # fmt: skip


@dataclass(slots=True)
class WsTurn:
    """What :func:`ws_turn` saw (seconds since the frame was sent)."""

    ttfb: float
    first_output: float
    total: float
    event: JSON
    """The terminal event."""
    kind: str
    max_gap: float
    events: int


_LIFECYCLE_HEADS = tuple(f'"type":"{name}"' for name in LIFECYCLE)


async def ws_turn(ws: Any, frame: bytes) -> WsTurn:
    """Send one ``response.create`` frame; read to the terminal event."""
    start = time.perf_counter()
    await ws.send(frame.decode())
    ttfb = last = gap = first_output = 0.0
    count = 0
    while True:
        message = await asyncio.wait_for(ws.recv(), READ_TIMEOUT)
        now = time.perf_counter() - start
        count += 1
        if ttfb == 0.0:
            ttfb = last = now
        gap, last = max(gap, now - last), now
        head = message[:48]
        if not first_output and not any(h in head for h in _LIFECYCLE_HEADS):
            first_output = now
        if '"response.' in head or '"error"' in head:
            event = orjson.loads(message)
            if event.get("type") in TERMINAL:
                return WsTurn(ttfb, first_output, time.perf_counter() - start, event, event["type"], gap, count)


async def ws_create(ws: Any, frame: bytes) -> tuple[float, float, JSON, str, float]:
    """Send one ``response.create`` frame; read to the terminal event. Returns ttfb, total, final, type, gap."""
    turn = await ws_turn(ws, frame)
    return turn.ttfb, turn.total, turn.event, turn.kind, turn.max_gap


class RawHttpAgent:
    """:class:`SdkHttpAgent`'s wire behaviour on bare aiohttp (same body keys, same echo)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, fields: dict[str, JSON]) -> None:
        self.session = session
        self.url = base_url.rstrip("/") + "/responses"
        self.fields = fields
        self.input: list[JSON] = []
        self.headers = sdk_headers()

    async def turn(self, new_items: list[JSON]) -> tuple[TurnRecord, list[JSON]]:
        self.input += new_items
        start = time.perf_counter()
        body = orjson.dumps({"input": self.input, **self.fields})
        res = await post_sse(self.session, self.url, body, self.headers)
        output = echo_items((res.response or {}).get("output") or [])
        self.input += output
        rec = TurnRecord(
            start, res.ttfb, time.perf_counter() - start, len(body), (res.response or {}).get("id", ""), res.terminal,
            _float(res.headers.get("x-upshift-overhead-ms")), res.headers.get("x-upshift-mode"), res.max_gap,
        )  # fmt: skip
        return rec, output

    async def close(self) -> None:
        return None


class RawWsAgent:
    """:class:`SdkWsAgent`'s wire behaviour on bare websockets."""

    def __init__(self, ws_url: str, fields: dict[str, JSON]) -> None:
        self.ws_url = ws_url
        self.fields = {k: v for k, v in fields.items() if k not in ("stream", "stream_options")}
        self.ws: Any = None
        self.previous: str | None = None

    async def turn(self, new_items: list[JSON]) -> tuple[TurnRecord, list[JSON]]:
        if self.ws is None:
            self.ws = await websockets.connect(
                self.ws_url, additional_headers={"Authorization": f"Bearer {API_KEY}"},
                compression=None, max_size=None, ping_interval=None,
            )  # fmt: skip
        start = time.perf_counter()
        frame = orjson.dumps(
            {"type": "response.create", **self.fields, "input": new_items, "previous_response_id": self.previous}
        )
        ttfb, _, event, kind, gap = await ws_create(self.ws, frame)
        response = event.get("response") or {}
        self.previous = response.get("id")
        rec = TurnRecord(start, ttfb, time.perf_counter() - start, len(frame), self.previous or "", kind, max_gap=gap)
        return rec, list(response.get("output") or [])

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
