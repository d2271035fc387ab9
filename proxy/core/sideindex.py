"""The side indexes: heads found for a history that does not start with their input.

:meth:`proxy.core.conversation.HeadTable.lookup` matches a request against the heads whose input
its own input starts with. Two kinds of history read the same to the model without starting that
way, and each has a small index of its own here, consulted only after that search misses:

- **Pruned at a compaction item** (:class:`CompactionIndex`): the model reads a context from its
  latest compaction item on (protocol.md §7), so a history that starts with a compaction item of
  a head's output continues that head when it echoes the output from that item on.
- **Reasoning left out under ``current_turn``** (:class:`BareIndex`): under
  ``reasoning.context: current_turn`` the model reads no reasoning before the last user message,
  so reasoning items an app left out of (or kept in) that part of its history change nothing it
  reads (docs/fidelity.md). Such a head is indexed by the count of its input's items other than
  reasoning and a digest over their keys; it continues when a user message follows the echo of
  its output.

Apart from the table because only these rarely taken paths need them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any

from proxy.core.heads import Head
from proxy.core.request import ParsedRequest
from proxy.reasons import MissReason

__all__ = [
    "BARE_AFTER",
    "current_turn",
    "user_turn",
    "BareIndex",
    "CompactionIndex",
    "bare_state",
    "digest_of",
    "is_reasoning",
]


class CompactionIndex:
    """identity → digest of a ``compaction`` item's ``encrypted_content`` in a head's output →
    that head's anchor."""

    def __init__(self) -> None:
        self._by_identity: dict[str, dict[bytes, Hashable]] = {}

    def holds(self, identity: str) -> bool:
        """Whether any head of ``identity`` holds a compaction item."""
        return bool(self._by_identity.get(identity))

    def add(self, head: Head) -> None:
        """Index the compaction items of ``head``'s output under its anchor."""
        for held in head.compactions:
            self._by_identity.setdefault(head.identity, {})[held] = head.anchor

    def remove(self, head: Head, anchor: Hashable) -> None:
        """Forget the compaction items of ``head``, indexed under ``anchor``."""
        known = self._by_identity.get(head.identity, {})
        for held in head.compactions:
            if known.get(held) == anchor:
                del known[held]
        if not known:
            self._by_identity.pop(head.identity, None)

    def anchor_of(self, identity: str, item: dict[str, Any]) -> Hashable | None:
        """The anchor of the head of ``identity`` whose output holds the compaction ``item``."""
        content = item.get("encrypted_content")
        return self._by_identity.get(identity, {}).get(digest_of(content)) if isinstance(content, str) else None


def digest_of(value: str) -> bytes:
    """A 16-byte digest of a string (a compaction item's ``encrypted_content``)."""
    return hashlib.sha256(value.encode()).digest()[:16]


class BareIndex:
    """(identity, settings) → (input items other than reasoning, their digest) → anchors."""

    def __init__(self) -> None:
        self._table: dict[tuple[str, bytes], dict[tuple[int, bytes], list[Hashable]]] = {}

    def holds(self, identity: str, settings: bytes) -> bool:
        """Whether any head of ``identity`` with ``settings`` is indexed."""
        return bool(self._table.get((identity, settings)))

    def add(self, head: Head) -> None:
        """Index ``head`` (its :attr:`~proxy.core.heads.Head.bare` is set) under its anchor."""
        assert head.bare is not None
        key = (head.bare[0], head.bare[1].digest()[:16])
        self._table.setdefault((head.identity, head.settings), {}).setdefault(key, []).append(head.anchor)

    def remove(self, head: Head, anchor: Hashable) -> None:
        """Forget ``head``, indexed under ``anchor``."""
        assert head.bare is not None
        table = self._table.get((head.identity, head.settings), {})
        key = (head.bare[0], head.bare[1].digest()[:16])
        anchors = table.get(key)
        if anchors is not None and anchor in anchors:
            anchors.remove(anchor)
            if not anchors:
                del table[key]
        if not table:
            self._table.pop((head.identity, head.settings), None)

    def candidates(self, identity: str, req: ParsedRequest, items: list[Any]) -> list[tuple[int, Hashable]]:
        """``(n, anchor)`` of the heads whose input equals ``items[:n]`` but for reasoning items,
        the shortest first (``items`` is ``req``'s whole input)."""
        table = self._table[(identity, req.settings_digest)]
        lengths = {n for n, _ in table}
        keys = req.item_keys()
        state = hashlib.sha256()
        count = 0
        found: list[tuple[int, Hashable]] = []
        for index, (item, key) in enumerate(zip(items, keys, strict=True)):
            if is_reasoning(item):
                continue
            state.update(key)
            count += 1
            if count in lengths:
                found += [(index + 1, anchor) for anchor in table.get((count, state.digest()[:16]), ())]
        return found


def bare_state(base: Head | None, req: ParsedRequest) -> tuple[int, Any]:
    """:attr:`~proxy.core.heads.Head.bare` for ``req``: extended from ``base`` (the head whose
    prefix a fast parse skipped) when it still describes that prefix, else counted over the whole
    input."""
    if base is not None and req.base is not None and req.tail is not None:
        if (
            base.bare is not None
            and base.n_input == req.base.count
            and base.input_digest == req.base.input_state.digest()[:16]
        ):
            count, state = base.bare[0], base.bare[1].copy()
            for item, key in zip(req.tail, req.tail_keys(), strict=True):
                if not is_reasoning(item):
                    state.update(key)
                    count += 1
            return count, state
    state = hashlib.sha256()
    count = 0
    for item, key in zip(req.all_items(), req.item_keys(), strict=True):
        if not is_reasoning(item):
            state.update(key)
            count += 1
    return count, state


def is_reasoning(item: Any) -> bool:
    """Whether ``item`` is a reasoning item."""
    return isinstance(item, dict) and item.get("type") == "reasoning"


def current_turn(req: ParsedRequest) -> bool:
    """Whether ``req`` asks for ``reasoning.context: current_turn`` (``auto`` or absent: read as
    ``all_turns``, the stricter rule, since what ``auto`` means depends on the model)."""
    reasoning = req.fields.get("reasoning")
    return isinstance(reasoning, dict) and reasoning.get("context") == "current_turn"


BARE_AFTER = frozenset({MissReason.NO_HEAD, MissReason.DIVERGED, MissReason.DROPPED_REASONING})
"""Misses after which a ``current_turn`` request tries the heads whose input differs only in reasoning."""


def user_turn(items: Sequence[Any], start: int) -> bool:
    """Whether a user message is among ``items[start:]`` (a new user turn begins there)."""
    for index in range(start, len(items)):
        item = items[index]
        if isinstance(item, dict) and item.get("role") == "user" and item.get("type", "message") == "message":
            return True
    return False
