"""The planner as transcripts: no sockets, no sleeps, the clock passed in.

Each test drives :class:`Planner` through plan → opened → finished (and the fault paths) and
checks the commands it returns; ``test_every_transition_is_exercised`` fails if a row of the
lane or socket table is never taken by the tests of this module.
"""

from __future__ import annotations

import enum
from typing import Any

import orjson
import pytest

import proxy.core.lanes as lanes
from proxy.core.conversation import HeadTable
from proxy.core.demux import LaneSignal, LaneSupport
from proxy.core.lanes import (
    EARLY_CLOSES_TO_REFUSE,
    LANE_TRANSITIONS,
    LANES_RETRY_SECONDS,
    SOCKET_TRANSITIONS,
    InvalidTransition,
    LaneEvent,
    LaneLimits,
    LaneState,
    SocketEvent,
    SocketState,
    lane_step,
    socket_step,
)
from proxy.core.planner import Planner
from proxy.core.plans import Continue, Full, Http, HttpContinue, OnLane, Plan, Wait
from proxy.core.request import ParsedRequest, parse_request
from proxy.core.socketcaps import hold_off_seconds
from proxy.core.waiting import Send, Waiting, WaitRule
from proxy.reasons import MissReason, PassthroughReason, WaitOutcome

SEEN: set[tuple[str, str, str]] = set()
"""Every (table, state, event) step the planners of this module took (``SocketBook.on_step``)."""


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def call(n: int) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "f", "arguments": "{}"}


def result(n: int) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": f"call_{n}", "output": "ok"}


def req(items: list[dict[str, Any]], **fields: Any) -> ParsedRequest:
    return parse_request(orjson.dumps({"model": "m", "input": items, **fields}))


def response(rid: str, *output: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "output": list(output)}


def note_step(table: str, state: enum.StrEnum, event: enum.StrEnum) -> None:
    SEEN.add((table, state, event))


def planner(**limits: Any) -> Planner:
    p = Planner(LaneLimits(**limits), HeadTable(max_heads=100, ttl_seconds=3600))
    p.book.on_step = note_step
    return p


def opens(plan: Plan) -> list[int]:
    """The sockets ``plan`` has the pool open: its lane's new socket, a spare."""
    if not isinstance(plan, (Continue, Full)):
        return []
    return ([plan.lane[0]] if plan.open_socket else []) + ([plan.warm] if plan.warm is not None else [])


def opened(p: Planner, plan: Plan, now: float = 0.0, *, lanes: bool = True) -> OnLane:
    """The plan's socket opened; with ``lanes`` its upstream proved ``stream_id`` lanes (the
    transcripts below are about a multiplexing upstream unless they say otherwise)."""
    assert isinstance(plan, (Continue, Full)), plan
    if plan.open_socket:
        p.opened(plan.lane[0], now)
    if lanes:
        prove(p, plan.lane[0])
    return plan


def prove(p: Planner, socket_id: int) -> None:
    sock = p.socket(socket_id)
    if sock is not None:
        sock.demux.support = LaneSupport.PROVEN


def complete(p: Planner, plan: Plan, r: ParsedRequest, rid: str, now: float, *output: dict[str, Any]) -> list[int]:
    assert isinstance(plan, (Continue, Full)), plan
    return p.finished(plan.lane, now, req=r, response=response(rid, *output))


def test_first_turn_opens_a_socket_and_the_next_continues_on_its_lane() -> None:
    p = planner()
    r1 = req([user("go")])
    first = opened(p, p.plan("id", r1, 0.0))
    assert (type(first), first.reason, first.lane, first.open_socket) == (
        Full,
        MissReason.NO_HEAD,
        (1, None),
        True,
    )
    assert complete(p, first, r1, "resp_1", 1.0, call(1)) == []
    r2 = req([user("go"), call(1), result(1)])
    second = p.plan("id", r2, 2.0)
    assert (type(second), second.lane, second.response_id, second.new_items) == (
        Continue,
        (1, None),
        "resp_1",
        [result(1)],
    )
    assert not second.open_socket and not second.hydrated


