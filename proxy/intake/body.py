"""Reading an app's request body: within the body limit, in time, paid for as it arrives.

:func:`read_body` reads a body into one buffer (:class:`BodyBuffer`) or, chunked or encoded, chunk
by chunk (gzip and deflate decoded a bounded step at a time, the limit counting decoded bytes).
:class:`BodyClock` says when a body must have arrived and :class:`BodyWatch` enforces it with one
timer. The reception reads ``POST /v1/responses`` bodies with a memory lease, the object routes
read theirs plainly, and the HTTP passthrough streams an unread body upstream under the same
deadlines (``timed_stream``): all three take requests in, so this sits below them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import zlib
from typing import Any

from aiohttp import web

from proxy.config import LimitsSettings
from proxy.errors import BodyTimeout, BodyTooLarge, ClientGone, InvalidRequest, UnsupportedEncoding
from proxy.intake.memory import Lease

__all__ = ["DECODED", "BodyBuffer", "BodyClock", "BodyWatch", "body_length", "read_body"]

_AHEAD = 256 * 1024
"""The lease is grown once the body read comes this close to what it pays for (what the
server's read buffers may already hold beyond the bytes handed over)."""


# -- one buffer per body ----------------------------------------------------------------------------


def _bytes_api() -> tuple[Any, Any] | None:
    with contextlib.suppress(AttributeError, OSError):
        api = ctypes.pythonapi
        new, address = api.PyBytes_FromStringAndSize, api.PyBytes_AsString
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_ssize_t]
        address.restype, address.argtypes = ctypes.c_void_p, [ctypes.py_object]
        return new, address
    return None


_BYTES_API = _bytes_api()
_DIRECT_ABOVE = 64 * 1024
"""Bodies at least this large are read straight into their final ``bytes`` object."""


class BodyBuffer:
    """A body of known length read into one buffer: the final ``bytes`` object itself.

    Uses the C API's documented way to build a bytes object piecewise
    (``PyBytes_FromStringAndSize(NULL, n)``, then fill ``PyBytes_AsString``) while no one else
    holds it, so the body is never in memory twice (chunks + joined, or bytearray + bytes).
    Elsewhere (no ``ctypes.pythonapi``, small bodies): a bytearray, copied once at the end.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.filled = 0
        self._bytes: bytes | None = None
        self._address = 0
        self._array: bytearray | None = None
        if _BYTES_API is not None and length >= _DIRECT_ABOVE:
            new, address = _BYTES_API
            self._bytes = new(None, length)
            self._address = address(self._bytes)
        else:
            self._array = bytearray(length)

    @property
    def missing(self) -> int:
        return self.length - self.filled

    @property
    def full(self) -> bool:
        return self.filled >= self.length

    def write(self, chunk: bytes) -> None:
        """Append ``chunk`` (at most :attr:`missing` bytes)."""
        size = len(chunk)
        if size > self.missing:
            raise ValueError("more bytes than the declared length")
        if self._array is not None:
            self._array[self.filled : self.filled + size] = chunk
        else:
            ctypes.memmove(self._address + self.filled, chunk, size)
        self.filled += size

    def value(self) -> bytes:
        """The body (only once it is full)."""
        if not self.full:
            raise ValueError("the body is not complete")
        if self._bytes is not None:
            body, self._bytes = self._bytes, None
            return body
        assert self._array is not None
        body = bytes(self._array)
        self._array = None
        return body


# -- the body's encoding, deadlines and read ------------------------------------------------------------


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

    With a memory ``lease``: the body pays as it arrives: the lease grows a step
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
    # A lease whose first step covers the declared length (every body up to one step) never
    # grows: it is not asked to.
    buffer = BodyBuffer(length)
    covered = lease.covered if lease is not None else length
    while not buffer.full:
        chunk = await content.readany()
        if not chunk:
            raise InvalidRequest("The request body ended before its Content-Length.")
        buffer.write(chunk)
        if watch is not None:
            watch.chunk(len(chunk))
        if lease is not None and covered < length and buffer.filled + _AHEAD > covered:
            await _grow(lease, buffer.filled, watch)
            covered = lease.covered
    body = buffer.value()
    if lease is not None:
        lease.read(length)
    return body


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
