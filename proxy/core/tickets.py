"""The records of the memory budget (:class:`proxy.core.budget.Budget`): a request's share
(:class:`Ticket`) and its state (:class:`Verdict`), and what a budget call tells its caller to do
(:class:`Effects`). Kept apart from the accounting so that a holder (the gate, the relay's meter)
can hold them without the rules.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["Effects", "Ticket", "Verdict"]


class Verdict(enum.StrEnum):
    """The state of a :class:`Ticket`."""

    GRANTED = "granted"
    WAITING = "waiting"
    TOO_LARGE = "too_large"
    CANCELLED = "cancelled"
    RELEASED = "released"


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's share of the budget."""

    want: int
    """Bytes asked for (granted: held)."""
    held: int = 0
    """Bytes counted now: ``want`` once granted; while waiting, what the connection's buffers
    already hold of the unread body (see :meth:`Budget.ask`)."""
    verdict: Verdict = Verdict.WAITING
    waited: bool = False
    """Whether it had to queue."""
    key: Hashable = None
    """Whose request it is (the identity): waiters are admitted round-robin over keys."""
    need: int = 0
    """The most it will hold once its body is read (above ``want``: a body still arriving,
    granted step by step, see :meth:`Budget.ask`)."""
    more: int = 0
    """A growth waiting in the queue (a granted ticket whose next step did not fit)."""
    promise: int = -1
    """What a body being read may still grow by as far as its observed rate shows
    (:meth:`Budget.observe`); -1: not observed yet, its declared ``need``."""
    slow: bool = False
    """Its observed rate cannot deliver the rest of its body before its deadline: its growths
    wait behind new requests."""
    keyless: bool = False
    """Sent without a credential: shares the keyless quota (:data:`KEYLESS_SHARE`)."""


@dataclass(slots=True)
class Effects:
    """What the caller must do after a budget call."""

    granted: list[Ticket] = field(default_factory=list)
    """Tickets that were waiting and are granted now (wake them)."""
    evict: list[Hashable] = field(default_factory=list)
    """Kept bodies to let go of (already no longer counted)."""
