"""One upstream WebSocket connection, its lanes' inboxes, and the boundary where library
exceptions become :mod:`proxy.errors`.

websockets' client opens the connection (proxy tunnel, TLS, upgrade: :func:`open_websocket`
maps its handshake failures); then :class:`UpstreamSocket` takes the transport over. Every send
goes through :meth:`UpstreamSocket.send` (websockets' sans-I/O protocol builds the frames), and
every frame is parsed once, in the transport's ``data_received``, and routed to the inbox of
its lane: one write path, one read path, each mapping closes and OS errors once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    InvalidHandshake,
    InvalidProxy,
    InvalidProxyStatus,
    InvalidStatus,
    InvalidURI,
    ProtocolError,
    ProxyError,
)
from websockets.frames import Close, CloseCode, Frame, Opcode
from websockets.protocol import State

from proxy.config import Settings
from proxy.errors import (
    UpstreamClosed,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamRefused,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.redact import redact_urls
from proxy.serve.identity import USER_AGENT
from proxy.upstream.egress import egress_for

__all__ = [
    "MAX_RECEIVED_FRAME",
    "Inbox",
    "UpstreamSocket",
    "closed_error",
    "live_sockets",
    "open_websocket",
    "strip_stream_id",
]

MAX_RECEIVED_FRAME = 64 * 1024 * 1024
"""Largest frame accepted from upstream: a ``response.completed`` holds the whole output."""

_CLOSE_TIMEOUT = 2.0
"""Seconds to wait for the closing handshake before dropping the TCP connection."""


_CONT, _TEXT, _BINARY = int(Opcode.CONT), int(Opcode.TEXT), int(Opcode.BINARY)
_CLOSE, _PING, _PONG = int(Opcode.CLOSE), int(Opcode.PING), int(Opcode.PONG)
_UNSENDABLE = frozenset({CloseCode.NO_STATUS_RCVD, CloseCode.ABNORMAL_CLOSURE, CloseCode.TLS_HANDSHAKE})
"""Close codes that may be received but never sent: such a close is echoed without a code."""

_FRAGMENT = 1024 * 1024
"""Frames above this go as a fragmented message (issue 12: memory per byte sent)."""


def closed_error(rcvd: Close | None, sent: Close | None) -> UpstreamClosed:
    """:class:`UpstreamClosed` for a closing handshake: the code and reason the upstream sent
    (else ours; 1006 when no close frame went either way)."""
    frame = rcvd or sent
    code = frame.code if frame is not None else 1006
    reason = frame.reason if frame is not None else ""
    return UpstreamClosed(
        f"The upstream closed the connection ({code}{' ' + reason if reason else ''}).",
        close_code=code,
        reason=reason,
    )


async def open_websocket(url: str, headers: Sequence[tuple[str, str]], settings: Settings) -> ClientConnection:
    """Open an upstream WebSocket with the sidecar's options.

    Args:
        url: ``Identity.ws_url`` (the upstream's path and query plus the app's query string).
        headers: Upgrade headers (``Identity.headers``); never cookies or hop-by-hop headers.
        settings: Pool and timeout settings.

    The connection goes through the egress proxy of :func:`proxy.upstream.egress.egress_for` (an HTTP
    ``CONNECT`` tunnel), with its TLS context.

    Raises:
        UpstreamRefused: the upgrade was answered with a non-101 status.
        UpstreamUnavailable: connection refused, DNS failure, handshake timeout or failure, TLS
            verification failure, or the egress proxy refused the ``CONNECT``.
    """
    pool = settings.pool
    egress = egress_for(settings)
    # The shared TLS context (egress.ca_file, SSL_CERT_FILE) for wss; none for ws.
    tls: dict[str, Any] = {"ssl": egress.ssl} if egress.ssl is not None and url.startswith("wss:") else {}
    if egress.ssl is not None and egress.proxy is not None and egress.proxy.startswith("https:"):
        tls["proxy_ssl"] = egress.ssl  # TLS to an https:// proxy trusts the same CAs
    try:
        return await connect(
            url,
            additional_headers=list(headers),
            user_agent_header=USER_AGENT,
            compression="deflate" if pool.compression else None,
            open_timeout=settings.timeouts.connect_seconds,
            ping_interval=None,  # the UpstreamSocket's own keepalive (it owns the transport)
            close_timeout=_CLOSE_TIMEOUT,
            max_size=MAX_RECEIVED_FRAME,
            # Resolved once by proxy.upstream.egress (egress.proxy: env|off|URL, NO_PROXY), never by
            # websockets itself, so the HTTP relay and the sockets take the same path.
            proxy=egress.for_websockets(),
            **tls,
        )
    except InvalidProxyStatus as exc:
        status = exc.response.status_code
        raise UpstreamUnavailable(
            f"The egress proxy refused the connection to the upstream (HTTP {status} to CONNECT)."
        ) from exc
    except (ProxyError, InvalidProxy) as exc:
        raise UpstreamUnavailable(f"The egress proxy failed: {redact_urls(str(exc))}") from exc
    except InvalidStatus as exc:
        response = exc.response
        raise UpstreamRefused(
            f"The upstream refused the WebSocket upgrade with HTTP {response.status_code}.",
            http_status=response.status_code,
            headers={k.lower(): v for k, v in response.headers.raw_items()},
            payload=bytes(response.body or b""),
        ) from exc
    except (InvalidHandshake, InvalidURI) as exc:
        raise UpstreamUnavailable(f"The upstream WebSocket handshake failed: {redact_urls(str(exc))}") from exc
    except TimeoutError as exc:
        raise UpstreamUnavailable("Connecting to the upstream timed out.") from exc
    except OSError as exc:
        raise UpstreamUnavailable(f"The upstream is unreachable: {redact_urls(str(exc.strerror or exc))}") from exc


_TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "response.done", "error"})
_LANE_ERRORS = frozenset({"invalid_stream_id", "websocket_stream_limit_reached", "unknown_parameter"})


class Inbox:
    """The events of one lane's response in flight, filled by the socket's reader.

    A turn reads with :meth:`get`; everything that arrived meanwhile is kept in order, so the
    turn can write a whole burst to the app at once (:meth:`pending`). An abandoned turn's inbox
    *drains*: events are dropped until the terminal one, then ``on_drained`` runs.
    """

    __slots__ = ("_waiter", "draining", "error", "frames", "lane", "member", "on_drained", "seen")

    def __init__(self, lane: str | None) -> None:
        self.lane = lane
        self.member = b'"stream_id":' + orjson.dumps(lane) if lane is not None else b""
        """The lane's ``stream_id`` member as the upstream writes it (cut out of its events)."""
        self.frames: deque[tuple[bytes, dict[str, Any]]] = deque()
        self.error: UpstreamError | None = None
        self.draining = False
        self.on_drained: Callable[[], None] | None = None
        self.seen = False
        """An event of this lane arrived."""
        self._waiter: asyncio.Future[None] | None = None

    def put(self, raw: bytes, event: dict[str, Any]) -> None:
        self.seen = True
        if self.draining:
            if event.get("type") in _TERMINAL and self.on_drained is not None:
                callback, self.on_drained = self.on_drained, None
                callback()
            return
        self.frames.append((raw, event))
        self._wake()

    def fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def pending(self) -> bool:
        """Whether another event is already here (the caller may batch its writes)."""
        return bool(self.frames)

    def take(self) -> list[tuple[bytes, dict[str, Any]]]:
        """Every event already here, in order, or none (raises nothing: :meth:`get` does)."""
        if not self.frames:
            return []
        frames = list(self.frames)
        self.frames.clear()
        return frames

    async def get(self, timeout: float) -> tuple[bytes, dict[str, Any]]:
        """The next event of this lane: ``(raw bytes, parsed object)``.

        Raises:
            UpstreamClosed | UpstreamProtocolError: the socket failed.
            UpstreamTimeout: nothing arrived within ``timeout``.
        """
        if self.frames:
            return self.frames.popleft()
        if self.error is not None:
            raise self.error
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _wake_up, waiter)  # cheaper than asyncio.timeout per wait
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if not self.frames and self.error is None:
            raise UpstreamTimeout(f"The upstream sent nothing for {timeout:g} s.")
        if self.frames:
            return self.frames.popleft()
        assert self.error is not None
        raise self.error


