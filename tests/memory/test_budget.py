"""The memory budget's accounting core (proxy/core/budget.py): pure, no I/O."""

from __future__ import annotations

import orjson
import pytest

from proxy.core.budget import AMPLIFICATION, HEADER_ROOM, MIN_RESERVATION, Budget, Verdict, derive
from proxy.core.conversation import HeadTable
from proxy.core.sizing import BASELINE_SLACK

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


def test_a_waiter_that_does_not_fit_never_holds_up_a_smaller_one_behind_it() -> None:
    # Not strict FIFO: a 60-byte waiter that does not fit never holds a 10-byte one behind it.
    budget = Budget(100)
    first, _ = budget.ask(70)
    big, _ = budget.ask(60)
    small, _ = budget.ask(10)  # fits now: granted at once, past the waiting large one
    assert (big.verdict, small.verdict, budget.waiting) == (Verdict.WAITING, Verdict.GRANTED, 1)
    out = budget.release(first)
    assert out.granted == [big]
    assert (big.verdict, budget.in_flight, budget.waiting) == (Verdict.GRANTED, 70, 0)


def test_waiters_are_admitted_round_robin_over_identities() -> None:
    budget = Budget(100)
    first, _ = budget.ask(100)
    alice = [budget.ask(10, key="alice")[0] for _ in range(5)]
    bob = [budget.ask(10, key="bob")[0] for _ in range(2)]
    budget.settle(first, 60)  # room for four
    granted = [t for t in alice + bob if t.verdict is Verdict.GRANTED]
    # Alice queued five first, yet Bob's two are among the four granted.
    assert len(granted) == 4 and bob[0] in granted and bob[1] in granted, granted
    assert [t.verdict for t in alice[:2]] == [Verdict.GRANTED] * 2


def test_a_body_pays_as_it_arrives_and_a_promise_reserves_nothing() -> None:
    budget = Budget(1000)
    # A head that declares a body needing 990 bytes holds its first step (40) only.
    stalled, _ = budget.ask(40, key="mallory", need=990)
    assert stalled.verdict is Verdict.GRANTED and budget.in_flight == 40
    # Small requests of another identity still fit (the promise is not a reservation).
    small = [budget.ask(50, key="alice")[0] for _ in range(10)]
    assert all(t.verdict is Verdict.GRANTED for t in small) and budget.in_flight == 540
    for t in small:
        budget.release(t)
    # The body grows step by step as it arrives, then is read in full.
    assert budget.grow(stalled, 100)[0] and stalled.held == 140
    budget.done_reading(stalled)
    assert stalled.need == 140  # it never grows again


def test_bodies_being_read_are_admitted_only_while_all_can_complete_at_once() -> None:
    # Twelve bodies of 40 needing 90 each in a budget of 200: if all started at once (480),
    # none could finish (deadlock). Only as many start as could all grow to their needs at once.
    budget = Budget(200)
    tickets = [budget.ask(40, key=f"k{i}", need=90)[0] for i in range(12)]
    started = [t for t in tickets if t.verdict is Verdict.GRANTED]
    assert len(started) == 2, budget  # 2 x 90 = 180 <= 200; a third would promise 270
    # The started ones grow to completion without any release ...
    for t in started:
        assert budget.grow(t, 50)[0]
        budget.done_reading(t)
    # ... while a small request (one step, nothing to grow) is never held up by the promises.
    small, _ = budget.ask(15, key="small")
    assert small.verdict is Verdict.GRANTED
    budget.release(small)
    # Each that completes and is answered lets the next start: every body gets through.
    finished = 0
    while finished < 12:
        reading = [t for t in tickets if t.verdict is Verdict.GRANTED]
        assert reading, budget
        for t in reading:
            if t.held < t.need:
                ok, _ = budget.grow(t, t.need - t.held)
                if not ok:
                    continue
            budget.done_reading(t)
            budget.release(t)
            finished += 1
    assert budget.idle and budget.in_flight == 0


def test_a_body_read_still_promises_its_frame_copy_until_it_is_taken() -> None:
    # Bodies whose frame goes upstream whole take half a frame more once read: admitted
    # without it, two bodies read in full plus the heads waiting with their buffered starts
    # left no room for either frame step, and nothing else could free memory (the cgroup test
    # then waited the full memory_wait_seconds and 429'd).
    budget = Budget(200)
    a, _ = budget.ask(40, key="t", need=90 + 20)  # 90 of body, 20 of frame copy
    b, _ = budget.ask(40, key="t", need=90 + 20)
    assert (a.verdict, b.verdict) == (Verdict.GRANTED, Verdict.WAITING)  # 2 x 110 > 200
    assert budget.grow(a, 50)[0]
    budget.done_reading(a, 20)
    assert a.need == a.held + 20 and budget.reading == [a]  # the frame step is still promised
    assert b.verdict is Verdict.WAITING  # b's 110 + a's 20 still promised > the 110 free
    assert budget.grow(a, 20)[0]  # the frame step
    budget.settle(a, 40)  # sent: the body only
    assert b.verdict is Verdict.GRANTED and budget.reading == [b]


