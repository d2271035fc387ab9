"""RFC 6455 frames received by a client, as a sans-I/O codec: bytes in, messages and typed
control results out (no asyncio, no sockets, no core imports).

:class:`FrameReader` is the fast reader for a connection without extensions: it slices complete
frames out of the received bytes (websockets' generator parser costs a few µs per frame, on each
of a turn's ~20 events) and keeps an incomplete frame's chunks until its declared length is
there, joined once. It follows websockets' client-side rules (tests/wire/ checks the two agree
on the same bytes, hypothesis-driven): servers never mask, no reserved bits without an
extension, control frames are final and at most 125 bytes, continuations only inside a
fragmented message, messages bounded by ``max_message``, a close payload parsed by the library.

:class:`LibraryReader` gives the same results from websockets' own sans-I/O
:class:`~websockets.protocol.Protocol` (used when an extension such as permessage-deflate was
negotiated: the library decompresses).

:meth:`FrameReader.feed` returns, in order:

- ``bytes``: one whole message (text or binary: the caller decides what it accepts);
- :class:`Ping`: answer it with a pong of the same payload;
- :class:`Pong`: a pong arrived (keepalive);
- :class:`PeerClosed`: the peer closed (echo the close, §5.5.1); nothing more is read;
- :class:`Violation`: the bytes break the protocol; nothing more is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from websockets.exceptions import ProtocolError
from websockets.frames import Close, Frame, Opcode
from websockets.protocol import Protocol

__all__ = ["FrameReader", "LibraryReader", "PeerClosed", "Ping", "Pong", "Received", "Violation"]

_CONT, _TEXT, _BINARY = int(Opcode.CONT), int(Opcode.TEXT), int(Opcode.BINARY)
_CLOSE, _PING, _PONG = int(Opcode.CLOSE), int(Opcode.PING), int(Opcode.PONG)


@dataclass(frozen=True, slots=True)
class Ping:
    """A ping: answer with a pong carrying ``payload``."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class Pong:
    """A pong (the answer to a keepalive ping)."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class PeerClosed:
    """The peer sent a close frame: echo it (unless already answered), then the peer closes TCP."""

    close: Close
    answered: bool = False
    """The codec answered it itself (:class:`LibraryReader`)."""


@dataclass(frozen=True, slots=True)
class Violation:
    """The received bytes break RFC 6455 (or the size limit); the connection must be dropped."""

    message: str


Received = bytes | Ping | Pong | PeerClosed | Violation
"""One result of :meth:`FrameReader.feed`."""


class FrameReader:
    """Frames out of a client connection's received bytes (no extension negotiated).

    Args:
        max_message: Largest message accepted (a fragmented one counts whole).
    """

    __slots__ = ("_done", "_fragment_size", "_fragments", "_need", "_partial", "_partial_size", "max_message")

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self._partial: list[bytes] = []
        self._partial_size = 0
        self._need = 0
        self._fragments: list[bytes] = []
        self._fragment_size = 0
        self._done = False

    @property
    def done(self) -> bool:
        """A close or a violation was read: nothing more is (§7.1.7)."""
        return self._done

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame or message."""
        return self._partial_size + self._fragment_size

    def feed(self, data: bytes) -> list[Received]:
        """The results of ``data`` (appended to what was held), in order."""
        out: list[Received] = []
        if self._done:
            return out
        if self._partial:
            self._partial.append(data)
            self._partial_size += len(data)
            if self._partial_size < self._need:
                return out
            data = b"".join(self._partial)
            self._partial, self._partial_size = [], 0
        pos, size, need = 0, len(data), 2
        limit = self.max_message
        while size - pos >= 2:
            first, second = data[pos], data[pos + 1]
            opcode = first & 0x0F
            if second & 0x80 or first & 0x70 or (2 < opcode < 8 or opcode > 10):
                # Known from the first two bytes (websockets refuses these there too).
                self._fail(
                    out,
                    "The upstream sent a masked frame."
                    if second & 0x80
                    else "The upstream sent a frame with reserved bits set."
                    if first & 0x70
                    else "The upstream sent a reserved opcode, neither a data nor a control frame.",
                )
                return out
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
            if length > limit:
                self._fail(out, f"The upstream sent a message over {limit} bytes.")
                return out
            end = pos + header + length
            if end > size:
                need = end - pos
                break
            payload = data[pos + header : end]
            pos = end
            if (first == 0x81 or first == 0x82) and not self._fragments:
                out.append(payload)  # a whole text or binary message: _frame's answer, without the call
                continue
            if not self._frame(out, opcode, bool(first & 0x80), payload):
                return out
        if pos < size:
            rest = data[pos:] if pos else data
            self._partial, self._partial_size, self._need = [rest], len(rest), need
        return out

    def _fail(self, out: list[Received], message: str) -> None:
        self._done = True
        self._partial, self._fragments = [], []
        self._partial_size = self._fragment_size = 0
        out.append(Violation(message))

    def _frame(self, out: list[Received], opcode: int, fin: bool, payload: bytes) -> bool:
        """One frame; False once nothing more may be read."""
        if opcode == _TEXT or opcode == _BINARY or opcode == _CONT:
            if self._fragments or not fin:
                if (opcode == _CONT) != bool(self._fragments):
                    self._fail(out, "The upstream sent a fragment out of order.")
                    return False
                self._fragments.append(payload)
                self._fragment_size += len(payload)
                if self._fragment_size > self.max_message:
                    self._fail(out, f"The upstream sent a message over {self.max_message} bytes.")
                    return False
                if not fin:
                    return True
                payload = b"".join(self._fragments)
                self._fragments, self._fragment_size = [], 0
            elif opcode == _CONT:
                self._fail(out, "The upstream sent a fragment out of order.")
                return False
            out.append(payload)
            return True
        if opcode < _CLOSE or opcode > _PONG or not fin or len(payload) > 125:
            self._fail(out, "The upstream sent an invalid control frame.")
            return False
        if opcode == _PING:
            out.append(Ping(payload))
        elif opcode == _PONG:
            out.append(Pong(payload))
        else:
            try:
                close = Close.parse(payload)
            except (ProtocolError, UnicodeDecodeError):
                self._fail(out, "The upstream sent an invalid close frame.")
                return False
            if self._fragments:  # websockets' rule too: a message may not be cut by a close
                self._fail(out, "The upstream closed in the middle of a fragmented message.")
                return False
            self._done = True
            out.append(PeerClosed(close))
            return False
        return True


