"""The last explained misses, for the admin listener (``GET /misses`` and the status page).

A bounded ring of what the access log says about each miss: the reason and the explanation
(:class:`~proxy.core.explain.Explanation`: item index, type, field path, candidate length),
never content; the caller's identity only as a digest prefix. Process-wide, like
:data:`proxy.observe.metrics.REGISTRY`, so several in-process sidecars (tests) share it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from proxy.core.explain import Explanation

__all__ = ["RECENT", "Miss", "MissRing"]


@dataclass(frozen=True, slots=True)
class Miss:
    """One miss as shown on the admin listener."""

    at: float
    """Wall-clock time (seconds since the epoch)."""
    reason: str
    items_in: int
    explanation: Explanation | None

    def as_dict(self) -> dict[str, Any]:
        exp = self.explanation
        fields = (
            exp.fields()
            if exp is not None
            else dict.fromkeys(("miss_item", "miss_type", "miss_field", "miss_detail", "candidate_items"))
        )
        return {
            "at": round(self.at, 3),
            "reason": self.reason,
            "identity": exp.identity if exp is not None else "",
            "items_in": self.items_in,
            **fields,
        }


class MissRing:
    """The last ``size`` misses, newest last (thread-safe: workers may share a process)."""

    def __init__(self, size: int = 50) -> None:
        self._ring: deque[Miss] = deque(maxlen=size)
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._ring.maxlen or 0

    def add(self, reason: str, items_in: int, explanation: Explanation | None) -> None:
        with self._lock:
            self._ring.append(Miss(time.time(), reason, items_in, explanation))

    def latest(self, limit: int | None = None) -> list[Miss]:
        """Newest first."""
        with self._lock:
            items = list(self._ring)
        items.reverse()
        return items[:limit] if limit is not None else items

    def clear(self) -> None:
        with self._lock:
            self._ring.clear()


RECENT = MissRing()
"""The process's ring of recent misses."""
