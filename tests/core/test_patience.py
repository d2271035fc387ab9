"""The waiting rule applied, as transcripts: a turn's wait decided step by step with the clock
passed in (the rule itself is tests/core/test_waiting.py's)."""

from __future__ import annotations

import random

from proxy.core.lanes import LaneLimits
from proxy.core.patience import Patience
from proxy.core.waiting import Send, Waiting, WaitRule
from proxy.reasons import WaitOutcome
from tests.core.test_sockets import custody


def patience(**limits: object) -> Patience:
    c = custody(**limits)
    return Patience(c.book.limits, c.book)


def test_a_busy_wait_sets_its_deadline_once_and_expires() -> None:
    p = patience(wait_seconds=1.0)
    w = Waiting(0.0)
    assert not p.wait(w, 0.0, expected=0.5, saving=0.1)  # the lane saves less than the wait costs
    assert w.outcome is WaitOutcome.WAIT_NOT_WORTH_IT and w.deadline is None
    w = Waiting(0.0)
    assert p.wait(w, 0.0, expected=0.2, saving=2.0)
    assert (w.rule, w.deadline) == (WaitRule.BUSY, 0.2 * 1.5)
    assert p.wait(w, 0.25, expected=9.0, saving=0.0)  # the deadline stands once set
    assert not p.wait(w, 0.31, expected=0.2, saving=2.0) and w.outcome is WaitOutcome.WAIT_EXPIRED


def test_a_brief_wait_and_a_growing_one() -> None:
    p = patience(wait_seconds=1.0, connect_seconds=2.0, http_continuation_after_seconds=0.01)
    w = Waiting(5.0)
    assert p.brief(w, 5.0) and w.deadline == 5.01 and not p.brief(w, 5.02)
    g = Waiting(0.0)
    assert p.grow(g, 0.0) and g.deadline == 1.0 and g.growing
    assert p.grow(g, 1.5) and g.deadline == 2.5  # counted from when the growing stops ...
    assert p.grow(g, 2.5) and g.deadline == 3.0  # ... at most connect_seconds later
    assert not p.grow(g, 3.0) and g.outcome is WaitOutcome.WAIT_EXPIRED


def test_turns_queue_behind_each_other_for_busy_sockets() -> None:
    p = patience()
    book = p.book
    for _ in range(2):
        lane = book.open("id", 0.0)
        book.opened(lane.key[0], 0.0)
        book.begin(lane, 0.0)
    for _ in range(5):
        p.estimates.observe_busy("id", 1.0)
    first, second, third = Waiting(0.0), Waiting(0.0), Waiting(0.0)
    assert p.soonest("id", 0.5, first) == 0.5
    p.queue("id", first)
    p.queue("id", second)
    assert p.soonest("id", 0.5, second) == 0.5  # the other socket frees for it
    assert p.soonest("id", 0.5, third) == 1.5  # two ahead, two sockets: the next round
    p.unqueue(first)
    p.unqueue(first)  # leaving twice is leaving once
    assert p.soonest("id", 0.5, third) == 0.5


def test_a_stored_heads_saving_is_against_its_http_alternative() -> None:
    p = patience()
    p.estimates.observe_upstream("id", Send.CONTINUE, 1000, 1.0)
    p.estimates.observe_upstream("id", Send.HTTP_CONTINUE, 1000, 3.0)
    p.estimates.observe_upstream("id", Send.HTTP_FULL, 1000, 5.0)
    assert p.stored_saving("id", 1000) == 2.0
    off = Patience(LaneLimits(http_continuations=False), p.book)
    off.estimates = p.estimates
    assert off.stored_saving("id", 1000) == 4.0


def test_soonest_is_the_queued_turns_share_of_every_busy_sockets_remaining_time() -> None:
    """``soonest`` picks the socket in the order they began (one ``remaining`` call), which is
    the order of their remaining times because ``remaining`` never grows with the time passed:
    the same answer as sorting every socket's remaining time."""
    rng = random.Random(3)
    p = patience()
    book = p.book
    for _ in range(6):
        lane = book.open("id", 0.0)
        book.opened(lane.key[0], 0.0)
    for busy in (0.3, 2.0, 9.0):
        p.estimates.observe_busy("id", busy)
        for now in (0.0, 1.0, 4.0, 20.0):
            for sock in book.of("id").values():
                lane = next(iter(sock.lanes.values()))
                if sock.active:
                    book.end(sock, lane)
                if rng.random() < 0.7:
                    book.begin(lane, now - rng.choice((0.0, 0.1, 0.5, 3.0, 30.0)))
            active = [s for s in book.of("id").values() if s.active]
            left = sorted(p.estimates.remaining("id", now - s.used_at) for s in active)
            for ahead in range(8):
                w, queued = Waiting(now), [Waiting(now) for _ in range(ahead)]
                for q in queued:
                    p.queue("id", q)
                rounds, slot = divmod(ahead, len(left)) if left else (0, 0)
                want = left[slot] + rounds * p.estimates.busy("id") if left else p.estimates.busy("id")
                assert p.soonest("id", now, w) == want
                for q in queued:
                    p.unqueue(q)
    values = [p.estimates.remaining("id", e) for e in (0.0, 0.1, 1.0, 5.0, 50.0)]
    assert values == sorted(values, reverse=True)  # never grows with the time passed
