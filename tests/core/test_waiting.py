"""The waiting rule as transcripts: a turn waits for its lane only while that pays.

The rule (:func:`proxy.core.waiting.wait_seconds`), the estimates it reads
(:class:`proxy.core.waiting.Estimates`) and the planner applying it with a turn's
:class:`~proxy.core.waiting.Waiting`: no sockets, no sleeps, the clock passed in.
"""

from __future__ import annotations

from typing import Any

from proxy.core.planner import Planner
from proxy.core.plans import Continue, Full, Http, HttpContinue, Wait
from proxy.core.waiting import DEFAULT_BUSY_SECONDS, Estimates, Send, Waiting, wait_seconds
from proxy.reasons import MissReason, PassthroughReason, WaitOutcome
from tests.core.test_planner import call, complete, opened, planner, prove, req, result, user


def test_the_rule_waits_only_while_the_expected_wait_is_shorter_than_the_saving() -> None:
    assert wait_seconds(0.5, 0.4, 1.0) == 0.0  # longer than it saves: go now
    assert wait_seconds(0.4, 0.4, 1.0) == 0.0
    assert wait_seconds(0.1, 0.4, 1.0) == 0.1 * 1.5  # a little past its estimate, at most
    assert wait_seconds(0.3, 0.4, 1.0) == 0.4  # never longer than the saving
    assert wait_seconds(0.3, 5.0, 0.2) == 0.0  # nor than the bound (pool.wait_seconds)
    assert wait_seconds(0.1, 5.0, 0.12) == 0.12


def test_estimates_start_conservative_then_follow_the_measurements() -> None:
    est = Estimates(max_identities=2)
    # Nothing measured: lanes look slow to free and save nothing, so no turn waits on a guess.
    assert est.busy("id") == DEFAULT_BUSY_SECONDS
    assert est.saving("id", Send.FULL, 1000) == 0.0
    est.observe_upstream("id", Send.FULL, 1000, 0.9)
    assert est.saving("id", Send.FULL, 1000) == 0.0  # one side only
    est.observe_upstream("id", Send.CONTINUE, 1000, 0.3)
    assert abs(est.saving("id", Send.FULL, 1000) - 0.6) < 1e-9
    # Requests of similar size share a bucket; another size falls back to any size's mean.
    est.observe_upstream("id", Send.FULL, 200_000, 2.9)
    assert abs(est.saving("id", Send.FULL, 200_000) - 2.6) < 1e-9
    assert abs(est.saving("id", Send.FULL, 1000) - 0.6) < 1e-9
    # A rolling mean: a new sample moves it by a fifth of the difference.
    est.observe_busy("id", 1.0)
    est.observe_busy("id", 2.0)
    assert abs(est.busy("id") - 1.2) < 1e-9
    assert abs(est.remaining("id", 0.2) - 1.0) < 1e-9
    assert abs(est.remaining("id", 5.0) - 0.12) < 1e-9  # past its estimate: running long
    # Bounded: the least recently measured identity goes.
    est.observe_busy("b", 0.1)
    est.observe_busy("c", 0.1)
    assert est.busy("id") == DEFAULT_BUSY_SECONDS and est.busy("c") == 0.1


def _store_false_head_behind_a_probe(p: Planner) -> tuple[list[dict[str, Any]], float]:
    """A ``store: false`` head on socket 1's default lane while socket 1 (lanes not yet proven:
    one response at a time) carries another conversation's probe: the head's own lane is free,
    its socket is not. Returns the head's next input and the time."""
    first = req([user("a")], store=False)
    plan = opened(p, p.plan("id", first, 0.0), lanes=False)
    complete(p, plan, first, "resp_a", 1.0, call(1))  # a lane busy for 1 s: measured
    probe = p.plan("id", req([user("b")], store=False), 1.0)
    assert probe.lane == (1, "u1")
    return [user("a"), call(1), result(1)], 1.0


def test_a_store_false_head_does_not_wait_on_a_guess() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1)
    items, now = _store_false_head_behind_a_probe(p)
    # Nothing says what a continuation saves yet: the turn goes now, in full, over HTTP (no
    # other lane), instead of waiting pool.wait_seconds for its socket.
    waiting = Waiting(now + 0.2)
    plan = p.plan("id", req(items, store=False), now + 0.2, waiting=waiting)
    assert (type(plan), plan.reason) == (Http, PassthroughReason.WAIT_NOT_WORTH_IT)
    assert (waiting.outcome, waiting.deadline) == (WaitOutcome.WAIT_NOT_WORTH_IT, None)
    # Without a turn's Waiting the plan only states the situation.
    assert type(p.plan("id", req(items, store=False), now + 0.2)) is Wait