def test_every_head_the_planner_records_or_adopts_is_its_identitys_and_the_registry_is_bounded() -> None:
    p = Planner(LaneLimits(), HeadTable(max_heads=1, ttl_seconds=3600))
    assert p.owners.capacity == 4096  # sixteen ids a head, at least 4096
    r = req([user("go")])
    complete(p, opened(p, p.plan("alice", r, 0.0)), r, "resp_1", 1.0, call(1))
    p.custody.adopt("alice", req([user("stored")], store=True), response("resp_http", call(2)), 2.0)
    assert p.owners.owner_of("resp_1") == "alice" and p.owners.owner_of("resp_http") == "alice"
    assert p.owners.owner_of("resp_unknown") is None
    for n in range(p.owners.capacity):
        p.owners.note("bob", f"r{n}")
    # The heaviest identity's oldest id went first: bob's flood never evicts alice's ids.
    assert p.owners.owner_of("resp_1") == "alice" and p.owners.owner_of("resp_http") == "alice"
    assert p.owners.owner_of("r0") is None and p.owners.owner_of(f"r{p.owners.capacity - 1}") == "bob"
    assert Planner(LaneLimits(), HeadTable(max_heads=1000, ttl_seconds=1)).owners.capacity == 16000


def test_conversations_spread_over_sockets_then_share_them_through_lanes() -> None:
    p = planner(spread_sockets=2, max_sockets_per_identity=2)
    first = opened(p, p.plan("id", req([user("c0")]), 0.0))  # nothing open: it waits for a handshake
    second = p.plan("id", req([user("c1")]), 0.0)
    # A free lane at once, and a socket of its own opening in the background for the next one.
    assert (first.lane, second.lane, second.open_socket, second.warm) == ((1, None), (1, "u1"), False, 2)
    p.opened(2, 0.1)
    prove(p, 2)
    plans = [p.plan("id", req([user(f"c{i}")]), 0.2) for i in range(2, 5)]
    assert [pl.lane for pl in plans] == [(2, None), (2, "u1"), (2, "u2")]
    assert all(pl.warm is None for pl in plans)  # the spread is reached: lanes from now on
    assert p.book.lane_counts[LaneState.BUSY] == 5 and p.book.busy_sockets == 2


def test_an_idle_socket_is_reused_before_a_new_one_is_opened() -> None:
    p = planner()
    r = req([user("a")])
    first = opened(p, p.plan("id", r, 0.0))
    complete(p, first, r, "resp_a", 1.0)
    second = p.plan("id", req([user("b")]), 2.0)
    assert second.lane == (1, "u1") and not second.open_socket  # a free lane; the head stays


def test_the_active_limit_per_socket_opens_another() -> None:
    p = planner(max_active_per_socket=2, spread_sockets=1)
    plans = [opened(p, p.plan("id", req([user(f"c{i}")]), 0.0)) for i in range(3)]
    # Socket 2 opens after socket 1 proved lanes: its first response is the probe of its own.
    assert [pl.lane for pl in plans] == [(1, None), (1, "u1"), (2, "u1")]


def test_an_unproven_socket_carries_one_response_and_probes_its_lanes_when_idle() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1)
    r = req([user("a")])
    first = opened(p, p.plan("id", r, 0.0), lanes=False)
    assert first.lane == (1, None)
    assert type(p.plan("id", req([user("b")]), 0.0)) is Wait  # never a second response
    complete(p, first, r, "resp_a", 1.0, call(1))
    probe = p.plan("id", req([user("b")]), 1.0)
    assert probe.lane == (1, "u1")  # idle: its first named lane goes alone
    # The head's next turn waits for its own lane (store: true would hydrate elsewhere or
    # continue over HTTP when nothing else is free).
    cont = p.plan("id", req([user("a"), call(1), result(1)]), 1.0)
    assert (type(cont), cont.reason) == (Wait, "continuation")  # for its own lane
    unstored = req([user("z")], store=False)
    assert type(p.plan("id", unstored, 1.0)) is Wait