class LibraryReader:
    """The same results from websockets' sans-I/O protocol (which answers pings and closes
    itself: its bytes to send are the caller's to write after each :meth:`feed`).

    Args:
        protocol: The connection's protocol, past the handshake.
        parser_error: The exception the library's parser stopped on, if any
            (:func:`proxy.contracts.ws_parser_error`: an internal, read behind that door).
    """

    __slots__ = ("_done", "_fragments", "_parser_error", "protocol")

    def __init__(self, protocol: Protocol, parser_error: Callable[[Protocol], Exception | None]) -> None:
        self.protocol = protocol
        self._parser_error = parser_error
        self._fragments: list[bytes] = []
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def feed(self, data: bytes) -> list[Received]:
        out: list[Received] = []
        if self._done:
            return out
        protocol = self.protocol
        protocol.receive_data(data)
        for frame in protocol.events_received():
            if not isinstance(frame, Frame):
                continue  # handshake events come before the connection is handed over
            opcode = frame.opcode
            if opcode is Opcode.PONG:
                out.append(Pong(bytes(frame.data)))
            elif opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                if frame.fin and not self._fragments:
                    out.append(bytes(frame.data))
                else:
                    self._fragments.append(bytes(frame.data))
                    if frame.fin:
                        out.append(b"".join(self._fragments))
                        self._fragments = []
        exc = self._parser_error(protocol)
        if exc is not None:
            self._done = True
            out.append(Violation(f"The upstream broke the WebSocket protocol: {exc}"))
        elif protocol.close_rcvd is not None:
            self._done = True
            out.append(PeerClosed(protocol.close_rcvd, answered=True))
        return out