def test_a_store_false_head_waits_as_long_as_its_lane_is_expected_to_free_when_that_pays() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1)
    items, now = _store_false_head_behind_a_probe(p)
    size = len(req(items, store=False).body)
    p.estimates.observe_upstream("id", Send.FULL, size, 0.9)
    p.estimates.observe_upstream("id", Send.CONTINUE, size, 0.2)  # a continuation saves 0.7 s
    # The probe began at 1.0; a lane is busy 1.0 s: it frees in 0.5 s, sooner than 0.7 s.
    waiting = Waiting(1.5)
    assert type(p.plan("id", req(items, store=False), 1.5, waiting=waiting)) is Wait
    assert waiting.deadline is not None and abs(waiting.deadline - (1.5 + 0.7)) < 1e-9  # min(0.75, 0.7)
    assert type(p.plan("id", req(items, store=False), 1.9, waiting=waiting)) is Wait
    # The probe ends (its lane frees): the turn is continued on its own lane.
    p.finished((1, "u1"), 1.95, req=req([user("b")], store=False), response={"id": "resp_b", "output": []})
    plan = p.plan("id", req(items, store=False), 1.95, waiting=waiting)
    assert (type(plan), plan.lane, plan.response_id) == (Continue, (1, None), "resp_a")
    assert waiting.outcome is WaitOutcome.LANE and abs(waiting.waited(1.95) - 0.45) < 1e-9


def test_a_store_false_head_whose_lane_stays_busy_past_the_wait_goes_now_in_full() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1)
    items, now = _store_false_head_behind_a_probe(p)
    size = len(req(items, store=False).body)
    p.estimates.observe_upstream("id", Send.FULL, size, 0.9)
    p.estimates.observe_upstream("id", Send.CONTINUE, size, 0.2)
    waiting = Waiting(1.5)
    assert type(p.plan("id", req(items, store=False), 1.5, waiting=waiting)) is Wait
    plan = p.plan("id", req(items, store=False), 2.2, waiting=waiting)  # the deadline, lane still busy
    assert (type(plan), plan.reason) == (Http, PassthroughReason.WAIT_NOT_WORTH_IT)
    assert waiting.outcome is WaitOutcome.WAIT_EXPIRED


def test_a_store_false_head_with_a_free_lane_elsewhere_goes_there_in_full() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=2)
    items, now = _store_false_head_behind_a_probe(p)
    spare = opened(p, p.plan("id", req([user("c")], store=False), 1.0), 1.0, lanes=False)  # socket 2
    assert spare.lane is not None and spare.lane[0] == 2
    p.finished(spare.lane, 1.1)  # socket 2 free again, no head
    waiting = Waiting(1.2)
    plan = p.plan("id", req(items, store=False), 1.2, waiting=waiting)
    assert (type(plan), plan.reason, plan.lane) == (Full, MissReason.WAIT_NOT_WORTH_IT, spare.lane)
    # Its answer is the conversation's head: the one left on the busy socket's lane goes.
    assert plan.lane is not None
    p.finished(plan.lane, 1.5, req=req(items, store=False), response={"id": "resp_a2", "output": []})
    assert p.heads.get((1, None)) is None and p.heads.get(spare.lane) is not None


def _stored_head_no_lane(p: Planner) -> list[dict[str, Any]]:
    """An upstream without lanes, one socket: a stored head detached (its lane given to another
    conversation, which is in flight)."""
    p.proof.refused(0.0)
    first = req([user("a")])
    plan = opened(p, p.plan("id", first, 0.0), lanes=False)
    complete(p, plan, first, "resp_a", 1.0, call(1))
    other = p.plan("id", req([user("b")]), 1.0)  # evicts (detaches) the stored head
    assert other.lane == plan.lane
    return [user("a"), call(1), result(1)]


def test_a_stored_head_without_a_lane_is_continued_over_http_at_once() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1)
    items = _stored_head_no_lane(p)
    waiting = Waiting(1.2)
    plan = p.plan("id", req(items), 1.2, waiting=waiting)
    assert (type(plan), plan.response_id) == (HttpContinue, "resp_a")
    assert waiting.outcome is WaitOutcome.WAIT_NOT_WORTH_IT