def test_a_head_on_a_probing_socket_waits_a_moment_for_the_proof_then_continues_over_http() -> None:
    # The proof of lanes is the probing lane's first event, a moment away, not the end of the
    # response in flight: the head's next turn waits pool.http_continuation_after_seconds for
    # it, also when nothing is measured yet or its measured saving is nothing (a
    # zero-latency upstream), then continues over HTTP.
    def probing() -> tuple[Planner, ParsedRequest]:
        p = planner(spread_sockets=1, max_sockets_per_identity=1)
        r = req([user("a")])
        first = opened(p, p.plan("id", r, 0.0), lanes=False)
        complete(p, first, r, "resp_a", 1.0, call(1))
        assert p.plan("id", req([user("b")]), 1.0).lane == (1, "u1")  # the probe
        sock = p.socket(1)
        assert sock is not None
        sock.demux.sent("u1")  # its frame is on the wire
        assert sock.demux.probing
        return p, req([user("a"), call(1), result(1)])

    for measured in (False, True):
        p, cont = probing()
        if measured:
            for send in (Send.CONTINUE, Send.HTTP_CONTINUE):
                p.patience.estimates.observe_upstream("id", send, len(cont.body), 0.05)
        waiting = Waiting(1.0)
        plan = p.plan("id", cont, 1.0, waiting=waiting)
        assert (type(plan), plan.reason, waiting.rule, waiting.deadline) == (Wait, "continuation", WaitRule.BRIEF, 1.01)
        assert type(p.plan("id", cont, 1.005, waiting=waiting)) is Wait
        late = p.plan("id", cont, 1.011, waiting=waiting)
        assert (type(late), late.response_id, waiting.outcome) == (HttpContinue, "resp_a", WaitOutcome.WAIT_EXPIRED)

    # The proof arrives within the moment: the turn continues on its own lane.
    p, cont = probing()
    waiting = Waiting(1.0)
    assert type(p.plan("id", cont, 1.0, waiting=waiting)) is Wait
    prove(p, 1)
    proven = p.plan("id", cont, 1.004, waiting=waiting)
    assert (type(proven), proven.lane, proven.response_id) == (Continue, (1, None), "resp_a")


def test_a_429_teaches_the_cap_with_backoff_and_one_probe_above_it() -> None:
    p = planner(spread_sockets=8, max_sockets_per_identity=8, cap_probe_seconds=100.0)
    plans = []
    for i in range(8):  # slow start: at most 4 handshakes before any socket is open
        plan = p.plan("id", req([user(f"c{i}")]), 0.0)
        plans.append(plan)
    opening = [sid for pl in plans for sid in opens(pl)]
    assert 1 <= len(opening) <= 4
    for sid in opening:
        if sid <= 2:
            p.opened(sid, 0.1)
        else:
            assert p.open_failed(sid, 0.1, status=429, headers={"retry-after": "2"}, jitter=0.0)
    assert p.learned_cap("id") == 2
    assert p.held_off("id", 1.0) and not p.held_off("id", 2.2)  # retry-after, then free again
    more = p.plan("id", req([user("more")]), 3.0)
    assert not opens(more)  # at the cap: no upgrade before the probe time
    late = p.plan("id", req([user("late")]), 100.2)
    assert opens(late)  # one probe above the cap, after cap_probe_seconds
    again = p.plan("id", req([user("again")]), 100.2)
    assert not opens(again)  # ... and only one at a time


def test_a_head_continues_on_its_lane_when_its_socket_is_at_the_active_limit() -> None:
    # The upstream queues a response beyond the socket's limit: cheaper than a full send elsewhere.
    p = planner(max_active_per_socket=2, spread_sockets=1)
    r = req([user("a")])
    first = opened(p, p.plan("id", r, 0.0))
    complete(p, first, r, "resp_a", 1.0, call(1))
    busy = [p.plan("id", req([user(f"other{i}")]), 1.0) for i in range(2)]
    assert all(b.lane is not None and b.lane[0] == first.lane[0] for b in busy)  # socket 1 at its limit
    cont = p.plan("id", req([user("a"), call(1), result(1)]), 2.0)
    assert (type(cont), cont.lane, cont.response_id) == (Continue, first.lane, "resp_a")
    new = p.plan("id", req([user("new")]), 2.0)
    assert new.lane is not None and new.lane[0] != first.lane[0]  # a new head is placed elsewhere


def test_at_every_limit_the_plan_is_to_wait_then_http() -> None:
    p = planner(max_active_per_socket=1, max_sockets_per_identity=1, max_sockets_total=1)
    opened(p, p.plan("id", req([user("a")]), 0.0))
    assert type(p.plan("id", req([user("b")]), 0.0)) is Wait


