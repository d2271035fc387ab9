"""Server-sent events framed as OpenAI frames them on ``/v1/responses``.

One ``event: <type>`` line, one ``data: <compact JSON>`` line, one blank line; no ``[DONE]``
(protocol.md §2.2). The JSON bytes are the upstream's own, passed through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["CONTENT_TYPE", "encode_event", "encode_events", "nested_error"]

CONTENT_TYPE = "text/event-stream; charset=utf-8"
"""``Content-Type`` of a streamed ``/v1/responses`` answer."""

_HEADS: dict[str, bytes] = {}
"""``event: <type>\ndata: `` per event type seen (a few dozen); bounded by :data:`_MAX_HEADS`."""
_MAX_HEADS = 256


def _clean_name(name: str) -> bytes:
    # A line break in the event name would end the field early and let the rest of the name
    # pose as a field of its own; names come from upstream JSON, so never trust them.
    raw = name.encode("utf-8", "replace")
    if b"\n" in raw or b"\r" in raw:
        raw = raw.replace(b"\r", b"").replace(b"\n", b"")
    return raw


def encode_event(event_type: str, data: bytes) -> bytes:
    """Frame one event.

    Args:
        event_type: The event's ``type`` (also the SSE event name).
        data: The event's JSON bytes, compact as upstream sends them.

    Returns:
        ``event: <type>\\ndata: <data>\\n\\n``. JSON with raw line breaks (pretty-printed
        whitespace) is split over several ``data:`` lines, which SSE readers join with ``\\n``,
        so the JSON they parse is unchanged.
    """
    return encode_events(((event_type, data),))


def _head(event_type: str) -> bytes:
    head = _HEADS.get(event_type)
    if head is None:
        head = b"".join((b"event: ", _clean_name(event_type), b"\ndata: "))
        if len(_HEADS) < _MAX_HEADS:
            _HEADS[event_type] = head
    return head


def encode_events(events: Iterable[tuple[str, bytes]]) -> bytes:
    """Frame several events into one buffer (one join for the whole batch: one copy of each
    event's bytes), each exactly as :func:`encode_event` frames it."""
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


def nested_error(
    sequence_number: int, *, type: str, code: str | None, message: str, param: str | None = None
) -> dict[str, Any]:
    """The nested ``error`` event (the production shape, protocol.md §2.5).

    The nested shape is the one every client reads: the openai SDK raises ``APIError`` with
    ``.code`` and ``.message`` set for it, whereas the flat shape parses with ``error=None``.
    """
    return {
        "type": "error",
        "sequence_number": sequence_number,
        "error": {"type": type, "code": code, "message": message, "param": param},
    }
