"""HeadTable: longest match, forks, retries, busy heads, identities, settings, expiry."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from proxy.core.conversation import HeadTable, MissReason
from proxy.core.request import ParsedRequest, parse_request

BASE = {"model": "gpt-6.1-sol", "tools": [{"type": "function", "name": "read"}], "store": False}


def req(items: list[Any], **fields: Any) -> ParsedRequest:
    body = dict(BASE, **fields)
    body["input"] = items
    return parse_request(orjson.dumps(body))


def call(n: int, arguments: str | None = None) -> dict[str, Any]:
    return {
        "id": f"fc_{n}",
        "type": "function_call",
        "status": "completed",
        "call_id": f"call_{n}",
        "name": "read",
        "arguments": arguments if arguments is not None else f'{{"step":{n}}}',
    }


def result(n: int) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": f"call_{n}", "output": f"out {n}"}


def reasoning(n: int) -> dict[str, Any]:
    return {"id": f"rs_{n}", "type": "reasoning", "summary": [], "encrypted_content": f"enc{n}"}


def response(rid: str, *output: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "response", "status": "completed", "output": list(output)}


USER = {"role": "user", "content": "do 3 steps"}


def table(**kw: Any) -> HeadTable:
    return HeadTable(max_heads=kw.pop("max_heads", 100), ttl_seconds=kw.pop("ttl", 600.0), **kw)


def test_three_turn_chain_continues_with_only_new_items() -> None:
    heads = table()
    r1 = req([USER])
    assert heads.lookup("id", r1, 0).reason == MissReason.NO_HEAD
    heads.record("id", "s1", r1, response("resp_1", call(1)), 0)
    r2 = req([USER, call(1), result(1)])
    found = heads.lookup("id", r2, 1)
    assert found.match is not None
    assert (found.match.anchor, found.match.response_id) == ("s1", "resp_1")
    assert found.match.new_items == [result(1)]
    assert found.match.items_avoided == 2
    heads.record("id", "s1", r2, response("resp_2", call(2)), 2)
    r3 = req([USER, call(1), result(1), call(2), result(2)])
    found = heads.lookup("id", r3, 3)
    assert found.match is not None and found.match.response_id == "resp_2"
    assert found.match.new_items == [result(2)]


def test_echo_in_another_client_shape_still_continues() -> None:
    heads = table()
    r1 = req([USER])
    heads.record("id", "s1", r1, response("resp_1", reasoning(1), call(1)), 0)
    echoed_call = {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": '{"step": 1}'}
    r2 = req([{"content": "do 3 steps", "role": "user"}, dict(reasoning(1), content=None), echoed_call, result(1)])
    found = heads.lookup("id", r2, 1)
    assert found.match is not None and found.match.new_items == [result(1)]


@pytest.mark.parametrize(
    ("name", "items", "reason"),
    [
        ("edited_first_message", [{"role": "user", "content": "do 4 steps"}, call(1), result(1)], MissReason.NO_HEAD),
        ("changed_arguments", [USER, dict(call(1), arguments='{"step":9}'), result(1)], MissReason.DIVERGED),
        ("output_not_echoed", [USER, result(1)], MissReason.DIVERGED),
        ("reordered", [USER, result(1), call(1)], MissReason.DIVERGED),
        ("retry_identical_input", [USER], MissReason.RETRY),
        ("echo_without_new_items", [USER, call(1)], MissReason.NO_NEW_ITEMS),
        ("extra_item_inserted", [USER, {"role": "user", "content": "x"}, call(1), result(1)], MissReason.DIVERGED),
    ],
)
def test_not_a_continuation(name: str, items: list[Any], reason: str) -> None:
    heads = table()
    heads.record("id", "s1", req([USER]), response("resp_1", call(1)), 0)
    found = heads.lookup("id", req(items), 1)
    assert found.match is None
    assert found.reason == reason


def test_settings_change_is_a_miss_and_says_so() -> None:
    heads = table()
    heads.record("id", "s1", req([USER]), response("resp_1", call(1)), 0)
    for change in ({"model": "gpt-6.1-terra"}, {"instructions": "be brief"}, {"tools": []}, {"store": True}):
        found = heads.lookup("id", req([USER, call(1), result(1)], **change), 1)
        assert found.match is None and found.reason == MissReason.SETTINGS_CHANGED, change


def test_stream_flag_and_include_order_do_not_matter() -> None:
    heads = table()
    heads.record("id", "s1", req([USER], include=["a", "b"], stream=True), response("resp_1", call(1)), 0)
    found = heads.lookup("id", req([USER, call(1), result(1)], include=["b", "a"], stream=False), 1)
    assert found.match is not None


def test_identities_never_share_heads() -> None:
    heads = table()
    heads.record("alice", "s1", req([USER]), response("resp_1", call(1)), 0)
    assert heads.lookup("bob", req([USER, call(1), result(1)]), 1).match is None
    assert heads.anchor_for("bob", "resp_1") is None
    assert heads.anchor_for("alice", "resp_1") == "s1"


def test_forks_keep_their_own_chains_and_longest_match_wins() -> None:
    heads = table()
    r1 = req([USER])
    heads.record("id", "s1", r1, response("resp_1", call(1)), 0)
    # Two sub-agents continue the same parent on different sockets.
    a = req([USER, call(1), result(1), {"role": "user", "content": "branch A"}])
    heads.record("id", "s2", a, response("resp_a", call(2)), 1)
    b = req([USER, call(1), result(1), {"role": "user", "content": "branch B"}])
    heads.record("id", "s3", b, response("resp_b", call(3)), 1)
    next_a = heads.lookup("id", req(a.items + [call(2), result(2)]), 2)
    next_b = heads.lookup("id", req(b.items + [call(3), result(3)]), 2)
    assert next_a.match is not None and next_a.match.response_id == "resp_a"
    assert next_b.match is not None and next_b.match.response_id == "resp_b"
    # The shared parent still serves a third branch (shorter match).
    c = heads.lookup("id", req([USER, call(1), result(1), {"role": "user", "content": "C"}]), 2)
    assert c.match is not None and c.match.response_id == "resp_1"


def test_busy_head_is_not_used() -> None:
    heads = table()
    heads.record("id", "s1", req([USER]), response("resp_1", call(1)), 0)
    nxt = req([USER, call(1), result(1)])
    assert heads.lookup("id", nxt, 1, {"s1"}).reason == MissReason.HEAD_BUSY
    # Whether a lane is busy is the planner's word (``busy``); the table still knows the id.
    assert heads.anchor_for("id", "resp_1") == "s1"


def test_dropped_reasoning_rejected_by_default_and_allowed_by_setting() -> None:
    for allow in (False, True):
        heads = table(allow_dropped_reasoning=allow)
        heads.record("id", "s1", req([USER]), response("resp_1", reasoning(1), call(1)), 0)
        found = heads.lookup("id", req([USER, call(1), result(1)]), 1)
        assert found.dropped_reasoning == 1
        assert (found.match is not None) is allow
        if not allow:
            assert found.reason == MissReason.DROPPED_REASONING


def test_app_chained_requests_are_not_matched_but_anchor_known() -> None:
    heads = table()
    chained = req([result(1)], previous_response_id="resp_0")
    assert heads.lookup("id", chained, 0).reason == MissReason.APP_CHAINED
    heads.record("id", "s1", chained, response("resp_1", call(2)), 0)
    assert heads.anchor_for("id", "resp_1") == "s1"
    assert heads.lookup("id", req([result(1), call(2), result(2)]), 1).match is None


def test_discard_expire_and_lru_bound() -> None:
    heads = table(max_heads=2, ttl=10.0)
    for n in range(3):
        heads.record("id", f"s{n}", req([{"role": "user", "content": str(n)}]), response(f"r{n}", call(n)), n)
    assert len(heads) == 2 and heads.anchor_for("id", "r0") is None
    heads.discard("s1")
    assert heads.anchor_for("id", "r1") is None and len(heads) == 1
    assert heads.expire(100.0) == ["s2"]
    assert len(heads) == 0 and repr(heads) == "<HeadTable [0 heads]>"


def test_record_replaces_the_sockets_previous_head() -> None:
    heads = table()
    heads.record("id", "s1", req([USER]), response("resp_1", call(1)), 0)
    r2 = req([USER, call(1), result(1)])
    heads.record("id", "s1", r2, response("resp_2", call(2)), 1)
    assert len(heads) == 1
    # The older turn's successor no longer matches: that anchor is gone from the socket.
    assert heads.lookup("id", req([USER, call(1), result(1), {"role": "user", "content": "x"}]), 2).match is None


def test_string_input_then_list_input_continues() -> None:
    heads = table()
    r1 = parse_request(orjson.dumps(dict(BASE, input="do 3 steps")))
    heads.record("id", "s1", r1, response("resp_1", call(1)), 0)
    found = heads.lookup("id", req([copy.deepcopy(USER), call(1), result(1)]), 1)
    assert found.match is not None


def test_a_busy_anchor_passes_the_match_to_the_next_head() -> None:
    heads = table()
    # The same turn answered twice alike, on two lanes (a parallel duplicate).
    heads.record("id", "s1", req([USER]), response("resp_1", call(1)), 0)
    heads.record("id", "s2", req([USER]), response("resp_2", call(1)), 0)
    nxt = req([USER, call(1), result(1)])
    first = heads.lookup("id", nxt, 1)
    assert first.match is not None
    other = heads.lookup("id", nxt, 1, {first.match.anchor})
    assert other.match is not None and other.match.anchor != first.match.anchor
    assert heads.lookup("id", nxt, 1, {"s1", "s2"}).reason == MissReason.HEAD_BUSY


def test_lookup_only_reads_and_touch_makes_the_head_the_last_to_go() -> None:
    heads = table(max_heads=2, ttl=10.0)
    heads.record("id", "s1", req([USER]), response("resp_1", call(1)), 0)
    heads.record("id", "s2", req([{"role": "user", "content": "other"}]), response("resp_2", call(2)), 1)
    found = heads.lookup("id", req([USER, call(1), result(1)]), 9)
    assert found.match is not None and found.match.anchor == "s1"
    assert heads.expire(10.5) == ["s1"]  # the lookup at 9 did not make s1 recent
    heads.record("id", "s1", req([USER]), response("resp_1", call(1)), 10)
    heads.touch("s2", 12)  # the planner continues s2's head
    assert heads.expire(20.5) == ["s1"]
    heads.record("id", "s3", req([{"role": "user", "content": "third"}]), response("resp_3", call(3)), 21)
    assert heads.has("s2") and heads.has("s3")  # within the LRU bound


def test_the_prefix_cache_holds_exactly_the_prefixes_of_the_index() -> None:
    heads = table()
    body = orjson.dumps(dict(BASE, input=[USER]))
    heads.record("id", "s1", heads.parse("id", body), response("resp_1", call(1)), 0)
    chained = req([result(1)], previous_response_id="resp_1")
    heads.record("id", "s2", chained, response("resp_2", call(2)), 1)  # a delta: no prefix to keep
    assert len(heads) == 2 and len(heads.prefixes) == 1 and heads.prefixes.body("s1") == body
    nxt = orjson.dumps(dict(BASE, input=[USER, call(1), result(1)]))
    assert heads.prefixes.parse("id", nxt).base is not None  # the fast parse needs only the cache
    assert heads.prefixes.parse("other", nxt).base is None  # and only the identity's prefixes
    heads.prefixes.cool("s1")  # memory pressure: the body goes, the digest stays
    assert heads.prefixes.body("s1") is None and heads.prefixes.parse("id", nxt).base is not None
    heads.rekey("s1", "s9")  # a rekeyed head keeps its prefix under its new anchor
    assert heads.prefixes.raw("s1") is None and heads.prefixes.raw("s9") is not None
    heads.discard("s9")
    assert len(heads.prefixes) == 0 and heads.prefixes.parse("id", nxt).base is None
