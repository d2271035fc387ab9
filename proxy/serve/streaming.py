"""The app's side of one ``POST /v1/responses``, and the loop that feeds it from upstream.

``stream: true``: an SSE ``StreamResponse``, prepared when the first event is released (so an
error before any response event can still become an HTTP status), one write per read of the
upstream socket (all the events it brought; or per released batch), the upstream's JSON bytes
unchanged. ``stream: false``: nothing is written until the terminal event; then one JSON body.

``x-upshift-overhead-ms`` is the sidecar's own time up to the moment the headers go out: wall
time since the request's first bytes arrived minus the upstream's own time (from the frame's
send to the arrival at the socket of the latest event, :attr:`LeasedLane.upstream_seconds`):
the sidecar's queueing, before the handler ran or after an event arrived and before the loop
handed it on, is its own. For a stream that is the overhead before the first byte; the access
log and ``upshift_added_latency_seconds`` record the same measure at the end of the response.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import orjson
from aiohttp import web

from proxy import contracts
from proxy.config import LimitsSettings
from proxy.core.answer import Answer, AnswerKind, finished
from proxy.core.channel import TERMINAL, Channel, Out
from proxy.core.sse import CONTENT_TYPE, encode_events
from proxy.errors import BodyTimeout, BodyTooLarge, ClientGone, InvalidRequest, UnsupportedEncoding, UpstreamTimeout
from proxy.observe.metrics import HELD_LIFECYCLE, child
from proxy.serve.memory import BodyBuffer, Lease

_AHEAD = 256 * 1024
"""The lease is grown once the body read comes this close to what it pays for (what the
server's read buffers may already hold beyond the bytes handed over)."""

log = logging.getLogger("upshift.streaming")

__all__ = [
    "BodyClock",
    "BodyWatch",
    "ClientGone",
    "Downstream",
    "LeasedLane",
    "body_length",
    "count_hold_back",
    "json_body",
    "new_request_id",
    "pump",
    "read_body",
    "wants_obfuscation",
]

_MAX_WRITE = 1024 * 1024
"""Most bytes of events (as upstream sent them) written to the app in one write: more than one
read of the upstream socket brings (256 KiB), so a read's events leave in one write; a backlog
(the app reads slowly) goes in writes of this size, each followed by aiohttp's drain, which
bounds what waits in the app's write buffer."""


def json_body(obj: Any) -> bytes:
    """Compact JSON bytes (orjson)."""
    return orjson.dumps(obj)


_LAST = frozenset(TERMINAL) | {"response.done"}
"""Event types after which nothing more is written: their write also ends the body."""


def _frames(outs: list[Out]) -> bytes:
    return encode_events((o.type, o.raw if o.raw is not None else orjson.dumps(o.obj)) for o in outs)


def wants_obfuscation(fields: Mapping[str, Any]) -> bool:
    """``stream_options.include_obfuscation`` as the app asked (default true, as on the API)."""
    options = fields.get("stream_options")
    return not (isinstance(options, dict) and options.get("include_obfuscation") is False)


def _without_obfuscation(out: Out) -> Out:
    """``out`` minus the ``obfuscation`` of a delta event. The frame leaves ``stream_options`` out
    (protocol.md §4.1) and whether a WebSocket upstream adds ``obfuscation`` is undocumented, so an
    app that asked for none gets none whichever transport its turn took (docs/fidelity.md)."""
    if not out.type.endswith(".delta"):
        return out
    if out.raw is not None:
        if out.raw.find(b'"obfuscation"') < 0:
            return out
        event = orjson.loads(out.raw)
        if not isinstance(event, dict) or "obfuscation" not in event:
            return out
        del event["obfuscation"]
        return Out(out.type, orjson.dumps(event))
    if out.obj is not None and "obfuscation" in out.obj:
        return Out(out.type, None, {k: v for k, v in out.obj.items() if k != "obfuscation"})
    return out


class Downstream:
    """What goes back to the app for one request.

    Args:
        request: The app's request.
        stream: Whether the app asked for SSE.
        headers: Headers for the answer (``x-request-id``, ``x-upshift-mode``); the caller may
            update them until the answer starts.
        started: ``time.perf_counter()`` when the request arrived.
        lease: The request's memory lease: :func:`pump` shrinks it to the body once the frame
            is sent.
        on_id: Told the id of each response :func:`pump` moves, before the app can see it
            (the id's owner is recorded first).
        obfuscation: False when the app asked for no ``obfuscation`` on deltas: it is taken out.
    """

    def __init__(
        self,
        request: web.Request,
        *,
        stream: bool,
        headers: dict[str, str],
        started: float,
        lease: Lease | None,
        on_id: Callable[[str], None] | None = None,
        obfuscation: bool = True,
    ) -> None:
        self.request = request
        self.obfuscation = obfuscation
        """The app did not ask ``stream_options.include_obfuscation: false`` (:func:`wants_obfuscation`)."""
        self.stream = stream
        self.headers = headers
        self.started = started
        self.lease = lease
        self.on_id = on_id
        self.response: web.StreamResponse | None = None
        """The answer once prepared: SSE at its first events, JSON once :meth:`settle` sent it."""
        self.gone = False
        """The app went away mid-stream; the rest of the response is drained, not written."""
        self.upstream_wait = 0.0
        """The upstream's own seconds (from each frame's send to its latest event's arrival)."""
        self.bytes_out = 0
        """SSE bytes written to the app."""
        self._last = b""
        """The batch that ends with the terminal event, sent by :meth:`end` with the body's end."""

    @property
    def written(self) -> bool:
        """Whether headers (and maybe events) already went to the app."""
        return self.response is not None

    def added(self) -> float:
        """The sidecar's own time so far, in seconds."""
        return max(time.perf_counter() - self.started - self.upstream_wait, 0.0)

    def _overhead_header(self) -> dict[str, str]:
        return {"x-upshift-overhead-ms": f"{self.added() * 1000:.3f}"}

    async def write(self, outs: list[Out]) -> None:
        """Write released events as SSE (prepares the response on the first call).

        One buffer and one socket write per call: the headers go out with the first events.
        A batch that ends with the terminal event is kept for :meth:`end`, which sends it with
        the end of the body (the chunked encoding's last chunk) in the same write: so a turn
        whose events arrive together costs one write (:meth:`settle` sends it before the lane
        records the conversation's head).
        """
        if self.gone or not outs:
            return
        if not self.obfuscation:
            outs = [_without_obfuscation(o) for o in outs]
        data = _frames(outs)
        if self._last:
            data = self._last + data  # never happens in a well-formed stream
            self._last = b""
        try:
            if self.response is None:
                response = web.StreamResponse(
                    status=200,
                    headers={"Content-Type": CONTENT_TYPE, **self.headers, **self._overhead_header()},
                )
                # aiohttp then sends the headers with the first body bytes, in one write.
                contracts.send_headers_with_first_write(response)
                self.response = response
                await response.prepare(self.request)
            self.bytes_out += len(data)
            if outs[-1].type in _LAST:
                self._last = data
            else:
                await self.response.write(data)
        except ConnectionResetError:
            # The app closed its connection; keep reading upstream to the terminal event so
            # the socket stays usable (pitfall 20), but write nothing more.
            self.gone = True

    async def end(self) -> web.StreamResponse:
        """Finish the SSE stream cleanly (no ``[DONE]``), with the terminal batch if one is kept."""
        assert self.response is not None
        if not self.gone:
            last, self._last = self._last, b""
            try:
                await self.response.write_eof(last)
            except ConnectionResetError:
                self.gone = True
        return self.response

    def json(self, status: int, body: bytes, extra: Mapping[str, str] | None = None) -> web.Response:
        """A JSON answer (``stream: false``, or an error before anything was written)."""
        headers = {**(extra or {}), **self.headers, **self._overhead_header()}
        return web.Response(body=body, status=status, content_type="application/json", headers=headers)

    async def settle(self, channel: Channel) -> None:
        """Send the answer now if the response ended with its output released: that answer is
        :func:`proxy.core.answer.finished`'s, whatever :func:`~proxy.core.answer.decide` is asked
        next. The shell calls it before the lane's lease ends, and the lease's exit
        records the conversation's head in the same loop callback as the last write: the app's
        next turn is read only after that, so it cannot race the head (only a write that waited
        for a slow app to read leaves a window, and a turn in it is planned on what is recorded:
        at worst sent in full), and the app does not wait for the record. Otherwise (a failure,
        a replay still possible) nothing is sent.
        """
        if not channel.done or not channel.released or self.gone:
            return
        if self.stream:
            if self.response is not None:
                await self.end()
            return
        response = await self.answer(finished(channel, False))
        self.response = response
        try:
            await response.prepare(self.request)
            await response.write_eof()
        except ConnectionResetError:
            # The app hung up before its answer: the response is complete upstream and its
            # head recorded; there is nobody to give it to (aiohttp's own finish sees the same).
            self.gone = True

    async def answer(self, answer: Answer) -> web.StreamResponse:
        """Give the app ``answer`` (chosen by :func:`proxy.core.answer.decide`); one :meth:`settle`
        sent already is that answer."""
        if not self.stream and self.response is not None:
            return self.response
        if answer.kind is AnswerKind.SSE_END or answer.kind is AnswerKind.ERROR_EVENT:
            await self.write(list(answer.events))
            return await self.end()
        return self.json(answer.status, json_body(answer.body), answer.headers)


class LeasedLane(Protocol):
    """What :func:`pump` needs of a lane lent by the pool (:class:`proxy.upstream.pool.Turn`)."""

    async def send(self, frame: bytes) -> None: ...
    async def burst(self, timeout: float) -> list[tuple[bytes, dict[str, Any]]]: ...
    @property
    def upstream_seconds(self) -> float:
        """The upstream's own time so far: from the send to the latest event's arrival at the socket."""
        ...


async def pump(lane: LeasedLane, frames: list[bytes], channel: Channel, down: Downstream, idle_timeout: float) -> None:
    """Send the frame and move its response's events to the app until the channel is done.

    :attr:`Downstream.on_id` is told the response's id when its ``response.created`` arrives,
    before that event can reach the app (the id's owner is known before the app could
    name it).

    ``frames`` holds the one frame, and pump empties it: the caller keeps no reference, so the
    frame is freed as soon as it is sent, not when the response ends, and the request's memory
    lease (:attr:`Downstream.lease`) shrinks to the body.

    Returns when the terminal event arrived; what the app gets for it (if it was held) is the
    caller's decision.

    Raises:
        UpstreamClosed | UpstreamTimeout | UpstreamProtocolError: from the socket or a bad frame.
    """
    before = down.upstream_wait  # an earlier attempt's upstream time (a replay)
    await lane.send(frames.pop())
    if down.lease is not None:
        down.lease.sent()
    stream, on_id = down.stream, down.on_id
    clock = time.perf_counter
    batch: list[Out] = []
    size = 0
    while not channel.done:
        # While lifecycle events are held, wait only until their deadline (the bounded
        # hold-back): then they go to the app, and a later loss is surfaced, not replayed.
        deadline = channel.deadline()
        wait = idle_timeout if deadline is None else max(0.0, min(idle_timeout, deadline - clock()))
        try:
            events = await lane.burst(wait)
        except UpstreamTimeout:
            down.upstream_wait = before + lane.upstream_seconds
            if deadline is None or wait >= idle_timeout:
                raise  # a real idle timeout
            released = channel.on_timer(clock())
            if released and stream:
                await down.write(released)
            continue
        down.upstream_wait = before + lane.upstream_seconds
        now = clock()
        # Events that arrived together leave together: one wake-up and one write
        # (one wakeup of the app) per read of the upstream socket, however many events it
        # carried; never held back while upstream is silent. After the terminal event the
        # loop ends and the last batch goes below.
        for raw, event in events:
            if on_id is not None and event.get("type") == "response.created":
                created = event.get("response")
                rid = created.get("id") if isinstance(created, dict) else None
                if isinstance(rid, str):
                    on_id(rid)
            outs = channel.feed(raw, event, now)
            if outs and stream:
                batch += outs
                size += len(raw)
                if size >= _MAX_WRITE:
                    await down.write(batch)
                    batch, size = [], 0
            if channel.done:
                break  # anything after the terminal event is not this response's
        if batch and not channel.done:
            await down.write(batch)
            batch, size = [], 0
    if batch:
        await down.write(batch)


def count_hold_back(channel: Channel) -> None:
    """Count how ``channel``'s held lifecycle events left the hold (``upshift_held_lifecycle_total``).

    Call once per attempt, when the shell is done with its channel (after the answer was
    written, or before a replay): events still held then never reached the app.
    """
    path = channel.hold_path
    if path is not None:
        child(HELD_LIFECYCLE, path.value).inc()


def new_request_id() -> str:
    """``req_`` + 32 hex digits, as OpenAI's ``x-request-id``."""
    return "req_" + os.urandom(16).hex()


DECODED = frozenset({"gzip", "deflate"})
"""``Content-Encoding`` values of a request body that are decoded (incrementally, as the body is
read, one step of output at a time: a zip bomb stops at the body limit)."""


def _encoding(request: web.Request) -> str | None:
    encoding = request.headers.get("Content-Encoding")
    if encoding is None:
        return None
    value = encoding.strip().lower()
    if value in ("", "identity"):
        return None
    if value not in DECODED:
        raise UnsupportedEncoding(
            f"Content-Encoding {encoding.strip()[:40]!r} is not supported: send the body as it is, gzip or deflate."
        )
    return value


def body_length(request: web.Request) -> int | None:
    """The body's size as it will be read: ``Content-Length``, or None (chunked, or encoded: its
    decoded size is known only once read).

    Raises:
        UnsupportedEncoding: a ``Content-Encoding`` other than gzip or deflate (415, unread).
    """
    return None if _encoding(request) is not None else request.content_length


class _Decoder:
    """gzip or deflate (zlib-wrapped, or raw as some clients send it), decoded a bounded step of
    output at a time (``zlib``'s ``max_length``), never past ``limit`` decoded bytes."""

    def __init__(self, encoding: str, limit: int, message: str) -> None:
        self.encoding = encoding
        self.limit = limit
        self.message = message
        self.size = 0
        self._z: Any = zlib.decompressobj(31) if encoding == "gzip" else None
        self._head = b""

    def feed(self, data: bytes, out: list[bytes]) -> None:
        if self._z is None:  # deflate: a zlib header (RFC 1950) or raw deflate
            data = self._head + data
            if len(data) < 2:
                self._head = data
                return
            zlib_header = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._z = zlib.decompressobj(15 if zlib_header else -15)
        while data:
            try:
                piece = self._z.decompress(data, _DECODE_STEP)
            except zlib.error:
                raise InvalidRequest("The request body does not decode as its Content-Encoding says.") from None
            self.size += len(piece)
            if self.size > self.limit:
                raise BodyTooLarge(self.message)
            if piece:
                out.append(piece)
            if self._z.eof and self._z.unused_data:
                raise InvalidRequest("The request body has bytes after its compressed data.")
            data = self._z.unconsumed_tail

    def end(self) -> None:
        if self._z is None or not self._z.eof:
            raise InvalidRequest("The request body ended inside its compressed data.")


_DECODE_STEP = 256 * 1024
"""Most decoded bytes produced per step (then the limit and the memory lease are checked)."""


class BodyClock:
    """When a body must have arrived: complete within ``body_timeout_seconds`` of its
    head, and, once ``body_grace_seconds`` of reading passed, at ``body_min_bytes_per_second``
    on average at least, never silent for longer than the grace. Time spent waiting for memory
    stops the rate clock (the sidecar, not the app, held the body back then).

    Args:
        limits: The settings.
        started: Loop time when the head arrived.
    """

    __slots__ = ("deadline", "grace", "rate", "timeout")

    def __init__(self, limits: LimitsSettings, started: float) -> None:
        self.timeout = limits.body_timeout_seconds
        self.deadline = started + limits.body_timeout_seconds
        self.rate = limits.body_min_bytes_per_second
        self.grace = limits.body_grace_seconds


_LAST_LOOK_SECONDS = 0.05
"""How long a body's verdict waits for the loop to read what already arrived (BodyWatch)."""


class BodyWatch:
    """Enforces a :class:`BodyClock` on one body with one timer (re-armed only when it fires,
    at most once per grace period, and once more for a last look before a verdict): nothing is
    done per chunk but counting."""

    __slots__ = (
        "arrived",
        "began",
        "clock",
        "content",
        "fired",
        "handle",
        "last",
        "loop",
        "looked",
        "paused",
        "paused_since",
    )

    def __init__(self, clock: BodyClock, content: Any) -> None:
        self.clock = clock
        self.content = content
        self.loop = asyncio.get_running_loop()
        self.began = self.last = self.loop.time()
        self.arrived = 0
        self.paused = 0.0
        self.paused_since: float | None = None
        self.fired: BodyTimeout | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.looked = False
        self._arm(self.began)

    def _due(self, now: float) -> float:
        c = self.clock
        due = min(c.deadline, self.last + c.grace) if c.grace > 0 else c.deadline
        if c.rate > 0:
            due = min(due, self.began + self.paused + c.grace + self.arrived / c.rate)
        return due

    def _arm(self, now: float) -> None:
        self.handle = self.loop.call_at(self._due(now), self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if self.paused_since is not None:  # waiting for memory: the app is not to blame
            self.handle = self.loop.call_at(now + max(self.clock.grace, 0.5), self._check)
            return
        due = self._due(now)
        if now + 0.001 < due:
            self.looked = False
            self.handle = self.loop.call_at(due, self._check)
            return
        if not self.looked:
            # One last look before a verdict: after a stall of the sidecar's own loop, bytes the
            # app sent in time may still sit unread in the socket (uvloop can run a due timer
            # before it polls) or read but not yet taken by the handler. A few turns of the loop
            # let them be counted; the app is judged by when it sent, not by when we read.
            self.looked = True
            self.handle = self.loop.call_at(now + _LAST_LOOK_SECONDS, self._check)
            return
        c = self.clock
        if now >= c.deadline - 0.001:
            exc = BodyTimeout(f"The request body was not complete within {c.timeout:g} s.", slow=False)
        else:
            exc = BodyTimeout(
                f"The request body arrived too slowly (at least {c.rate} bytes per second after "
                f"{c.grace:g} s, never silent for longer than that).",
                slow=True,
            )
        self.fired = exc
        self.content.set_exception(exc)

    def chunk(self, size: int) -> None:
        self.arrived += size
        self.last = self.loop.time()

    def pause(self) -> None:
        self.paused_since = self.loop.time()

    def resume(self) -> None:
        if self.paused_since is not None:
            now = self.loop.time()
            self.paused += now - self.paused_since
            self.last = now
            self.paused_since = None

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


async def read_body(
    request: web.Request, limit: int, lease: Lease | None = None, clock: BodyClock | None = None
) -> bytes:
    """Read the body, refusing more than ``limit`` bytes while reading (never unbounded), in
    time (``clock``).

    With a memory ``lease`` (issues 12, 21): the body pays as it arrives: the lease grows a step
    ahead of the bytes read (the rest stays unread, in the kernel, while memory is short). A
    body with ``Content-Length`` is read into one buffer (mapped at its size, resident as it
    fills). A gzip or deflate body is decoded as it is read (the API listener leaves bodies as
    they came, ``auto_decompress=False``) and its decoded size is what the limit bounds (413
    for a zip bomb, at the limit); any other encoding is a 415, unread.

    Raises:
        BodyTooLarge: over the limit (declared, actual or decoded).
        BodyTimeout: not complete in time (the caller answers 408 and closes the connection).
        UnsupportedEncoding: a ``Content-Encoding`` other than gzip or deflate.
        InvalidRequest: the body ended before its declared length, or does not decode.
        ClientGone: the app closed its connection mid-body.
        MemoryRefused: a growth waited too long for memory.
    """
    message = f"The request body is larger than the sidecar's limit of {limit} bytes."
    encoding = _encoding(request)
    length = request.content_length
    content = request.content
    if length is not None and length > limit:
        raise BodyTooLarge(message)  # declared (for an encoded body: already its wire size)
    watch = BodyWatch(clock, content) if clock is not None else None
    try:
        if encoding is not None:
            return await _read_unknown(content, limit, message, lease, watch, _Decoder(encoding, limit, message))
        if length is not None:
            return await _read_known(content, length, lease, watch)
        return await _read_unknown(content, limit, message, lease, watch)
    except BodyTimeout:
        raise
    except ConnectionResetError:
        if watch is not None and watch.fired is not None:
            raise watch.fired from None
        raise ClientGone() from None
    finally:
        if watch is not None:
            watch.stop()


async def _grow(lease: Lease, size: int, watch: BodyWatch | None) -> None:
    if watch is not None:
        watch.pause()
    try:
        await lease.arrived(size)
    finally:
        if watch is not None:
            watch.resume()


async def _read_known(content: Any, length: int, lease: Lease | None, watch: BodyWatch | None) -> bytes:
    # One buffer of the declared size, filled chunk by chunk as they arrive (aiohttp's
    # readexactly keeps every chunk and joins them: twice the body at the end). readany()
    # hands over one received chunk as it is (read(n) joins what is buffered: a copy); the
    # payload parser never lets more than the declared length into the stream.
    buffer = BodyBuffer(length)
    covered = lease.covered if lease is not None else length
    while not buffer.full:
        chunk = await content.readany()
        if not chunk:
            raise InvalidRequest("The request body ended before its Content-Length.")
        buffer.write(chunk)
        if watch is not None:
            watch.chunk(len(chunk))
        if lease is not None and buffer.filled + _AHEAD > covered:
            await _grow(lease, buffer.filled, watch)
            covered = lease.covered
    if lease is not None:
        lease.read(length)
    return buffer.value()


async def _read_unknown(
    content: Any,
    limit: int,
    message: str,
    lease: Lease | None,
    watch: BodyWatch | None,
    decoder: _Decoder | None = None,
) -> bytes:
    chunks: list[bytes] = []
    size = wire = 0
    covered = lease.covered if lease is not None else limit
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        wire += len(chunk)
        if wire > limit:
            raise BodyTooLarge(message)
        if watch is not None:
            watch.chunk(len(chunk))
        if decoder is None:
            chunks.append(chunk)
            size = wire
        else:
            decoder.feed(chunk, chunks)
            size = decoder.size + wire  # the compressed bytes are in memory too, until the end
        if lease is not None and size + _AHEAD > covered:
            await _grow(lease, size, watch)
            covered = lease.covered
    if decoder is not None:
        decoder.end()
        size = decoder.size
    body = b"".join(chunks)
    if lease is not None:
        lease.read(size)
    return body
