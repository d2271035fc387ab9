"""What the miss explainer keeps of the heads a :class:`~proxy.core.conversation.HeadTable`
records: one digest per setting for each distinct settings digest (LRU, shared by every head with
those settings), and where each head's input ends. The table tells it as it records and lets go
of heads (it is the table's listener); it imports nothing of the table, so the table's calls go
down to it. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

from proxy.core.explain import DIGEST, SettingsFields, settings_fields
from proxy.core.request import ParsedRequest

__all__ = ["HeadNotes", "end_key"]


class _Head(Protocol):
    """What the notes read of a head (:class:`proxy.core.conversation.Head`)."""

    identity: str
    anchor: Hashable
    response_id: str
    settings: bytes
    n_input: int
    items: bytes | None


class HeadNotes:
    """The explainer's notes on a head table's heads."""

    MAX_SETTINGS_FIELDS = 1024
    """Distinct settings whose per-setting digests are kept (LRU)."""

    def __init__(self) -> None:
        self.settings_fields: OrderedDict[bytes, SettingsFields] = OrderedDict()
        """Per settings digest, one digest per setting (LRU, shared by heads)."""
        self.ends: dict[tuple[str, int, bytes], tuple[int, Hashable, str]] = {}
        """``(identity, input length, last input item's digest)`` → the serial, anchor and
        response id of the latest head recorded with it: where a busy key's heads are found by
        a miss without scanning them (an edited early item leaves the head's last input item
        where it was). Never the head itself: a head the table let go is not kept alive here,
        and its entry goes with it (:meth:`discarded`), so there are never more entries than
        heads in the table (a conversation's turns leave one, not one each)."""
        self.serial = 0
        """Heads recorded so far (a miss looks only at those recorded before it)."""

    def recorded(self, head: _Head, req: ParsedRequest) -> None:
        """``head`` was recorded from the full history ``req``: keep its settings' digests and
        index it by how its input ends."""
        self.serial += 1
        key = end_key(head)
        if key is not None:
            self.ends[key] = (self.serial, head.anchor, head.response_id)
        digest = head.settings
        if digest in self.settings_fields:
            self.settings_fields.move_to_end(digest)
            return
        self.settings_fields[digest] = settings_fields(req.fields)
        while len(self.settings_fields) > self.MAX_SETTINGS_FIELDS:
            self.settings_fields.popitem(last=False)

    def discarded(self, head: _Head) -> None:
        """``head`` left the table (replaced, expired, evicted, its socket closed or its
        anchor rekeyed): its entry in the index goes, unless a later head ending alike, under
        another anchor, took the entry over."""
        key = end_key(head)
        if key is not None:
            entry = self.ends.get(key)
            if entry is not None and entry[1] == head.anchor:
                del self.ends[key]


def end_key(head: _Head) -> tuple[str, int, bytes] | None:
    """Where :attr:`HeadNotes.ends` files ``head``: its identity, input length and last input
    item's digest (``None`` without item digests)."""
    n, items = head.n_input, head.items
    if n > 0 and items is not None and len(items) == n * DIGEST:
        return head.identity, n, items[-DIGEST:]
    return None