def test_a_refused_upgrade_holds_off_new_sockets_only() -> None:
    p = planner(spread_sockets=1)
    r = req([user("a")])
    first = opened(p, p.plan("id", r, 0.0))
    complete(p, first, r, "resp_a", 1.0, call(1))
    # The first socket exists; a second identity's socket is refused with retry-after.
    other = p.plan("other", req([user("x")]), 1.0)
    assert other.open_socket and other.lane is not None
    p.open_failed(other.lane[0], 1.0, status=429, headers={"retry-after": "5"})
    assert p.held_off("other", 2.0) and not p.held_off("id", 2.0)
    again = p.plan("other", req([user("x")]), 2.0)
    assert (type(again), again.reason) == (Http, PassthroughReason.UPGRADE_REFUSED)
    # The held-off identity's existing lanes still continue; a refusal never costs a continuation.
    cont = p.plan("id", req([user("a"), call(1), result(1)]), 2.0)
    assert type(cont) is Continue
    assert not p.held_off("other", 7.0)


def test_a_failed_connect_without_status_holds_nothing_and_may_open_false_goes_http() -> None:
    p = planner()
    plan = p.plan("id", req([user("a")]), 0.0)
    assert plan.lane is not None
    p.open_failed(plan.lane[0], 0.0, status=None, headers={})
    assert not p.held_off("id", 0.0)
    later = p.plan("id", req([user("a")]), 0.0, may_open=False)
    assert (type(later), later.reason) == (Http, PassthroughReason.WS_UNAVAILABLE)


def test_hold_off_durations() -> None:
    assert hold_off_seconds(426, {}) == 300
    assert hold_off_seconds(429, {"retry-after": "7"}) == 7
    assert hold_off_seconds(429, {"retry-after": "9999"}) == 300
    assert hold_off_seconds(401, {}) == hold_off_seconds(403, {}) == 30
    assert hold_off_seconds(500, {}) == hold_off_seconds(None, {}) == 0


def test_a_busy_head_is_head_busy_and_a_fork_goes_elsewhere() -> None:
    p = planner()
    r = req([user("a")])
    first = opened(p, p.plan("id", r, 0.0))
    complete(p, first, r, "resp_a", 1.0, call(1))
    nxt = req([user("a"), call(1), result(1)])
    cont = p.plan("id", nxt, 2.0)
    assert type(cont) is Continue
    parallel = p.plan("id", nxt, 2.0)
    assert (type(parallel), parallel.reason) == (Full, MissReason.HEAD_BUSY)
    assert parallel.lane != cont.lane


def test_abandon_drains_and_frees_the_lane_without_a_head() -> None:
    p = planner()
    r = req([user("a")])
    first = opened(p, p.plan("id", r, 0.0))
    assert first.lane is not None
    p.custody.abandon(first.lane)
    assert p.book.lane(first.lane).state is LaneState.DRAINING  # type: ignore[union-attr]
    assert p.finished(first.lane, 1.0) == []
    assert p.book.lane(first.lane).state is LaneState.IDLE  # type: ignore[union-attr]
    assert len(p.heads) == 0
    again = p.plan("id", req([user("b")]), 2.0)
    assert again.lane is not None
    p.custody.abandon(again.lane)
    p.custody.lost(again.lane[0])  # a draining lane goes with its socket
    assert p.book.lane(again.lane) is None


def test_a_failed_response_frees_the_lane_and_forgets_its_head() -> None:
    p = planner()
    r = req([user("a")])
    first = opened(p, p.plan("id", r, 0.0))
    complete(p, first, r, "resp_a", 1.0, call(1))
    cont = p.plan("id", req([user("a"), call(1), result(1)]), 2.0)
    assert cont.lane is not None
    p.finished(cont.lane, 3.0)  # response.failed: no head; the upstream evicted the parent
    assert len(p.heads) == 0


def test_socket_loss_keeps_stored_heads_for_hydration_and_forgets_the_others() -> None:
    p = planner(spread_sockets=1)
    stored, unstored = req([user("s")]), req([user("u")], store=False)
    a = opened(p, p.plan("id", stored, 0.0))
    b = p.plan("id", unstored, 0.0)
    assert a.lane is not None and b.lane is not None and a.lane[0] == b.lane[0]
    complete(p, a, stored, "resp_s", 1.0, call(1))
    complete(p, b, unstored, "resp_u", 1.0, call(2))
    p.custody.lost(a.lane[0])
    assert p.socket(a.lane[0]) is None
    hydrated = p.plan("id", req([user("s"), call(1), result(1)]), 2.0)
    assert (type(hydrated), hydrated.hydrated, hydrated.response_id) == (Continue, True, "resp_s")
    assert hydrated.open_socket and hydrated.lane is not None and hydrated.lane[0] != a.lane[0]
    opened(p, hydrated, 2.0)
    cold = p.plan("id", req([user("u"), call(2), result(2)], store=False), 2.0)
    assert (type(cold), cold.reason) == (Full, MissReason.NO_HEAD)
    opened(p, hydrated, 2.0)
    complete(p, hydrated, req([user("s"), call(1), result(1)]), "resp_s2", 3.0, call(3))
    assert p.heads.anchor_for("id", "resp_s") is None  # the hydrated parent is replaced


