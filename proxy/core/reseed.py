"""Re-seeding: keep a ``store: false`` conversation hot across a planned socket rotation.

A ``store: false`` head lives only in its lane's cache: when the socket is rotated (before the
upstream's 60-minute limit) the next turn would be a cold full send. With ``pool.reseed`` on, the
sidecar keeps each such head's context (the app's last request body and the response's output
items, within ``pool.reseed_bytes``, least recently used first out) and, when the socket is
rotated while idle, sends a ``generate: false`` create with that full context on a fresh lane:
the upstream prepares the state without generating (never billed as a generation, never seen by
the app), and the head moves to the new lane under the warm-up's response id. The context the
model sees is the same (input + output of the head's response), so the next turn continues with
``previous_response_id`` and only its new items. A failed re-seed only loses the head (the next
turn is a full send, as without re-seeding).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.fields import TRANSPORT_ONLY_FIELDS
from proxy.core.lanes import LaneKey
from proxy.errors import InvalidRequest

__all__ = ["Kept", "KeptContexts", "Reseed", "Tick", "reseed_frame"]


@dataclass(frozen=True, slots=True)
class Kept:
    """What a re-seed needs of one head."""

    body: bytes
    """The app's request body of the head's turn."""
    output: list[Any]
    """The output items of the head's response."""
    size: int


@dataclass(frozen=True, slots=True)
class Reseed:
    """Rebuild the ``store: false`` head kept under ``anchor`` on a new lane of ``identity``."""

    identity: str
    anchor: LaneKey
    kept: Kept


@dataclass(slots=True)
class Tick:
    """What housekeeping found to do (:func:`proxy.core.rotation.rotate`)."""

    close: list[int]
    """Sockets to close."""
    ages: list[float]
    """Ages of the sockets closed by rotation."""
    reseed: list[Reseed]
    """Heads to re-seed on a new lane (their socket was rotated)."""


class KeptContexts:
    """Contexts of ``store: false`` heads, by response id, bounded by bytes (LRU).

    Args:
        budget: Bytes kept at most (bodies and serialised outputs).
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.size = 0
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, response_id: str, body: bytes, output: list[Any]) -> None:
        """Keep the context of ``response_id`` (dropping the oldest beyond the budget)."""
        size = len(body) + len(orjson.dumps(output))
        if size > self.budget:
            return
        self.drop(response_id)
        self._kept[response_id] = Kept(body, output, size)
        self.size += size
        while self.size > self.budget and self._kept:
            _, oldest = self._kept.popitem(last=False)
            self.size -= oldest.size

    def get(self, response_id: str) -> Kept | None:
        """The kept context of ``response_id``."""
        return self._kept.get(response_id)

    def drop(self, response_id: str) -> Kept | None:
        """Forget ``response_id``'s context; returns it."""
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self.size -= kept.size
        return kept

    def move(self, old: str, new: str) -> None:
        """The head was re-seeded under a new response id."""
        kept = self.drop(old)
        if kept is not None:
            self._kept[new] = kept
            self.size += kept.size


def reseed_frame(kept: Kept, stream_id: str | None) -> bytes:
    """The ``generate: false`` create that rebuilds the head's context on a new lane: the app's
    own fields (transport-only ones dropped), its input followed by the response's output.

    Raises:
        InvalidRequest: the kept body cannot be re-read (it was valid when kept: never expected).
    """
    try:
        fields = json.loads(kept.body.decode("utf-8"))  # the stdlib keeps every integer exact
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"kept body unreadable: {exc}") from None
    if not isinstance(fields, dict):
        raise InvalidRequest("kept body is not an object")
    raw_input = fields.get("input")
    items = [{"role": "user", "content": raw_input}] if isinstance(raw_input, str) else list(raw_input or [])
    frame: dict[str, Any] = {"type": "response.create"}
    if stream_id is not None:
        frame["stream_id"] = stream_id
    for key, value in fields.items():
        if key not in TRANSPORT_ONLY_FIELDS and key not in ("input", "previous_response_id", "type", "generate"):
            frame[key] = value
    frame["input"] = items + kept.output
    frame["generate"] = False
    return json.dumps(frame, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
