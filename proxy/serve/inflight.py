"""The responses being pumped to apps right now, and how they end when the drain's grace runs out.

A shutdown lets in-flight responses finish (``shutdown.grace_seconds``); those still streaming
when it runs out are ended with one error event the app can act on, never a truncated body
behind a 200 (:meth:`Streams.cut_all`).
"""

from __future__ import annotations

import contextlib
from types import TracebackType

from proxy.core.channel import Channel
from proxy.serve.streaming import Downstream

__all__ = ["Pumping", "Streams", "cut_stream"]


class Pumping:
    """One response in :class:`Streams` for the length of a ``with`` block (a plain class, not a
    generator-based context manager: it is entered and left on every turn)."""

    __slots__ = ("_entry", "_open")

    def __init__(self, open_: set[tuple[Downstream, Channel]], entry: tuple[Downstream, Channel]) -> None:
        self._open, self._entry = open_, entry

    def __enter__(self) -> None:
        self._open.add(self._entry)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._open.discard(self._entry)


class Streams:
    """The responses being pumped now: each between the lease of its lane and its end."""

    def __init__(self) -> None:
        self._open: set[tuple[Downstream, Channel]] = set()

    def __len__(self) -> int:
        return len(self._open)

    def pumping(self, down: Downstream, channel: Channel) -> Pumping:
        """``with streams.pumping(down, channel)``: ``down`` is fed from ``channel`` inside the block."""
        return Pumping(self._open, (down, channel))

    async def cut_all(self) -> None:
        """End every response still streaming (:func:`cut_stream`)."""
        for down, channel in list(self._open):
            await cut_stream(down, channel)


async def cut_stream(down: Downstream, channel: Channel) -> None:
    """End an in-flight SSE stream now, with one error event the app can act on.

    Used when the drain's grace runs out: like any failure after output, never a truncated
    body behind a 200. Later writes of the handler are dropped (``down.gone``).
    """
    if not down.stream or not down.written or down.gone:
        return
    out = channel.proxy_error_out(
        type="server_error",
        code="shutting_down",
        message="The sidecar shut down before the response finished; retry the request.",
    )
    with contextlib.suppress(Exception):
        await down.write([out])
        await down.end()
    down.gone = True