def test_eviction_detaches_a_stored_head_and_forgets_an_unstored_one() -> None:
    p = planner(lanes_per_socket=1, max_sockets_per_identity=1)
    r = req([user("s")])
    a = opened(p, p.plan("id", r, 0.0))
    complete(p, a, r, "resp_s", 1.0, call(1))
    other = p.plan("id", req([user("t")]), 2.0)  # the only lane is taken over
    assert other.lane == a.lane
    back = p.plan("id", req([user("s"), call(1), result(1)]), 2.0)
    assert type(back) is Wait  # stored: still continuable, once a lane frees
    assert other.lane is not None
    p.finished(other.lane, 3.0)
    again = p.plan("id", req([user("s"), call(1), result(1)]), 3.0)
    assert (type(again), again.hydrated) == (Continue, True)


def test_while_a_socket_opens_or_probes_a_new_conversation_waits_and_evicts_no_head() -> None:
    # A burst of new conversations of one key: socket 1's lanes are a busy one and an idle one
    # holding an unstored head; socket 2 is still in its handshake, then probing its lanes.
    # Lanes are a moment away: a new conversation waits (growing: pool.wait_seconds has not
    # begun) instead of taking over the head, which store: false could never get back.
    p = planner(lanes_per_socket=2, max_sockets_per_identity=2, spread_sockets=1)
    r = req([user("s")], store=False)
    a = opened(p, p.plan("id", r, 0.0))
    complete(p, a, r, "resp_s", 1.0, call(1))
    busy = p.plan("id", req([user("b")], store=False), 1.0)
    assert busy.lane == (1, "u1")
    probe = p.plan("id", req([user("c")], store=False), 1.0)
    assert probe.open_socket and probe.lane == (2, "u1")
    d = req([user("d")], store=False)
    waiting = p.plan("id", d, 1.0)
    assert (type(waiting), waiting.growing) == (Wait, True)
    p.opened(2, 1.1)
    sock = p.socket(2)
    assert sock is not None
    sock.demux.sent("u1")  # the probe went out; its first event is on its way
    assert p.plan("id", d, 1.1).growing
    prove(p, 2)
    assert p.plan("id", d, 1.2).lane == (2, None)  # proven: the socket takes a second response
    cont = p.plan("id", req([user("s"), call(1), result(1)], store=False), 1.2)
    assert (type(cont), cont.lane, cont.response_id) == (Continue, a.lane, "resp_s")
    # Nothing growing and every lane busy: a plain wait for busy lanes (pool_full after it).
    full = p.plan("id", req([user("e")], store=False), 1.3)
    assert (type(full), full.growing) == (Wait, False)


def test_rotation_retires_busy_sockets_and_closes_idle_ones() -> None:
    p = planner(rotate_after_seconds=10, idle_close_seconds=100)
    r = req([user("a")])
    busy = opened(p, p.plan("id", r, 0.0))
    idle = p.plan("other", req([user("b")]), 0.0)
    opened(p, idle)
    assert idle.lane is not None and busy.lane is not None
    p.finished(idle.lane, 1.0)
    tick = p.tick(11.0)
    assert tick.close == [idle.lane[0]] and tick.ages == [11.0] and tick.reseed == []
    assert p.socket(busy.lane[0]).state is SocketState.RETIRING  # type: ignore[union-attr]
    assert p.plan("id", req([user("c")]), 11.0).lane != busy.lane  # no new turns on it
    assert complete(p, busy, r, "resp_a", 12.0) == [busy.lane[0]]  # drained: closed


