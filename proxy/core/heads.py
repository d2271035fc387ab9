"""The records of the head index: what a head is, and what a lookup answers.

A :class:`Head` is the end state of one completed response (its input as digests, its output as
fingerprints, its response id, the lane that holds it); :class:`Match` and :class:`Lookup` are
what :meth:`proxy.core.conversation.HeadTable.lookup` returns; a :class:`Listener` is told of the
heads the table records and lets go; :func:`stronger` ranks the reasons a lookup misses. Kept
apart from the table so that a reader (the planner, the miss explainer) can hold the data
without the matching rules.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.core.explain import EchoFields
from proxy.core.items import OutputFingerprint
from proxy.core.request import ParsedRequest
from proxy.reasons import Hit, MissReason

__all__ = ["Head", "Listener", "Lookup", "Match", "Recorded", "stronger"]


class Listener(Protocol):
    """Told of the heads the table records and lets go (the miss explainer)."""

    def recorded(self, head: Head, source: Recorded) -> None:
        """``head`` was recorded from the full history ``source.req`` (never for a chained
        request); the listener keeps what it needs of its output (:attr:`Head.echo`)."""
        ...

    def discarded(self, head: Head) -> None:
        """``head`` (not chained) left the table; ``head.anchor`` is still the one it had."""
        ...


@dataclass(frozen=True, slots=True)
class Recorded:
    """What a head is recorded from: its request (``state``: the hash state of its input;
    ``prefix_state``: its body's prefix hashed off the loop, or ``None``) and its output items
    (``seen``: their projections), for the prefix cache and the listener."""

    req: ParsedRequest
    state: Any
    prefix_state: Any
    items: list[dict[str, Any]]
    seen: list[dict[str, Any]]


@dataclass(slots=True)
class Head:
    """The end state of one completed response on one socket."""

    identity: str
    anchor: Hashable
    response_id: str
    settings: bytes
    n_input: int
    input_digest: bytes
    output: tuple[OutputFingerprint, ...]
    last_used: float
    store: bool = False
    """The response was stored upstream: it can be continued from any socket (hydration)."""
    chained: bool = False
    """The app chained this turn itself (``previous_response_id``): its input is a delta, so
    the head serves only :meth:`~proxy.core.conversation.HeadTable.anchor_for`, never full-history matching."""
    items: bytes | None = None
    """8 bytes per input item (:func:`~proxy.core.explain.item_digests`), to explain misses."""
    echo: tuple[EchoFields, ...] = ()
    """Per output item, its projected fields' digests (:func:`~proxy.core.explain.echo_fields`),
    set by the table's listener (the miss explainer's notes: only they read it)."""
    compactions: tuple[bytes, ...] = ()
    """Digests of the ``encrypted_content`` of the ``compaction`` items of its output."""
    bare: tuple[int, Any] | None = None
    """Under ``reasoning.context: current_turn``: its input's items other than reasoning, counted,
    and the SHA-256 state over their keys (:class:`~proxy.core.sideindex.BareIndex`)."""


@dataclass(frozen=True, slots=True)
class Match:
    """A continuation: send ``new_items`` with ``previous_response_id=response_id`` on ``anchor``."""

    anchor: Hashable
    response_id: str
    new_items: list[Any]
    items_avoided: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """The outcome of :meth:`~proxy.core.conversation.HeadTable.lookup`."""

    match: Match | None
    reason: Hit | MissReason
    """``continuation`` with a match, else why there is none."""
    dropped_reasoning: int = 0
    """Reasoning items of the head's output that the echo left out."""
    dropped_phase: int = 0
    """Assistant messages of the head's output that the echo sent without their ``phase``."""


_STRENGTH: dict[MissReason, int] = {
    MissReason.NO_HEAD: 0,
    MissReason.DIVERGED: 1,
    MissReason.NO_NEW_ITEMS: 2,
    MissReason.RETRY: 3,
    MissReason.DROPPED_REASONING: 4,
    MissReason.DROPPED_PHASE: 4,
    MissReason.HEAD_BUSY: 5,
    MissReason.PRUNED_AT_COMPACTION: 1,
}


def stronger(current: MissReason, candidate: MissReason) -> MissReason:
    """The more specific of two miss reasons (the one closest to a continuation)."""
    return candidate if _STRENGTH.get(candidate, 0) > _STRENGTH.get(current, 0) else current
