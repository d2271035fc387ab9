"""Server-sent events, sans-I/O: bytes in, events out (the HTML standard's ``text/event-stream``).

The one SSE reader of the product: the cluster (relaying an owner's stream event by event),
the demo and ``upshift explain`` all decode through :class:`Decoder`. Feed it bytes as they
arrive, in pieces of any size; it returns each event once its blank line has arrived, with
the exact bytes it came in (``raw``), so a relay can pass complete events on unchanged and
never a half one.

Encoding frames events as OpenAI frames them on ``/v1/responses``: one ``event: <type>`` line,
one ``data: <compact JSON>`` line, one blank line, no ``[DONE]`` (protocol.md §2.2); the JSON
bytes are the upstream's own, passed through unchanged. :func:`encode_events` frames a turn's
events into one buffer (one copy of each event's bytes, the ``event:`` heads cached).

Parsing follows the standard (https://html.spec.whatwg.org/multipage/server-sent-events.html,
"Interpreting an event stream"): lines end in CRLF, LF or CR; a line starting with ``:`` is a
comment; ``field: value`` loses one space after the colon; ``data`` lines join with ``\\n``;
a blank line dispatches the event (none if it had no ``data``); a leading BOM is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "CONTENT_TYPE",
    "MAX_EVENT_BYTES",
    "Decoder",
    "Event",
    "EventTooLarge",
    "decode_all",
    "encode",
    "encode_events",
]

CONTENT_TYPE = "text/event-stream; charset=utf-8"
"""``Content-Type`` of a streamed ``/v1/responses`` answer."""

MAX_EVENT_BYTES = 64 * 1024 * 1024
"""Default bound of one event's bytes (a stream that never sends a blank line is refused)."""

_BOM = b"\xef\xbb\xbf"


class EventTooLarge(ValueError):
    """An event grew past the decoder's bound before its blank line arrived."""


@dataclass(frozen=True, slots=True)
class Event:
    """One dispatched event."""

    event: str
    """The ``event`` field (``"message"`` when absent, as the standard says)."""
    data: bytes
    """The ``data`` lines joined with ``\\n``."""
    id: str | None
    """The ``id`` field, if the event had one."""
    raw: bytes
    """The event's bytes exactly as received, from its first line to its blank line included."""


_HEADS: dict[str, bytes] = {}
"""``event: <type>\ndata: `` per event type seen (a few dozen); bounded by :data:`_MAX_HEADS`."""
_MAX_HEADS = 256


def _head(event_type: str) -> bytes:
    head = _HEADS.get(event_type)
    if head is None:
        # A line break in the event name would end the field early and let the rest of the name
        # pose as a field of its own; names come from upstream JSON, so never trust them.
        name = event_type.encode("utf-8", "replace").replace(b"\r", b"").replace(b"\n", b"")
        head = b"".join((b"event: ", name, b"\ndata: "))
        if len(_HEADS) < _MAX_HEADS:
            _HEADS[event_type] = head
    return head


def encode_events(events: Iterable[tuple[str, bytes]]) -> bytes:
    """Frame several events into one buffer (one join for the whole batch), each as
    :func:`encode` frames it."""
    parts: list[bytes] = []
    add = parts.append
    for event_type, data in events:
        # ``find``, not ``in``: ``bytes in bytes`` first tries the operand as an int and builds
        # (then clears) a TypeError each time; ``find`` takes the buffer at once.
        if data.find(b"\n") >= 0 or data.find(b"\r") >= 0:
            data = b"\ndata: ".join(data.splitlines())
        add(_head(event_type))
        add(data)
        add(b"\n\n")
    return b"".join(parts)


def encode(event: str, data: bytes) -> bytes:
    """``event: <event>\\ndata: <data>\\n\\n``: JSON with raw line breaks (pretty-printed
    whitespace) goes over several ``data:`` lines, which SSE readers join with ``\\n``, so the
    JSON they parse is unchanged; line breaks in the name are dropped."""
    return encode_events(((event, data),))


class Decoder:
    """Incremental ``text/event-stream`` decoder.

    Args:
        max_event_bytes: Bound of one event's raw bytes (:class:`EventTooLarge` past it).
    """

    __slots__ = ("_buf", "_data", "_event", "_id", "_max", "_pos", "_start", "_started")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._buf = bytearray()
        self._pos = 0
        """Where the next unread line starts in ``_buf``."""
        self._start = 0
        """Where the event being read started in ``_buf``."""
        self._started = False
        self._event = ""
        self._data: list[bytes] | None = None
        self._id: str | None = None

    @property
    def pending(self) -> bytes:
        """Bytes of an event not complete yet (after the last dispatched or skipped one)."""
        return bytes(self._buf[self._start :])

    def feed(self, data: bytes) -> list[Event]:
        """Take the next bytes of the stream; the events they complete, in order."""
        if not data:
            return []
        buf = self._buf
        buf += data
        if not self._started:
            if len(buf) < len(_BOM) and _BOM.startswith(bytes(buf)):
                return []
            if buf.startswith(_BOM):
                del buf[: len(_BOM)]
            self._started = True
        out: list[Event] = []
        while True:
            end, size = self._line_end(buf, self._pos)
            if end < 0:
                break
            line = bytes(buf[self._pos : end])
            self._pos = end + size
            if line:
                self._field(line)
                continue
            # A blank line: dispatch (the raw bytes run from the event's start to here).
            raw = bytes(buf[self._start : self._pos])
            self._start = self._pos
            if self._data is not None:
                out.append(Event(self._event or "message", b"\n".join(self._data), self._id, raw))
            self._event, self._data = "", None
        if self._start:
            del buf[: self._start]
            self._pos -= self._start
            self._start = 0
        if len(buf) > self._max:
            raise EventTooLarge(f"an event exceeded {self._max} bytes")
        return out

    @staticmethod
    def _line_end(buf: bytearray, pos: int) -> tuple[int, int]:
        lf = buf.find(b"\n", pos)
        cr = buf.find(b"\r", pos, lf if lf >= 0 else len(buf))
        if cr >= 0:
            if cr + 1 == len(buf):
                return -1, 0  # a CR last: wait for the next byte (the LF of a CRLF, maybe)
            return cr, 2 if buf[cr + 1] == 0x0A else 1
        return lf, 1

    def _field(self, line: bytes) -> None:
        if line[:1] == b":":
            return  # a comment
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            if self._data is None:
                self._data = []
            self._data.append(value)
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
        elif name == b"id" and b"\0" not in value:
            self._id = value.decode("utf-8", "replace")
        # ``retry`` and unknown fields: nothing the product uses.


def decode_all(data: bytes) -> list[Event]:
    """Every event of a whole saved stream, a last one without its blank line included (a file
    saved from a terminal often lacks the final newline)."""
    return Decoder(max_event_bytes=len(data) + 2).feed(data + b"\n\n")