def test_a_stored_head_waits_for_a_lane_when_http_continuations_measure_slower() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1)
    items = _stored_head_no_lane(p)
    size = len(req(items).body)
    p.estimates.observe_upstream("id", Send.HTTP_CONTINUE, size, 1.5)  # hydrated over HTTP
    p.estimates.observe_upstream("id", Send.CONTINUE, size, 0.3)
    # The lane in flight began at 1.0 and lanes stay busy 1.0 s: 0.3 s to go, 1.2 s saved.
    waiting = Waiting(1.7)
    assert type(p.plan("id", req(items), 1.7, waiting=waiting)) is Wait
    assert waiting.deadline is not None and abs(waiting.deadline - (1.7 + 0.45)) < 1e-9
    p.finished((1, None), 1.9, req=req([user("b")]), response={"id": "resp_b", "output": []})
    plan = p.plan("id", req(items), 1.9, waiting=waiting)
    assert (type(plan), plan.response_id, plan.hydrated) == (Continue, "resp_a", True)
    assert waiting.outcome is WaitOutcome.LANE


def test_http_continuations_off_make_it_a_plain_http_send() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1, http_continuations=False)
    items = _stored_head_no_lane(p)
    plan = p.plan("id", req(items), 1.2, waiting=Waiting(1.2))
    assert (type(plan), plan.reason) == (Http, PassthroughReason.UPGRADE_REFUSED)


def test_a_new_conversation_with_no_lane_goes_over_http_at_once() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1)
    p.proof.refused(0.0)
    first = req([user("a")], store=False)
    opened(p, p.plan("id", first, 0.0), lanes=False)
    waiting = Waiting(0.5)
    plan = p.plan("id", req([user("b")], store=False), 0.5, waiting=waiting)
    # A full send over a socket saves nothing measured against one over HTTP: no wait.
    assert (type(plan), plan.reason) == (Http, PassthroughReason.WAIT_NOT_WORTH_IT)


def test_while_sockets_grow_a_new_conversation_waits_then_pool_full() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1, wait_seconds=1.0, connect_seconds=10.0)
    p.plan("id", req([user("a")]), 0.0)  # socket 1 in its handshake
    waiting = Waiting(0.0)
    plan = p.plan("id", req([user("b")], store=False), 0.0, waiting=waiting)
    assert (type(plan), plan.growing, waiting.deadline) == (Wait, True, 1.0)
    assert type(p.plan("id", req([user("b")], store=False), 5.0, waiting=waiting)) is Wait  # still growing
    assert waiting.deadline == 6.0
    late = p.plan("id", req([user("b")], store=False), 11.0, waiting=waiting)  # the connect bound
    assert (type(late), late.reason, waiting.outcome) == (
        Http,
        PassthroughReason.POOL_FULL,
        WaitOutcome.WAIT_EXPIRED,
    )


def test_a_new_heads_saving_is_its_next_turn_continued_in_memory() -> None:
    est = Estimates()
    est.observe_upstream("id", Send.FULL, 1000, 0.9)
    assert est.head_saving("id", 1000, store=True) is None  # no continuation measured yet
    est.observe_upstream("id", Send.CONTINUE, 1000, 0.3)
    # A stored answer over HTTP makes the next turn a hydration: until one is measured, a
    # rebuild costs what a full send does; a store: false one's next turn is a full send.
    assert abs((est.head_saving("id", 1000, store=True) or 0) - 0.6) < 1e-9
    est.observe_upstream("id", Send.HTTP_CONTINUE, 1000, 0.5)
    assert abs((est.head_saving("id", 1000, store=True) or 0) - 0.2) < 1e-9
    assert abs((est.head_saving("id", 1000, store=False) or 0) - 0.6) < 1e-9
    # What the send itself gains on a socket against HTTP counts too, once measured.
    est.observe_upstream("id", Send.HTTP_FULL, 1000, 1.0)
    assert abs((est.head_saving("id", 1000, store=False) or 0) - 0.7) < 1e-9
    assert est.grow("id") is None
    est.observe_grow("id", 0.5)
    est.observe_grow("id", 1.0)
    assert abs((est.grow("id") or 0) - 0.6) < 1e-9


def _growing(p: Planner) -> None:
    """Socket 1 of ``id`` in its handshake: the identity's lanes are a moment away."""
    p.plan("id", req([user("a")]), 0.0)


def _measured(p: Planner, *, full: float, cont: float, size: int) -> None:
    p.estimates.observe_upstream("id", Send.FULL, size, full)
    p.estimates.observe_upstream("id", Send.CONTINUE, size, cont)


