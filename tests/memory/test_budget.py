"""The memory budget's accounting core (proxy/core/budget.py): pure, no I/O."""

from __future__ import annotations

import pytest

from proxy.core.budget import AMPLIFICATION, BASELINE_SLACK, Budget, Verdict, derive

MIB = 1024 * 1024


def test_a_reservation_that_fits_is_granted_and_released() -> None:
    budget = Budget(100)
    ticket, out = budget.ask(60)
    assert ticket.verdict is Verdict.GRANTED and not ticket.waited and out.granted == [] == out.evict
    assert (budget.in_flight, budget.free, budget.idle) == (60, 40, False)
    budget.release(ticket)
    assert (budget.in_flight, budget.idle, ticket.verdict) == (0, True, Verdict.RELEASED)
    budget.release(ticket)  # twice is harmless (every exit path releases)
    assert budget.in_flight == 0


def test_waiters_are_granted_in_arrival_order_when_memory_frees() -> None:
    budget = Budget(100)
    first, _ = budget.ask(70)
    big, _ = budget.ask(60)
    small, _ = budget.ask(10)  # would fit now, but queues behind the first waiter (FIFO)
    assert (big.verdict, small.verdict, budget.waiting) == (Verdict.WAITING, Verdict.WAITING, 2)
    out = budget.release(first)
    assert out.granted == [big, small]
    assert (big.verdict, small.verdict, budget.in_flight, budget.waiting) == (Verdict.GRANTED, Verdict.GRANTED, 70, 0)


def test_a_request_that_cannot_fit_an_empty_budget_is_refused_at_once() -> None:
    budget = Budget(100)
    budget.set_heads(30)
    ticket, _ = budget.ask(71)  # in flight and kept bodies could all go; the heads stay
    assert ticket.verdict is Verdict.TOO_LARGE and budget.waiting == 0 and budget.in_flight == 0
    assert budget.ask(70)[0].verdict is Verdict.GRANTED


def test_kept_bodies_give_way_first_oldest_first() -> None:
    budget = Budget(100)
    assert budget.keep("a", 30) and budget.keep("b", 30) and budget.keep("c", 30)
    ticket, out = budget.ask(45)
    assert ticket.verdict is Verdict.GRANTED
    assert out.evict == ["a", "b"]  # only as many as needed, least recently kept first
    assert (budget.kept, budget.in_flight) == (30, 45)
    assert budget.unkeep("a").granted == []  # already gone from the accounting: a no-op
    assert budget.kept == 30


def test_a_body_is_kept_only_into_free_memory_and_never_while_a_request_waits() -> None:
    budget = Budget(100)
    first, _ = budget.ask(80)
    assert not budget.keep("a", 30)  # does not fit: not kept (the digest serves)
    waiting, _ = budget.ask(30)
    assert waiting.verdict is Verdict.WAITING
    assert not budget.keep("b", 5)  # fits, but a request waits
    budget.release(first)
    assert waiting.verdict is Verdict.GRANTED and budget.keep("b", 5)


def test_settle_shrinks_a_grant_and_wakes_waiters() -> None:
    budget = Budget(100)
    first, _ = budget.ask(80)
    second, _ = budget.ask(50)
    assert second.verdict is Verdict.WAITING
    out = budget.settle(first, 20)  # the frame was sent: only the body is held now
    assert out.granted == [second] and budget.in_flight == 70
    budget.settle(first, 500)  # never raises a grant
    assert first.want == 20


def test_a_waiter_that_gives_up_leaves_the_queue_and_unblocks_the_next() -> None:
    budget = Budget(100)
    first, _ = budget.ask(90)
    head, _ = budget.ask(95)
    behind, _ = budget.ask(10)
    out = budget.release(head)  # timed out or the app went away
    assert head.verdict is Verdict.CANCELLED and out.granted == [behind]
    assert budget.in_flight == 100 and budget.waiting == 0
    budget.release(first)
    budget.release(behind)
    assert budget.idle and budget.in_flight == 0


def test_a_waiting_connection_counts_what_its_buffers_already_hold() -> None:
    budget = Budget(100)
    first, _ = budget.ask(90)
    waiting, _ = budget.ask(40, buffered=8)
    assert waiting.held == 8 and budget.in_flight == 98  # over nothing: it is in memory anyway
    out = budget.release(first)
    assert out.granted == [waiting] and budget.in_flight == 40
    budget.release(waiting)
    assert budget.in_flight == 0


def test_a_chunked_body_grows_its_grant_while_it_fits() -> None:
    budget = Budget(100)
    ticket, _ = budget.ask(10)
    assert budget.keep("a", 50)
    ok, out = budget.grow(ticket, 60)
    assert ok and out.evict == ["a"] and ticket.want == 70
    ok, _ = budget.grow(ticket, 40)
    assert not ok and ticket.want == 70
    extra, _ = budget.ask(20)
    budget.merge(ticket, extra)
    assert (ticket.want, budget.tickets, budget.in_flight) == (90, 1, 90)
    budget.release(ticket)
    assert budget.idle and budget.in_flight == 0
    with pytest.raises(ValueError):
        budget.grow(ticket, 1)


def test_heads_shrinking_wakes_waiters_and_growing_refuses_the_queue_head() -> None:
    budget = Budget(100)
    budget.set_heads(50)
    first, _ = budget.ask(40)
    waiting, _ = budget.ask(30)
    assert waiting.verdict is Verdict.WAITING
    assert budget.set_heads(20).granted == [waiting]
    late, _ = budget.ask(60)
    budget.set_heads(60)
    out = budget.release(first)  # the head of the queue can never fit now: woken to be refused
    assert late in out.granted and late.verdict is Verdict.TOO_LARGE and budget.waiting == 0


def test_the_derived_limits_fit_the_budget() -> None:
    d = derive(256 * MIB, 45 * MIB)
    assert d.capacity == 256 * MIB - 45 * MIB - int(256 * MIB * BASELINE_SLACK)
    assert d.max_body_bytes * AMPLIFICATION <= d.capacity
    assert d.hot_prefix_bytes == d.capacity // 2
    assert derive(4096 * MIB, 45 * MIB).max_body_bytes == 64 * MIB  # never above the old default