def test_a_queued_growth_is_granted_when_memory_frees_and_can_be_given_up() -> None:
    budget = Budget(100)
    other, _ = budget.ask(60)
    reading, _ = budget.ask(20, need=40)
    ok, _ = budget.ask_more(reading, 30)
    assert not ok and reading.more == 30 and budget.waiting == 1
    out = budget.release(other)
    assert out.granted == [reading] and reading.held == 50 and reading.more == 0
    ok, _ = budget.ask_more(reading, 60)
    assert not ok
    budget.cancel_more(reading)
    assert budget.waiting == 0 and reading.held == 50


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


def test_a_body_the_cache_lets_go_is_counted_out_and_tells_the_gate_through_pending() -> None:
    """The prefix cache calls the budget (its keeper), not the gate: a cooled body leaves the
    accounting at once, and whoever it lets in waits in ``pending`` for the gate's next call."""
    budget = Budget(100)
    held, _ = budget.ask(40)
    assert budget.keep("a", 50)
    waiting, out = budget.ask(65)  # more than free + kept (10 + 50): waits, evicts nothing
    assert waiting.verdict is Verdict.WAITING and out.evict == []
    budget.cooled("a")  # kept bytes were free to a waiter already (by eviction): nobody new fits
    assert budget.kept == 0 and waiting.verdict is Verdict.WAITING and budget.take_pending() == []
    assert budget.release(held).granted == [waiting]
    budget.pending.append(waiting)  # as cooled leaves it: handed over once
    assert budget.take_pending() == [waiting] and budget.take_pending() == []


def test_settle_shrinks_a_grant_and_wakes_waiters() -> None:
    budget = Budget(100)
    first, _ = budget.ask(80)
    second, _ = budget.ask(50)
    assert second.verdict is Verdict.WAITING
    out = budget.settle(first, 20)  # the frame was sent: only the body is held now
    assert out.granted == [second] and budget.in_flight == 70
    budget.settle(first, 500)  # never raises a grant
    assert first.want == 20


def test_a_waiter_that_gives_up_leaves_the_queue() -> None:
    budget = Budget(100)
    first, _ = budget.ask(90)
    head, _ = budget.ask(95)
    behind, _ = budget.ask(10)  # fits: granted at once (no head-of-line blocking)
    assert behind.verdict is Verdict.GRANTED
    out = budget.release(head)  # timed out or the app went away
    assert head.verdict is Verdict.CANCELLED and out.granted == []
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
    assert (ticket.want, budget.tickets, budget.in_flight) == (70, 1, 70)
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
    assert d.max_body_bytes * AMPLIFICATION + MIN_RESERVATION + HEADER_ROOM <= d.capacity
    assert d.hot_prefix_bytes == d.capacity // 2
    assert derive(4096 * MIB, 45 * MIB).max_body_bytes == 64 * MIB  # never above the old default


def _turn(heads: HeadTable, anchor: tuple[str, int], inputs: list[dict[str, object]], n: int) -> bytes:
    """Record turn ``n`` of one conversation on ``anchor``; returns its body."""
    body = orjson.dumps({"model": "gpt-6.1-sol", "input": inputs})
    req = heads.parse("ident", body)
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"answer {n}"}]}]
    assert heads.record("ident", anchor, req, {"id": f"resp_{n}", "output": output}, float(n)) is not None
    inputs.extend(output)
    inputs.append({"role": "user", "content": f"question {n + 1} " + "y" * 1000})
    return body


def test_a_head_replaced_on_its_lane_hands_its_kept_body_over() -> None:
    """A continuation's head replaces its lane's previous head: the old kept body leaves the
    accounting and the new one is kept in its place (one keeper call), or, while a request
    waits, not kept at all (the digest serves the next turn's prefix: still a fast parse)."""
    heads = HeadTable(max_heads=10, ttl_seconds=1e9)
    budget = Budget(10 * MIB)
    heads.prefixes.keeper = budget
    anchor = ("socket", 1)
    inputs: list[dict[str, object]] = [{"role": "user", "content": "question 0 " + "x" * 5000}]
    first = _turn(heads, anchor, inputs, 0)
    assert budget.kept == len(first) and heads.prefixes.body(anchor) == first
    second = _turn(heads, anchor, inputs, 1)
    assert heads.parse("ident", orjson.dumps({"model": "gpt-6.1-sol", "input": inputs})).base is not None
    assert len(heads) == 1 and budget.kept == len(second) and heads.prefixes.body(anchor) == second
    held, _ = budget.ask(budget.free)
    waiting, _ = budget.ask(budget.kept + 1)  # more than free + kept: waits
    assert waiting.verdict is Verdict.WAITING
    _turn(heads, anchor, inputs, 2)
    assert budget.kept == 0 and heads.prefixes.body(anchor) is None and budget.take_pending() == []
    assert heads.parse("ident", orjson.dumps({"model": "gpt-6.1-sol", "input": inputs})).base is not None
    budget.release(held)
    assert waiting.verdict is Verdict.GRANTED
