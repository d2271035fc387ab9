"""How long a turn whose lane cannot be had now waits: the waiting rule applied to the sockets.

:func:`proxy.core.waiting.wait_seconds` decides from measured quantities; :class:`Patience`
gathers them (how soon one of the identity's busy lanes frees, with the turns already queued
for one going first; what the lane saves against the turn's alternative) and keeps each turn's
:class:`~proxy.core.waiting.Waiting` (its rule, deadline, outcome and place in its identity's
queue). Three rules set a deadline:

- :meth:`Patience.wait` (``BUSY``): for a busy lane, while the expected wait is shorter than
  what the lane saves, never beyond ``pool.wait_seconds``;
- :meth:`Patience.brief` (``BRIEF``): a stored turn whose lanes are a moment away waits
  ``pool.http_continuation_after_seconds``, then goes over HTTP, which it can at once;
- :meth:`Patience.grow` (``GROW``): a new head waits for lanes a moment away (a handshake, a
  probe), ``pool.wait_seconds`` from when the growing stops, at most ``connect_seconds`` more;
  once what a lane saves a new head is measured (its next turn continued in memory), only
  while the new heads' recent waits for such lanes are shorter than that saving, and never
  beyond it nor past :data:`~proxy.core.waiting.LINGER` times those waits.

Each returns whether the turn (still) waits; when it stops waiting it says why
(:attr:`Waiting.outcome`). Nothing here reads a clock.
"""

from __future__ import annotations

from collections import Counter

from proxy.core.lanes import LaneLimits
from proxy.core.sockets import SocketBook
from proxy.core.waiting import LINGER, Estimates, Send, Waiting, WaitRule, wait_seconds
from proxy.reasons import WaitOutcome

__all__ = ["Patience"]


class Patience:
    """Turns waiting for lanes, and the estimates their waits are decided from.

    Args:
        limits: The pool limits (``wait_seconds``, ``connect_seconds``, HTTP continuations).
        book: The sockets (how soon a busy lane of an identity frees).
    """

    def __init__(self, limits: LaneLimits, book: SocketBook) -> None:
        self.limits = limits
        self.book = book
        self.estimates = Estimates()
        """Measured lane busy times and upstream times, per identity (the waiting rule's inputs)."""
        self._queued: Counter[str] = Counter()
        """Turns waiting for a busy lane, by identity (their queue)."""

    def wait(self, waiting: Waiting, now: float, expected: float, saving: float) -> bool:
        """Whether the turn waits (on) for a busy lane expected to free in ``expected`` seconds
        and saving ``saving``: its deadline is set when it starts to (the time already spent
        counted against the saving and the bound), and it waits until then."""
        if waiting.rule is not WaitRule.BUSY:
            limit = self.limits.wait_seconds
            spent = now - waiting.started if waiting.deadline is not None else 0.0
            seconds = wait_seconds(expected, saving - spent, limit - spent)
            if seconds <= 0.0:
                waiting.outcome = WaitOutcome.WAIT_NOT_WORTH_IT
                return False
            waiting.rule, waiting.deadline = WaitRule.BUSY, now + seconds
        return self._until(waiting, now)

    def brief(self, waiting: Waiting, now: float) -> bool:
        """A stored turn whose lanes are a moment away (nothing measured says how long) waits
        ``pool.http_continuation_after_seconds`` at most, from when it asked."""
        if waiting.rule is not WaitRule.BRIEF:
            waiting.rule = WaitRule.BRIEF
            waiting.deadline = waiting.started + self.limits.http_continuation_after_seconds
        return self._until(waiting, now)

    def grow(self, waiting: Waiting, now: float, identity: str = "", size: int = 0, store: bool = True) -> bool:
        """A new head's wait for lanes a moment away: ``pool.wait_seconds`` counts from when the
        growing stops, at most ``timeouts.connect_seconds`` later. Once what a lane saves a new
        head of ``identity`` (a ``size``-byte request, ``store``) is measured, it waits only if
        the recent waits for such lanes were shorter than that, and never longer than the
        saving nor :data:`LINGER` times those waits (all counted from when it asked)."""
        lim = self.limits
        cap = waiting.started + lim.wait_seconds + lim.connect_seconds
        deadline = min(now + lim.wait_seconds, cap)
        saving = self.estimates.head_saving(identity, size, store) if identity else None
        if saving is not None:
            expected = self.estimates.grow(identity)
            if saving <= 0.0 or (expected is not None and expected >= saving):
                waiting.outcome = WaitOutcome.WAIT_NOT_WORTH_IT
                return False
            bound = saving if expected is None else min(saving, expected * LINGER)
            deadline = min(deadline, waiting.started + bound)
        waiting.rule, waiting.deadline = WaitRule.GROW, deadline
        waiting.growing, waiting.identity = True, identity
        if self._until(waiting, now):
            return True
        if identity:  # it gave up: such a wait takes at least this long
            self.estimates.observe_grow(identity, now - waiting.started)
        return False

    def ended(self, waiting: Waiting, now: float, lane: bool) -> None:
        """The turn that waited has a plan that is not a wait (``lane``: a lane of its own): it
        leaves its queue, and a new head's wait for lanes a moment away that got one is a
        sample of how long those take."""
        self.unqueue(waiting)
        if waiting.deadline is None or not lane:
            return
        waiting.outcome = WaitOutcome.LANE
        if waiting.rule is WaitRule.GROW and waiting.identity:
            self.estimates.observe_grow(waiting.identity, now - waiting.started)

    @staticmethod
    def _until(waiting: Waiting, now: float) -> bool:
        assert waiting.deadline is not None
        if now < waiting.deadline:
            return True
        waiting.outcome = WaitOutcome.WAIT_EXPIRED
        return False

    def stored_saving(self, identity: str, size: int) -> float:
        """What a stored head's lane saves against the alternative it has now (an HTTP
        continuation, or the full input over HTTP when those are off)."""
        alternative = Send.HTTP_CONTINUE if self.limits.http_continuations else Send.HTTP_FULL
        return self.estimates.saving(identity, alternative, size)

    def remaining(self, identity: str, elapsed: float) -> float:
        """Expected seconds until a lane of ``identity`` busy for ``elapsed`` seconds frees."""
        return self.estimates.remaining(identity, elapsed)

    def soonest(self, identity: str, now: float, waiting: Waiting) -> float:
        """Expected seconds until a lane of ``identity``'s busy sockets frees for this turn:
        the turns already waiting for one go first (each socket frees one after another, every
        busy time, in the order its current response is expected to end)."""
        ahead = self._queued[identity] - (1 if waiting.queued else 0)
        busy = self.estimates.busy(identity)
        # The longest busy frees first: ``remaining`` never grows with the time passed, so the
        # sockets in the order they began are in the order they are expected to free.
        began = sorted(s.used_at for s in self.book.of(identity).values() if s.live and s.active)
        if not began:
            return busy
        rounds, slot = divmod(max(ahead, 0), len(began))
        return self.estimates.remaining(identity, now - began[slot]) + rounds * busy

    def queue(self, identity: str, waiting: Waiting) -> None:
        """``waiting`` waits for one of ``identity``'s busy lanes (its place in the queue)."""
        if not waiting.queued:
            waiting.queued = True
            waiting.identity = identity
            self._queued[identity] += 1

    def unqueue(self, waiting: Waiting) -> None:
        """The turn's wait ended (a plan, or the request went away): it leaves the queue."""
        if waiting.queued:
            waiting.queued = False
            self._queued[waiting.identity] -= 1
            if self._queued[waiting.identity] <= 0:
                del self._queued[waiting.identity]
