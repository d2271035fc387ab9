"""The response id of an answer relayed over HTTP, found as its bytes pass.

The bytes reach the app unchanged; the sniffer only looks at a bounded head of them: a JSON
body's top-level ``id``, or ``response.id`` of an SSE stream's first event (and the ``item.id``
of its ``response.output_item.added`` events), decoded by the one SSE reader
(:mod:`proxy.wire.sse`).
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson

from proxy.core.creators import SNIFF_LIMIT, member_string
from proxy.core.named_ids import members
from proxy.wire import sse

__all__ = ["IdSniffer", "answer_members"]


def answer_members(body: bytes, paths: tuple[tuple[str, ...], ...]) -> Iterator[str]:
    """The strings at ``paths`` of a whole JSON answer (none if it does not parse)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return iter(())
    return members(parsed, paths)


class IdSniffer:
    """Finds the response id of an answer streamed to the app, chunk by chunk.

    Args:
        sse: The answer is ``text/event-stream`` (the id is ``response.id`` of its first
            event); else a JSON body (its top-level ``id``).
        limit: Bytes looked at, at most.
        sse_path: Where the id is in the first event instead (``("id",)``: a chat completion chunk).
        items: An SSE answer's ``response.output_item.added`` events are read on (within
            ``limit``) for their ``item.id`` (:meth:`take`): an output item the app may name in an
            ``item_reference``.
    """

    def __init__(
        self, *, sse: bool, limit: int = SNIFF_LIMIT, sse_path: tuple[str, ...] | None = None, items: bool = False
    ) -> None:
        self.limit = limit
        self._path = sse_path or ("response", "id")
        self.done = False
        """Found (and no items watched), or given up: later chunks are not looked at."""
        self._seen = 0
        self._buffer = b""
        self._decoder = _decoder(limit) if sse else None
        self._items = items and sse
        self._first = True
        self._found: list[str] = []

    def feed(self, chunk: bytes) -> str | None:
        """The id, once the bytes seen so far show it (at most once); else ``None``."""
        if self.done:
            return None
        piece = chunk[: self.limit - self._seen]
        self._seen += len(piece)
        found: str | None = None
        if self._decoder is not None:
            try:
                events = self._decoder.feed(piece)
            except sse.EventTooLarge:
                events, self.done = [], True
            if events and self._first:
                self._first = False
                found = member_string(events[0].data, self._path)
                self.done = not self._items
                events = events[1:]
            if self._items:
                for event in events:
                    if _ITEM_ADDED in event.data[:256]:
                        item = member_string(event.data, ("item", "id"))
                        if item is not None:
                            self._found.append(item)
        else:
            self._buffer += piece
            start = self._buffer.lstrip()[:1]
            if start and start != b"{":
                self.done = True
            else:
                found = member_string(self._buffer, ("id",))
                self.done = found is not None
        if self._seen >= self.limit:
            self.done = True
        if self.done:
            self._buffer, self._decoder = b"", None
        return found

    def take(self) -> list[str]:
        """The output item ids found since the last call."""
        found, self._found = self._found, []
        return found


_ITEM_ADDED = b'"response.output_item.added"'


def _decoder(limit: int) -> sse.Decoder:
    return sse.Decoder(max_event_bytes=limit)