def test_idle_close() -> None:
    p = planner(idle_close_seconds=5)
    plan = opened(p, p.plan("id", req([user("a")]), 0.0))
    assert plan.lane is not None
    p.finished(plan.lane, 1.0)
    assert p.tick(3.0).close == []
    assert p.tick(6.5).close == [plan.lane[0]]


def test_the_connection_limit_retires_the_socket() -> None:
    p = planner(spread_sockets=1)
    r = req([user("a")])
    a = opened(p, p.plan("id", r, 0.0))
    b = p.plan("id", req([user("b")]), 0.0)
    assert a.lane is not None and b.lane is not None
    assert p.finished(a.lane, 1.0, retire=True) == []  # b is still in flight
    assert p.finished(b.lane, 1.0) == [a.lane[0]]


def test_total_limit_closes_the_least_recently_used_idle_socket() -> None:
    p = planner(max_sockets_total=1)
    a = opened(p, p.plan("a", req([user("a")]), 0.0))
    assert a.lane is not None
    p.finished(a.lane, 1.0)
    b = p.plan("b", req([user("b")]), 2.0)
    assert b.close == (a.lane[0],) and b.open_socket


def test_lane_refusal_turns_named_lanes_off_for_a_while() -> None:
    p = planner(spread_sockets=1)
    a = opened(p, p.plan("id", req([user("a")]), 0.0))
    b = p.plan("id", req([user("b")]), 0.0)
    assert b.stream_id == "u1" and b.lane is not None and a.lane is not None
    p.proof.refused(0.0)
    p.finished(b.lane, 0.0)
    assert not p.named_lanes
    c = p.plan("id", req([user("c")]), 0.0)
    assert c.stream_id is None and c.lane != a.lane  # a default lane of another socket
    p.tick(LANES_RETRY_SECONDS + 1)
    assert p.named_lanes


def test_an_early_close_is_a_refusal_until_lanes_are_proven_then_only_a_run_of_them_is() -> None:
    # Never proven on this upstream: the first early close is how it refuses lanes.
    p = planner()
    assert p.proof.closed_early(0.0) and not p.named_lanes
    # Proven (a socket routed a stream_id): a lost socket, unless they keep coming.
    p = planner()
    assert not p.proof.signal(LaneSignal.PROVEN, 0.0)
    for _ in range(EARLY_CLOSES_TO_REFUSE - 1):
        assert not p.proof.closed_early(1.0) and p.named_lanes
    assert not p.proof.signal(LaneSignal.PROVEN, 2.0)  # a lane proven in between: the run restarts
    for _ in range(EARLY_CLOSES_TO_REFUSE - 1):
        assert not p.proof.closed_early(3.0) and p.named_lanes
    assert p.proof.closed_early(3.0) and not p.named_lanes  # a run: the upstream refuses after all
    # After the retry window, the next try starts from nothing: unproven again.
    p.tick(3.0 + LANES_RETRY_SECONDS + 1)
    assert p.named_lanes and p.proof.closed_early(3.0 + LANES_RETRY_SECONDS + 2) and not p.named_lanes


def test_stream_limit_caps_that_sockets_lanes() -> None:
    p = planner(spread_sockets=1, max_sockets_per_identity=1)
    plans = [opened(p, p.plan("id", req([user(f"c{i}")]), 0.0)) for i in range(3)]
    assert plans[2].lane == (1, "u2")
    p.book.stream_limit(plans[2].lane)  # type: ignore[arg-type]
    p.finished(plans[2].lane, 0.0)  # type: ignore[arg-type]
    assert type(p.plan("id", req([user("d")]), 0.0)) is Wait


def test_app_chained_requests_go_to_the_lane_that_holds_their_response() -> None:
    p = planner()
    r = req([user("a")])
    a = opened(p, p.plan("id", r, 0.0))
    complete(p, a, r, "resp_a", 1.0)
    chained = p.plan("id", req([result(1)], previous_response_id="resp_a"), 2.0)
    assert (type(chained), chained.reason, chained.lane) == (Full, MissReason.APP_CHAINED, a.lane)
    stranger = p.plan("other", req([result(1)], previous_response_id="resp_a"), 2.0)
    assert stranger.lane != a.lane


def test_replays_are_full_sends() -> None:
    p = planner()
    r = req([user("a")])
    a = opened(p, p.plan("id", r, 0.0))
    complete(p, a, r, "resp_a", 1.0, call(1))
    replay = p.plan("id", req([user("a"), call(1), result(1)]), 2.0, replay=True)
    assert type(replay) is Full