def _wake_up(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class UpstreamSocket(asyncio.Protocol):
    """An open upstream connection, the inboxes of its lanes in flight, and its keepalive.

    After the handshake (websockets' client) the socket takes the transport over as its
    protocol: bytes in, frames out, parsed once and routed in the same callback (no reader
    task, no message queue between them). Without an extension the socket parses the frames
    itself (:meth:`_parse`, with RFC 6455's rules for control frames and the closing
    handshake); with one (compression) websockets' sans-I/O
    :class:`~websockets.client.ClientProtocol` parses them. Sends always go through the
    library's protocol.

    Every event is routed by ``stream_id`` (the ``stream_id`` is taken out of the event: the app
    sees what HTTP would have given it). Events without one belong to the default lane; until
    the socket has seen an event with a ``stream_id`` they are attributed in the order the
    creates were sent (an upstream that ignores lanes runs them one after another), and an
    ``error`` about the ``stream_id`` itself goes to the oldest named lane still waiting for its
    first event.

    Args:
        key: The pool's id for this socket.
        ws: The open connection (its transport and protocol are taken over).
        now: Monotonic time of the handshake.
        on_closed: Called once when the connection is gone (by whichever side).
        on_lanes_ignored: Called when a named lane's events come without ``stream_id``.
        ping_interval: Seconds between keepalive pings (0: none).
        ping_timeout: Seconds a ping may wait for its pong before the socket is dropped (0: forever).
    """

    def __init__(
        self,
        key: int,
        ws: ClientConnection,
        now: float,
        *,
        on_closed: Callable[[UpstreamSocket], None] | None = None,
        on_lanes_ignored: Callable[[UpstreamSocket], None] | None = None,
        ping_interval: float = 0.0,
        ping_timeout: float = 0.0,
    ) -> None:
        self.key = key
        self.ws = ws
        self.protocol = ws.protocol
        self.transport: asyncio.Transport = ws.transport
        self.created_at = now
        """Monotonic time the socket opened (rotation age)."""
        self.inboxes: dict[str | None, Inbox] = {}
        self._first: deque[str | None] = deque()
        self._current: Inbox | None = None
        self.proven = False
        """An event with a ``stream_id`` arrived on this socket: the upstream has lanes."""
        self._on_closed = on_closed
        self._on_lanes_ignored = on_lanes_ignored
        self.error: UpstreamError | None = None
        self._fragments: list[bytes] = []
        self._fragment_size = 0
        self._fast = not self.protocol.extensions and not self.protocol.reader.buffer
        """Frames parsed by :meth:`_parse` (no extension such as compression was negotiated and
        the library holds no bytes after the handshake); else by websockets' protocol."""
        self._partial: list[bytes] = []
        self._partial_size = 0
        self._partial_need = 0
        self._close_rcvd: Close | None = None
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._lost: asyncio.Future[None] = loop.create_future()
        self._writable: asyncio.Future[None] | None = None
        self._sending = asyncio.Lock()
        """Held while a message goes out in fragments (or waits for the transport's room)."""
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._ping: bytes | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        self._closer: asyncio.TimerHandle | None = None
        self.transport.set_protocol(self)
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
        """Stop receiving for ``inbox``'s lane."""
        if self.inboxes.get(inbox.lane) is inbox:
            del self.inboxes[inbox.lane]
        with contextlib.suppress(ValueError):
            self._first.remove(inbox.lane)
        if self._current is inbox:
            self._current = None

    # -- sending -------------------------------------------------------------------------------

    async def send(self, frame: bytes, lane: str | None) -> None:
        """Send one ``response.create`` for ``lane`` as a text frame (UTF-8 JSON already).

        A frame of up to 1 MiB is written at once (no await) when nothing else is being sent; a
        larger one goes as one message in 1 MiB fragments, each written when the transport has
        room, while other lanes' frames wait their turn (fragments of two messages never
        interleave), shielded: a cancelled caller never leaves half a message on a socket that
        other lanes share.

        Raises:
            UpstreamClosed: the connection is closed.
        """
        if self.error is not None:
            raise self.error
        if self.protocol.state is not State.OPEN:
            raise closed_error(self.close_rcvd, self.protocol.close_sent)
        self._first.append(lane)
        if len(frame) <= _FRAGMENT and self._writable is None and not self._sending.locked():
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
            if len(frame) <= _FRAGMENT:
                await self._drain()
                if self.error is not None:
                    raise self.error
                self.protocol.send_text(frame)
                self._flush()
                return
            # issue 12: a large frame goes as one message in 1 MiB fragments, so the masked
            # copy and the write buffer hold one fragment at a time, not the whole frame.
            view = memoryview(frame)
            for at in range(0, len(frame), _FRAGMENT):
                await self._drain()
                if self.error is not None:
                    raise self.error
                chunk, fin = view[at : at + _FRAGMENT], at + _FRAGMENT >= len(frame)
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
            self.transport.writelines(data)
        if self.protocol.close_expected() and self._closer is None and not self._lost.done():
            # The closing handshake is under way: the upstream should close the TCP
            # connection; if it does not, we do.
            self._closer = self._loop.call_later(_CLOSE_TIMEOUT, self.transport.abort)

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- receiving -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._fast:
            self._parse(data)
            return
        protocol = self.protocol
        protocol.receive_data(data)
        frames = protocol.events_received()
        self._flush()  # the protocol's own answers: pongs, the close reply
        for frame in frames:
            if not isinstance(frame, Frame):
                continue  # handshake events come before the socket takes over: never here
            if not self._frame(frame.opcode, frame.fin, frame.data):
                return
        if protocol.close_rcvd is not None:
            # The upstream is closing: nothing more comes, and nothing may be sent any more.
            self._fail(closed_error(protocol.close_rcvd, protocol.close_sent))

    def _parse(self, data: bytes) -> None:
        """Frames out of ``data`` (RFC 6455 §5.2), for a connection without extensions.

        websockets' parser is a generator per frame (a few µs each, on every one of a turn's
        ~20 events); this one slices complete frames out of the received bytes and keeps an
        incomplete one's chunks until its declared length is there, joined once. Control
        frames follow the library's rules: a ping gets its pong, a close its echo.
        """
        if self._close_rcvd is not None or self.error is not None:
            return  # after a close or a failure nothing more is processed (§7.1.7)
        if self._partial:
            self._partial.append(data)
            self._partial_size += len(data)
            if self._partial_size < self._partial_need:
                return
            data = b"".join(self._partial)
            self._partial, self._partial_size = [], 0
        pos, size, need = 0, len(data), 2
        while size - pos >= 2:
            first, second = data[pos], data[pos + 1]
            length, header = second & 0x7F, 2
            if length == 126:
                if size - pos < 4:
                    need = 4
                    break
                length, header = int.from_bytes(data[pos + 2 : pos + 4], "big"), 4
            elif length == 127:
                if size - pos < 10:
                    need = 10
                    break
                length, header = int.from_bytes(data[pos + 2 : pos + 10], "big"), 10
            if second & 0x80 or first & 0x70 or length > MAX_RECEIVED_FRAME:
                self._protocol_error(
                    "The upstream sent a masked frame."
                    if second & 0x80
                    else "The upstream sent a frame with reserved bits set."
                    if first & 0x70
                    else f"The upstream sent a message over {MAX_RECEIVED_FRAME} bytes."
                )
                return
            end = pos + header + length
            if end > size:
                need = end - pos
                break
            payload = data[pos + header : end]
            pos = end
            if not self._frame(first & 0x0F, bool(first & 0x80), payload) or self._close_rcvd is not None:
                return
        if pos < size:
            rest = data[pos:] if pos else data
            self._partial, self._partial_size, self._partial_need = [rest], len(rest), need

    def _frame(self, opcode: int, fin: bool, payload: bytes | bytearray | memoryview) -> bool:
        """One frame; False once the socket failed (stop processing)."""
        if opcode == _TEXT or opcode == _BINARY or opcode == _CONT:
            if self._fragments or not fin:
                if (opcode == _CONT) != bool(self._fragments):
                    self._protocol_error("The upstream sent a fragment out of order.")
                    return False
                self._fragments.append(bytes(payload))
                self._fragment_size += len(payload)
                if self._fragment_size > MAX_RECEIVED_FRAME:
                    self._protocol_error(f"The upstream sent a message over {MAX_RECEIVED_FRAME} bytes.")
                    return False
                if not fin:
                    return True
                raw = b"".join(self._fragments)
                self._fragments, self._fragment_size = [], 0
            elif opcode == _CONT:
                self._protocol_error("The upstream sent a fragment out of order.")
                return False
            else:
                raw = payload if isinstance(payload, bytes) else bytes(payload)
            return self._message(raw)
        if self._fast and (opcode < _CLOSE or opcode > _PONG or not fin or len(payload) > 125):
            self._protocol_error("The upstream sent an invalid control frame.")
            return False
        if opcode == _PONG:
            if self._ping is not None and payload == self._ping:
                self._pong()
        elif not self._fast:
            pass  # websockets' protocol checked the frame and answered a ping or a close itself
        elif opcode == _PING:
            if self.protocol.state is State.OPEN:
                self.protocol.send_pong(payload)
                self._flush()
        else:
            try:
                rcvd = Close.parse(bytes(payload))
            except (ProtocolError, UnicodeDecodeError):
                self._protocol_error("The upstream sent an invalid close frame.")
                return False
            self._close_rcvd = rcvd
            if self.protocol.state is State.OPEN:  # echo it (§5.5.1); the upstream then closes TCP
                with contextlib.suppress(ProtocolError):
                    if rcvd.code in _UNSENDABLE:
                        self.protocol.send_close()
                    else:
                        self.protocol.send_close(rcvd.code, rcvd.reason)
                self._flush()
            # The upstream is closing: nothing more comes, and nothing may be sent any more.
            self._fail(closed_error(rcvd, self.protocol.close_sent))
        return True

    def _message(self, raw: bytes) -> bool:
        try:
            event = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self._protocol_error(f"The upstream sent a frame that is not JSON: {exc}")
            return False
        if not isinstance(event, dict):
            self._protocol_error("The upstream sent a frame that is not a JSON object.")
            return False
        self._route(raw, event)
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

    # -- routing -------------------------------------------------------------------------------

    def _fail(self, error: UpstreamError) -> None:
        if self.error is not None:
            return
        self.error = error
        for inbox in list(self.inboxes.values()):
            inbox.fail(error)
        if self._on_closed is not None:
            self._on_closed(self)

    def _route(self, raw: bytes, event: dict[str, Any]) -> None:
        sid = event.pop("stream_id", None)
        kind = event.get("type")
        inbox: Inbox | None
        if isinstance(sid, str):
            self.proven = True
            inbox = self.inboxes.get(sid)
            if inbox is None:
                return  # nobody waits for it (an abandoned lane's stray event)
            raw = strip_stream_id(raw, sid, event, inbox.member)
        elif kind == "error" and _about_lanes(event):
            inbox = self._oldest(named=True)
        elif self._current is not None:
            inbox = self._current
        elif self.proven:
            inbox = self.inboxes.get(None)
            if inbox is None and kind == "error":
                inbox = self._oldest(named=False)
        else:
            inbox = self._oldest(named=False)
            if inbox is not None and inbox.lane is not None and kind != "error":
                # A named lane's events come without stream_id: the upstream ignores lanes.
                if self._on_lanes_ignored is not None:
                    self._on_lanes_ignored(self)
        if inbox is None:
            return  # nobody waits for it (an abandoned lane's stray event, an unsolicited frame)
        if self._first:
            with contextlib.suppress(ValueError):
                self._first.remove(inbox.lane)
        if sid is None:
            self._current = None if kind in _TERMINAL else inbox
        inbox.put(raw, event)

    def _oldest(self, *, named: bool) -> Inbox | None:
        for lane in self._first:
            if named and lane is None:
                continue
            inbox = self.inboxes.get(lane)
            if inbox is not None:
                return inbox
        return None

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
                async with asyncio.timeout(_CLOSE_TIMEOUT):
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


def _about_lanes(event: dict[str, Any]) -> bool:
    """Whether a connection-level ``error`` is about a ``stream_id`` (a named lane's create)."""
    inner = event.get("error")
    if not isinstance(inner, dict):
        inner = event
    return inner.get("param") == "stream_id" or inner.get("code") in _LANE_ERRORS


def strip_stream_id(raw: bytes, sid: str, event: dict[str, Any], member: bytes = b"") -> bytes:
    """``raw`` without its top-level ``"stream_id"`` member (the app asked over HTTP).

    The member (``member``: its compact form, when the caller has it) is cut out of the bytes
    when it occurs exactly once (the usual case: no re-serialisation); otherwise the parsed
    event, already without it, is written anew.
    """
    member = member or b'"stream_id":' + orjson.dumps(sid)
    # Where upstreams put it, first or last: then it is the top-level member by position alone
    # (the pattern cannot occur inside a JSON string, whose quotes are escaped, and a nested
    # object's last member is followed by two braces), found without scanning the event.
    tail = b"," + member + b"}"
    if raw.endswith(tail):
        return raw[: len(raw) - len(tail)] + b"}"
    head = b"{" + member + b","
    if raw.startswith(head):
        return b"{" + raw[len(head) :]
    at = raw.find(member)
    if at >= 0 and raw.find(member, at + 1) < 0:
        end = at + len(member)
        if raw[end : end + 1] == b",":
            return raw[:at] + raw[end + 1 :]
        if raw[at - 1 : at] == b",":
            return raw[: at - 1] + raw[end:]
    return orjson.dumps(event)