def test_while_sockets_grow_a_new_head_goes_now_when_its_lane_saves_less_than_such_waits_take() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1, wait_seconds=1.0, connect_seconds=10.0)
    _growing(p)
    body = req([user("b")])
    _measured(p, full=0.35, cont=0.25, size=len(body.body))  # a continuation saves 0.1 s
    p.estimates.observe_grow("id", 0.4)  # new heads waited 0.4 s for lanes a moment away
    waiting = Waiting(2.0)
    plan = p.plan("id", body, 2.0, waiting=waiting)
    assert (type(plan), plan.reason) == (Http, PassthroughReason.WAIT_NOT_WORTH_IT)
    assert (waiting.outcome, waiting.deadline) == (WaitOutcome.WAIT_NOT_WORTH_IT, None)


def test_while_sockets_grow_a_new_head_waits_while_its_lane_pays_and_its_wait_is_a_sample() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1, wait_seconds=1.0, connect_seconds=10.0)
    _growing(p)
    body = req([user("b")])
    _measured(p, full=0.9, cont=0.3, size=len(body.body))  # a continuation saves 0.6 s
    p.estimates.observe_grow("id", 0.2)
    waiting = Waiting(2.0)
    plan = p.plan("id", body, 2.0, waiting=waiting)
    # Up to 1.5 times the recent waits (0.3 s), not the whole pool.wait_seconds.
    assert (type(plan), plan.growing, waiting.deadline) == (Wait, True, 2.0 + 0.2 * 1.5)
    p.opened(1, 2.1)
    prove(p, 1)
    plan = p.plan("id", body, 2.1, waiting=waiting)
    assert type(plan) is Full and waiting.outcome is WaitOutcome.LANE
    assert abs((p.estimates.grow("id") or 0) - (0.2 + 0.2 * (0.1 - 0.2))) < 1e-9  # it took 0.1 s


def test_while_sockets_grow_a_new_head_gives_up_at_its_measured_bound() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1, wait_seconds=1.0, connect_seconds=10.0)
    _growing(p)
    body = req([user("b")], store=False)
    _measured(p, full=0.5, cont=0.3, size=len(body.body))  # saves 0.2 s; no wait measured yet
    waiting = Waiting(2.0)
    assert type(p.plan("id", body, 2.0, waiting=waiting)) is Wait and waiting.deadline == 2.2
    late = p.plan("id", body, 2.2, waiting=waiting)
    assert (type(late), late.reason, waiting.outcome) == (Http, PassthroughReason.POOL_FULL, WaitOutcome.WAIT_EXPIRED)
    assert abs((p.estimates.grow("id") or 0) - 0.2) < 1e-9  # such a wait takes at least this long


def test_while_sockets_grow_a_new_head_whose_lane_saves_nothing_goes_now() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1, wait_seconds=1.0, connect_seconds=10.0)
    _growing(p)
    body = req([user("b")], store=False)
    _measured(p, full=0.2, cont=0.25, size=len(body.body))  # no rebuild cost measured
    waiting = Waiting(2.0)
    plan = p.plan("id", body, 2.0, waiting=waiting)
    assert (type(plan), plan.reason, waiting.deadline) == (Http, PassthroughReason.WAIT_NOT_WORTH_IT, None)
    assert p.estimates.grow("id") is None  # no wait, no sample


def test_a_lane_turn_that_ends_is_a_sample_of_its_busy_time_and_of_the_way_it_was_sent() -> None:
    p = planner()
    first = req([user("a")])
    plan = opened(p, p.plan("id", first, 0.0), 0.0)
    p.finished(
        plan.lane, 0.4, req=first, response={"id": "resp_a", "output": []}, measured=Send.FULL, upstream_seconds=0.3
    )
    assert p.estimates.busy("id") == 0.4  # from its begin (the plan) to its terminal event
    assert p.estimates.upstream_time("id", Send.FULL, len(first.body)) == 0.3
    assert p.estimates.upstream_time("id", Send.CONTINUE, len(first.body)) is None
    # A turn that ends without a response (failed) is no sample of either.
    second = req([user("b")])
    plan = opened(p, p.plan("other", second, 1.0), 1.0)
    p.finished(plan.lane, 3.0, measured=Send.FULL, upstream_seconds=2.0)
    assert p.estimates.busy("other") == DEFAULT_BUSY_SECONDS
    assert p.estimates.upstream_time("other", Send.FULL, len(second.body)) is None