def test_cancelled_connect_releases_the_reservation_and_close_all() -> None:
    p = planner()
    plan = p.plan("id", req([user("a")]), 0.0)
    assert plan.lane is not None and plan.open_socket
    p.finished(plan.lane, 0.0)  # the requester gave up while the socket was connecting
    assert p.book.lane(plan.lane).state is LaneState.IDLE  # type: ignore[union-attr]
    p.opened(plan.lane[0], 0.5)
    assert p.custody.close_all() == [plan.lane[0]] and p.sockets() == []
    assert sum(p.book.lane_counts.values()) == 0 and sum(p.book.socket_counts.values()) == 0


def test_a_connecting_socket_can_be_closed_and_an_open_one_closed_by_shutdown() -> None:
    p = planner()
    connecting = p.plan("id", req([user("a")]), 0.0)
    assert connecting.lane is not None
    p.custody.close_all()
    assert p.socket(connecting.lane[0]) is None
    lost = p.plan("id", req([user("b")]), 0.0)
    assert lost.lane is not None
    p.custody.lost(lost.lane[0])  # lost while connecting: FAILED


def test_retire_and_loss_while_retiring() -> None:
    p = planner()
    a = opened(p, p.plan("id", req([user("a")]), 0.0))
    assert a.lane is not None
    assert p.custody.retire(a.lane[0]) == []  # busy: retiring
    p.custody.lost(a.lane[0])
    b = opened(p, p.plan("id", req([user("b")]), 0.0))
    assert b.lane is not None
    p.finished(b.lane, 0.0)
    assert p.custody.retire(b.lane[0]) == [b.lane[0]]  # idle: closed at once
    c = opened(p, p.plan("id", req([user("c")]), 0.0))
    assert c.lane is not None
    p.custody.retire(c.lane[0])
    assert p.custody.close_all() == [c.lane[0]]


def test_invalid_steps_raise() -> None:
    with pytest.raises(InvalidTransition):
        lane_step(LaneState.IDLE, LaneEvent.FINISH)
    with pytest.raises(InvalidTransition):
        socket_step(SocketState.CLOSED, SocketEvent.OPENED)
    assert isinstance(InvalidTransition("x"), AssertionError)


def test_zz_every_transition_is_exercised() -> None:
    # Runs last in this module (pytest keeps file order): every row was taken by some test.
    wanted = {("lane", s, e) for s, e in LANE_TRANSITIONS} | {("socket", s, e) for s, e in SOCKET_TRANSITIONS}
    missing = wanted - SEEN
    assert not missing, sorted(missing)
    assert lanes.lane_name(0) is None and lanes.lane_name(3) == "u3"


def test_a_rotated_store_false_head_is_reseeded_on_a_new_lane() -> None:
    p = planner(rotate_after_seconds=10, reseed=True)
    r = req([user("a")], store=False)
    first = opened(p, p.plan("id", r, 0.0))
    complete(p, first, r, "resp_a", 1.0, call(1))
    assert len(p.custody.kept) == 1
    tick = p.tick(11.0)
    assert first.lane is not None and tick.close == [first.lane[0]]
    (job,) = tick.reseed
    assert job.anchor == first.lane and b'"store":false' in job.kept.body
    lane = p.reseed_lane("id", 11.0)
    assert lane is not None and lane.lane is not None and lane.open_socket
    p.opened(lane.lane[0], 11.1)
    p.reseeded(job.anchor, lane.lane, 11.2, "resp_warm")
    nxt = p.plan("id", req([user("a"), call(1), result(1)], store=False), 12.0)
    assert (type(nxt), nxt.lane, nxt.response_id) == (Continue, lane.lane, "resp_warm")
    assert p.custody.kept.get("resp_warm") is not None and p.custody.kept.get("resp_a") is None


def test_a_failed_reseed_lets_the_head_go() -> None:
    p = planner(rotate_after_seconds=10, reseed=True)
    r = req([user("a")], store=False)
    first = opened(p, p.plan("id", r, 0.0))
    complete(p, first, r, "resp_a", 1.0, call(1))
    (job,) = p.tick(11.0).reseed
    p.reseeded(job.anchor, None, 11.0, None)
    assert len(p.heads) == 0 and len(p.custody.kept) == 0
