"""Plans: each kind carries what its execution needs, and a lane plan builds its frame."""

from __future__ import annotations

import orjson

from proxy.core.plans import Continue, Full, Http, HttpContinue, Plan, Wait
from proxy.reasons import MissReason, PassthroughReason
from tests.core.test_planner import req, user


def test_a_continuation_sends_its_new_items_after_the_previous_response() -> None:
    r = req([user("a"), user("b")])
    plan = Continue((1, "u1"), "resp_a", [user("b")], 1)
    sent = orjson.loads(plan.frame(r))
    assert (sent["previous_response_id"], sent["input"], sent["stream_id"]) == ("resp_a", [user("b")], "u1")
    assert (plan.reason, plan.stream_id, plan.hydrated, plan.close) == ("continuation", "u1", False, ())


def test_a_full_send_sends_the_whole_input_on_the_default_lane() -> None:
    r = req([user("a"), user("b")])
    sent = orjson.loads(Full(MissReason.NO_HEAD, (1, None)).frame(r))
    assert sent["input"] == [user("a"), user("b")] and "stream_id" not in sent
    assert "previous_response_id" not in sent


def test_the_kind_is_the_class() -> None:
    plans: list[Plan] = [
        Continue((1, None), "r", [], 0),
        Full(None, (1, None)),
        Wait(MissReason.NO_HEAD, growing=True),
        Http(PassthroughReason.POOL_FULL, (3,)),
        HttpContinue("r", [], 0),
    ]
    kinds = []
    for plan in plans:
        match plan:
            case Continue() | Full():
                kinds.append(("lane", plan.lane))
            case Wait(growing=growing):
                kinds.append(("wait", growing))
            case Http(reason=reason, close=close):
                kinds.append(("http", (reason, close)))
            case HttpContinue():
                kinds.append(("http_continue", plan.response_id))
    assert kinds == [
        ("lane", (1, None)),
        ("lane", (1, None)),
        ("wait", True),
        ("http", ("pool_full", (3,))),
        ("http_continue", "r"),
    ]
