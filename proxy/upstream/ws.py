"""One upstream WebSocket connection and its lanes' inboxes.

websockets' client opens the connection (proxy tunnel, TLS, upgrade:
:func:`proxy.upstream.handshake.open_websocket` maps its handshake failures); then
:class:`UpstreamSocket` takes the transport over. Every send goes through
:meth:`UpstreamSocket.send` (websockets' sans-I/O protocol builds the frames), and every frame is
read once, in the transport's ``data_received``, by the codec of :mod:`proxy.wire.wsframe`, and
placed by :class:`proxy.core.demux.Demux` in the inbox of its lane: one write path, one read
path, each mapping closes and OS errors once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.frames import Close
from websockets.protocol import State

from proxy.contracts import ws_parser_error, ws_take_over
from proxy.core.demux import BadEvent, Demux, LaneSignal, Routed, Unroutable
from proxy.errors import (
    UpstreamClosed,
    UpstreamError,
    UpstreamProtocolError,
)
from proxy.kernel import received_ago, tcp_socket
from proxy.upstream.handshake import CLOSE_TIMEOUT, MAX_RECEIVED_FRAME, closed_error, echo_close
from proxy.upstream.inbox import TERMINAL, Inbox
from proxy.wire.wsframe import FrameReader, LibraryReader, PeerClosed, Ping, Pong, Violation

__all__ = ["Inbox", "UpstreamSocket", "live_sockets"]

_READ_BYTES = 256 * 1024
"""Size of the buffer one read of an upstream socket lands in (uvloop's own read size)."""

_READ_BUFFERS = threading.local()


def writelines_pauses(version: tuple[int, ...]) -> bool:
    """Whether asyncio's ``writelines`` pauses the protocol at the high-water mark on Python
    ``version``. On 3.12.0-3.12.8 and 3.13.0-3.13.1 it does not (CVE-2024-12254): without
    :meth:`UpstreamSocket.pause_writing`, a slow upstream would let the write buffer grow without
    bound. There the frames go joined, through ``write``. (uvloop's transports pause either way.)"""
    return version < (3, 12) or (3, 12, 9) <= version < (3, 13) or version >= (3, 13, 2)


_WRITELINES_PAUSES = writelines_pauses(sys.version_info[:3])


def _read_buffer() -> memoryview:
    """The read buffer of this thread's sockets: one for all of them (a read is copied out before
    the next read of any socket lands, in the same event-loop callback), not 256 KiB a socket."""
    view: memoryview | None = getattr(_READ_BUFFERS, "view", None)
    if view is None:
        view = _READ_BUFFERS.view = memoryview(bytearray(_READ_BYTES))
    return view


class UpstreamSocket(asyncio.BufferedProtocol):
    """Moves bytes between one upstream connection and its codecs: received bytes go through
    the frame reader (:mod:`proxy.wire.wsframe`) and the lane demultiplexer
    (:class:`proxy.core.demux.Demux`) into the inboxes of the lanes in flight; sends go through
    websockets' sans-I/O protocol; and the keepalive pings.

    After the handshake (websockets' client) the socket takes the transport over as its
    protocol (:func:`proxy.contracts.ws_take_over`): bytes in, messages out, routed in the same
    callback (no reader task, no message queue between them). It is a buffered protocol: the
    transport reads into a buffer the socket lends (:meth:`get_buffer`); over TLS that lets the
    loop decrypt every record a read brought into it at once, where a plain protocol costs one
    256 KiB allocation per TLS record (uvloop's ``SSLProtocol._do_read__copied``). Without an extension the frames
    are read by :class:`~proxy.wire.wsframe.FrameReader`; with one (compression) by websockets'
    own protocol (:class:`~proxy.wire.wsframe.LibraryReader`).

    Every event is placed by the demux's rule (by ``stream_id`` once lanes are proven, else to
    the one response in flight); the ``stream_id`` is cut out of the event (the app sees what
    HTTP would have given it). An event the rule cannot place fails every response in flight
    and drops the socket: no waiter waits for events that went elsewhere.

    Args:
        key: The pool's id for this socket.
        ws: The open connection (its transport and protocol are taken over).
        now: Monotonic time of the handshake.
        demux: The socket's demultiplexer (the planner's record holds the same one).
        on_closed: Called once when the connection is gone (by whichever side).
        on_signal: Called when an event taught something about lanes (proven, refused, ignored).
        ping_interval: Seconds between keepalive pings (0: none).
        ping_timeout: Seconds a ping may wait for its pong before the socket is dropped (0: forever).
        fragment_bytes: Send messages above this size as fragments of this size (0: one frame
            per message, as the official clients do).
    """

    def __init__(
        self,
        key: int,
        ws: ClientConnection,
        now: float,
        *,
        demux: Demux | None = None,
        on_closed: Callable[[UpstreamSocket], None] | None = None,
        on_signal: Callable[[LaneSignal], None] | None = None,
        ping_interval: float = 0.0,
        ping_timeout: float = 0.0,
        fragment_bytes: int = 0,
    ) -> None:
        self.key = key
        self.ws = ws
        self.created_at = now
        """Monotonic time the socket opened (rotation age)."""
        self.demux = demux if demux is not None else Demux()
        self.inboxes: dict[str | None, Inbox] = {}
        self._on_closed = on_closed
        self._on_signal = on_signal
        self.error: UpstreamError | None = None
        self._fragment = fragment_bytes
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._lost: asyncio.Future[None] = loop.create_future()
        self._writable: asyncio.Future[None] | None = None
        self._sending = asyncio.Lock()
        """Held while a message waits for the transport's room (or goes out in fragments)."""
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._ping: bytes | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        self._closer: asyncio.TimerHandle | None = None
        self._close_rcvd: Close | None = None
        self._buffer = _read_buffer()
        self._tcp: Any = None
        self._read_now = self._read_at = 0.0
        self.transport, self.protocol, held = ws_take_over(ws, self)
        self._tcp = tcp_socket(self.transport)
        self._library = bool(self.protocol.extensions) or bool(held)
        """Frames read by websockets' protocol (an extension was negotiated, or the library
        holds bytes after the handshake); else by :class:`FrameReader`."""
        self._reader: FrameReader | LibraryReader = (
            LibraryReader(self.protocol, ws_parser_error) if self._library else FrameReader(MAX_RECEIVED_FRAME)
        )
        _LIVE.add(self)
        if ping_interval > 0:
            self._keepalive = loop.call_later(ping_interval, self._send_ping)

    def __repr__(self) -> str:
        return f"<UpstreamSocket #{self.key} {self.protocol.state.name.lower()} lanes={len(self.inboxes)}>"

    @property
    def close_rcvd(self) -> Close | None:
        """The close frame the upstream sent, if one came."""
        return self._close_rcvd or self.protocol.close_rcvd

    @property
    def closed(self) -> bool:
        """Whether the connection is closing or closed."""
        return self.protocol.state is not State.OPEN or self.error is not None

    def open_inbox(self, lane: str | None) -> Inbox:
        """Start receiving for ``lane`` (one response in flight per lane)."""
        inbox = Inbox(lane)
        if self.error is not None:
            inbox.fail(self.error)
        self.inboxes[lane] = inbox
        return inbox

    def close_inbox(self, inbox: Inbox) -> None:
        """Stop receiving for ``inbox``'s lane: its response is over."""
        inbox.close()
        if self.inboxes.get(inbox.lane) is inbox:
            del self.inboxes[inbox.lane]
            self.demux.done(inbox.lane)

    # -- sending -------------------------------------------------------------------------------

    async def send(self, frame: bytes, lane: str | None) -> None:
        """Send one ``response.create`` for ``lane`` as a text frame (UTF-8 JSON already).

        Written at once (no await) when nothing else is being sent and the transport has room;
        else it waits its turn, shielded: a cancelled caller never leaves half a message on a
        socket that other lanes share. With ``fragment_bytes`` set, a larger frame goes as one
        message in fragments of that size, each written when the transport has room (fragments
        of two messages never interleave).

        Raises:
            UpstreamClosed: the connection is closed.
        """
        if self.error is not None:
            raise self.error
        if self.protocol.state is not State.OPEN:
            raise closed_error(self.close_rcvd, self.protocol.close_sent)
        self.demux.sent(lane)
        fragment = self._fragment
        if (not fragment or len(frame) <= fragment) and self._writable is None and not self._sending.locked():
            self.protocol.send_text(frame)
            self._flush()
            return
        await asyncio.shield(self._send_in_turn(frame))

    async def _send_in_turn(self, frame: bytes) -> None:
        """Send ``frame`` once no other message is being sent: the fragments of one message are
        never interleaved with another lane's frames."""
        async with self._sending:
            if self.error is not None:
                raise self.error
            fragment = self._fragment
            if not fragment or len(frame) <= fragment:
                await self._drain()
                if self.error is not None:
                    raise self.error
                self.protocol.send_text(frame)
                self._flush()
                return
            # pool.fragment_bytes: the masked copy and the write buffer hold one fragment at a
            # time, not the whole frame, at the price of a framing the official
            # clients never use.
            view = memoryview(frame)
            for at in range(0, len(frame), fragment):
                await self._drain()
                if self.error is not None:
                    raise self.error
                chunk, fin = view[at : at + fragment], at + fragment >= len(frame)
                if at == 0:
                    self.protocol.send_text(chunk, fin=fin)
                else:
                    self.protocol.send_continuation(chunk, fin=fin)
                self._flush()
            await self._drain()

    async def _drain(self) -> None:
        while self._writable is not None:
            await asyncio.shield(self._writable)

    def _flush(self) -> None:
        """Write what the protocol has to send (frames, pongs, close); close after a close."""
        data = self.protocol.data_to_send()
        if data and not self.transport.is_closing():
            if data[-1] == b"":  # the protocol says: half-close after this (never as a client)
                data = data[:-1]
            if _WRITELINES_PAUSES:
                self.transport.writelines(data)
            else:
                self.transport.write(b"".join(data))
        if self.protocol.close_expected() and self._closer is None and not self._lost.done():
            # The closing handshake is under way: the upstream should close the TCP
            # connection; if it does not, we do.
            self._closer = self._loop.call_later(CLOSE_TIMEOUT, self.transport.abort)

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- receiving -----------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._buffer[:nbytes]))  # copied out: the buffer is shared

    def data_received(self, data: bytes) -> None:
        """The bytes of one read."""
        if self.error is not None:
            return  # after a failure nothing more is processed
        self._read_now, self._read_at = time.perf_counter(), 0.0  # _read_at: see _message
        results = self._reader.feed(data)
        if self._library:
            self._flush()  # the library's own answers: pongs, the close reply
        for item in results:
            if item.__class__ is bytes:
                if not self._message(item):
                    return
            elif isinstance(item, Ping):
                if self.protocol.state is State.OPEN:
                    self.protocol.send_pong(item.payload)
                    self._flush()
            elif isinstance(item, Pong):
                if self._ping is not None and item.payload == self._ping:
                    self._pong()
            elif isinstance(item, PeerClosed):
                self._peer_closed(item)
                return
            elif isinstance(item, Violation):
                self._protocol_error(item.message)
                return

    def _peer_closed(self, item: PeerClosed) -> None:
        rcvd = self._close_rcvd = item.close
        if not item.answered and self.protocol.state is State.OPEN:
            echo_close(self.protocol, rcvd)  # the upstream then closes TCP
            self._flush()
        # The upstream is closing: nothing more comes, and nothing may be sent any more.
        self._fail(closed_error(rcvd, self.protocol.close_sent))

    def _message(self, raw: bytes) -> bool:
        """One message: parsed and placed by the demux, handed to its lane's inbox; False once
        the socket failed (stop processing)."""
        try:
            route, raw, event = self.demux.receive(raw)
        except BadEvent as exc:
            self._protocol_error(str(exc))
            return False
        if route.__class__ is Routed:
            assert isinstance(route, Routed)
            if route.signal is not None and self._on_signal is not None:
                self._on_signal(route.signal)
            inbox = self.inboxes.get(route.lane)
            if inbox is not None:  # else its reader never opened an inbox (nothing waits for it)
                at = self._read_now
                if event.get("type") in TERMINAL:  # the upstream's time ends at the kernel's receipt
                    at = self._read_at = self._read_at or self._read_now - received_ago(self._tcp)
                inbox.put(raw, event, at)
        elif isinstance(route, Unroutable):
            self._fail(
                UpstreamClosed(
                    f"The upstream sent {route.why}: it cannot be routed to one response, so every "
                    "response in flight on the socket fails and the socket is dropped."
                )
            )
            self.transport.abort()
            return False
        return True

    def _protocol_error(self, message: str) -> None:
        self._fail(UpstreamProtocolError(message))
        self.transport.abort()

    def eof_received(self) -> bool | None:
        self.protocol.receive_eof()
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.receive_eof()  # idempotent: the protocol's state becomes CLOSED
        for handle in (self._keepalive, self._closer):
            if handle is not None:
                handle.cancel()
        self._keepalive = self._closer = None
        self.resume_writing()
        _LIVE.discard(self)
        if exc is not None and self.close_rcvd is None:
            self._fail(UpstreamClosed(f"Receiving from the upstream failed: {exc}"))
        else:
            self._fail(closed_error(self.close_rcvd, self.protocol.close_sent))
        if not self._lost.done():
            self._lost.set_result(None)

    # -- keepalive -----------------------------------------------------------------------------

    def _send_ping(self) -> None:
        self._keepalive = None
        if self.protocol.state is not State.OPEN:
            return
        self._ping = os.urandom(4)
        self.protocol.send_ping(self._ping)
        self._flush()
        if self._ping_timeout > 0:
            self._keepalive = self._loop.call_later(self._ping_timeout, self._ping_lost)

    def _pong(self) -> None:
        self._ping = None
        if self._keepalive is not None:
            self._keepalive.cancel()
        self._keepalive = self._loop.call_later(self._ping_interval, self._send_ping)

    def _ping_lost(self) -> None:
        self._keepalive = None
        self.protocol.fail(1011, "keepalive ping timeout")
        self._flush()
        self.transport.abort()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is not None:
            return
        self.error = error
        for inbox in list(self.inboxes.values()):
            inbox.fail(error)
        if self._on_closed is not None:
            self._on_closed(self)

    # -- closing -------------------------------------------------------------------------------

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the connection (closing handshake, then TCP); never raises (closing is cleanup)."""
        if not self._lost.done():
            if self.protocol.state is State.OPEN:
                try:
                    self.protocol.send_close(code, reason)
                except Exception:  # noqa: BLE001 - an invalid code: drop the connection instead
                    self.transport.abort()
                self._flush()
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await asyncio.shield(self._lost)
            except TimeoutError:
                self.transport.abort()
        if self.error is None:
            self._fail(UpstreamClosed("The upstream socket was closed by the sidecar.", close_code=code))
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self._lost)

    async def wait_closed(self) -> None:
        """Return once the connection is closed, whoever closed it."""
        await asyncio.shield(self._lost)


_LIVE: weakref.WeakSet[UpstreamSocket] = weakref.WeakSet()


def live_sockets() -> int:
    """Upstream sockets of this process whose connection is not yet lost (tests' leak checks)."""
    return len(_LIVE)
