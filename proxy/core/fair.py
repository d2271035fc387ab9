"""Fair shares: which item to give up when a shared bound is reached.

Items (conversation heads, kept bodies) belong to a group (an identity's tenant) and weigh
something (1 for a head, its size for a kept body). When the bound is reached, the victim is the
least recently used item of the *heaviest* group: a tenant that opens ten times its share evicts
its own heads and bodies, never another tenant's while it holds more than that one. A group is
the tenant of the identity it is given (:func:`tenant_of`): a caller that splits one credential
into many identities (query strings, optional headers) is still one group.

Pure and O(log groups) per change (a lazy max-heap of group totals).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["TENANT_CHARS", "FairShares", "tenant_of"]

TENANT_CHARS = 16
"""An identity digest starts with its tenant's: this many hex characters of the sha256 of the
app's credential (:mod:`proxy.intake.identity`)."""


def tenant_of(identity: str) -> str:
    """The tenant of an identity digest: whose quota and whose share it counts against."""
    return identity[:TENANT_CHARS]


class FairShares:
    """Per-group LRU order and weight totals; :meth:`victim` is the heaviest group's oldest."""

    def __init__(self) -> None:
        self._items: dict[str, OrderedDict[Hashable, int]] = {}
        self._group_of: dict[Hashable, str] = {}
        self._totals: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []

    def __len__(self) -> int:
        return len(self._group_of)

    def total(self, group: str) -> int:
        """The weight ``group`` (an identity's tenant) holds."""
        return self._totals.get(tenant_of(group), 0)

    def add(self, group: str, item: Hashable, weight: int = 1) -> None:
        """``item`` of ``group`` (an identity: its tenant is the group) now weighs ``weight``
        and is the group's most recent."""
        group = tenant_of(group)
        if self._group_of.get(item, group) != group:
            self.remove(item)
        self._group_of[item] = group
        items = self._items.setdefault(group, OrderedDict())
        old = items.pop(item, 0)
        items[item] = weight
        self._set(group, self._totals.get(group, 0) - old + weight)

    def touch(self, item: Hashable) -> None:
        """``item`` was used: its group's most recent."""
        group = self._group_of.get(item)
        if group is not None:
            self._items[group].move_to_end(item)

    def remove(self, item: Hashable) -> None:
        """``item`` is gone (no-op if unknown)."""
        group = self._group_of.pop(item, None)
        if group is None:
            return
        items = self._items[group]
        weight = items.pop(item)
        if not items:
            del self._items[group]
        self._set(group, self._totals.get(group, 0) - weight)

    def victim(self) -> Hashable | None:
        """The least recently used item of the group with the most weight (``None``: empty)."""
        while self._heap:
            negative, group = self._heap[0]
            if self._totals.get(group) == -negative and group in self._items:
                return next(iter(self._items[group]))
            heapq.heappop(self._heap)  # stale entry
        return None

    def _set(self, group: str, total: int) -> None:
        if total <= 0 and group not in self._items:
            self._totals.pop(group, None)
            return
        self._totals[group] = total
        heapq.heappush(self._heap, (-total, group))
        if len(self._heap) > 4 * len(self._totals) + 64:  # drop stale entries now and then
            self._heap = [(-t, g) for g, t in self._totals.items()]
            heapq.heapify(self._heap)
