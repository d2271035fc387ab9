"""Promises backed by evidence (the budget's rules; the sidecar-level attack is
tests/security/test_trickled_promises.py): a body being read counts against other bodies only
as far as its observed rate can deliver it, keyless requests share one small quota, and a body
too slow to finish in time grows only behind new requests."""

from __future__ import annotations

from proxy.core.budget import KEYLESS_SHARE, Budget, Verdict


def test_an_observed_trickle_promises_what_it_can_deliver_not_what_it_declared() -> None:
    budget = Budget(1000)
    trickle, _ = budget.ask(40, key="mallory", need=900)
    assert trickle.verdict is Verdict.GRANTED
    # Declared: 860 more; a large body of another tenant does not fit beside that promise.
    blocked, _ = budget.ask(40, key="alice", need=200)
    assert blocked.verdict is Verdict.WAITING
    budget.release(blocked)
    # Observed: it can deliver 60 more before its deadline; the large body is admitted now.
    budget.observe(trickle, 60, slow=True)
    large, _ = budget.ask(40, key="alice", need=200)
    assert large.verdict is Verdict.GRANTED
    # A promise is never above the declared need.
    budget.observe(trickle, 10_000)
    assert budget._promised() == 160 + 860  # noqa: SLF001


def test_a_waiter_is_admitted_once_the_promises_it_waits_behind_are_observed_smaller() -> None:
    budget = Budget(1000)
    trickle, _ = budget.ask(40, key="mallory", need=900)
    waiting, _ = budget.ask(40, key="alice", need=200)
    assert waiting.verdict is Verdict.WAITING
    budget.observe(trickle, 100, slow=True)
    out = budget.recheck()
    assert out.granted == [waiting] and budget.waiting == 0 and waiting.held == 40


def test_keyless_requests_share_one_small_quota() -> None:
    budget = Budget(8000)
    share = 8000 // KEYLESS_SHARE
    assert budget.keyless_share == share
    # One keyless body alone may take more than the share (an app sending no placeholder).
    alone, _ = budget.ask(2 * share, key="keyless", keyless=True)
    assert alone.verdict is Verdict.GRANTED and budget.keyless == 2 * share
    # A second keyless request waits while the keyless ones hold their share ...
    second, _ = budget.ask(10, key="keyless", keyless=True)
    assert second.verdict is Verdict.WAITING
    # ... while a keyed one of the same size is granted.
    keyed, _ = budget.ask(10, key="alice")
    assert keyed.verdict is Verdict.GRANTED
    out = budget.release(alone)
    assert out.granted == [second] and budget.keyless == 10


def test_keyless_promises_together_count_no_more_than_their_quota() -> None:
    budget = Budget(8000)  # a share of 1000
    hogs = [budget.ask(100, key="keyless", keyless=True, need=4000)[0] for _ in range(3)]
    assert all(h.verdict is Verdict.GRANTED for h in hogs)  # declared 3 x 3900, in 7700 free
    # Each could deliver all it declared (observed fast), yet together they count at most what
    # is left of the keyless quota against a keyed body.
    for hog in hogs:
        budget.observe(hog, 3900)
    assert budget._promised() == 1000 - 300  # noqa: SLF001
    large, _ = budget.ask(100, key="alice", need=6000)
    assert large.verdict is Verdict.GRANTED


def test_a_slow_bodys_growth_waits_behind_a_new_request() -> None:
    budget = Budget(100)
    slow, _ = budget.ask(20, key="mallory", need=80)
    budget.observe(slow, 10, slow=True)
    filler, _ = budget.ask(80, key="carol")
    assert slow.verdict is filler.verdict is Verdict.GRANTED and budget.free == 0
    ok, _ = budget.ask_more(slow, 10)
    assert not ok
    new, _ = budget.ask(10, key="alice")
    assert new.verdict is Verdict.WAITING
    # 10 bytes free up: the new request (its sender at full speed) goes before the trickle.
    out = budget.settle(filler, 70)
    assert out.granted == [new] and slow.more == 10
