"""The fast parse (skip the byte-identical prefix) must agree with a full parse, always."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.conversation import HeadTable
from proxy.core.request import build_frame, parse_request
from proxy.errors import InvalidRequest


def call(n: int) -> dict[str, Any]:
    return {
        "id": f"fc_{n}",
        "type": "function_call",
        "status": "completed",
        "call_id": f"call_{n}",
        "name": "read",
        "arguments": json.dumps({"path": f"src/{n}.py"}),
    }


def output(n: int, text: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": f"call_{n}", "output": text}


def dumps(obj: dict[str, Any], style: str) -> bytes:
    if style == "compact":
        return orjson.dumps(obj)
    if style == "spaced":
        return json.dumps(obj, ensure_ascii=False).encode()
    return json.dumps(obj, indent=1).encode()


def body(items: list[Any], style: str = "compact", stream: bool = True, **extra: Any) -> bytes:
    fields: dict[str, Any] = {"model": "gpt-6.1-sol", "stream": stream, "include": ["reasoning.encrypted_content"]}
    fields["input"] = items
    fields.update({"tools": [{"type": "function", "name": "read", "parameters": {"input": []}}], "store": False})
    fields.update(extra)
    return dumps(fields, style)


def run_chain(turns: int, style: str, texts: list[str], hot: bool = True) -> tuple[HeadTable, list[Any], bytes]:
    heads = HeadTable(max_heads=100, ttl_seconds=1e9, hot_bytes=1 << 30 if hot else 0)
    items: list[Any] = [{"role": "user", "content": f"do {turns} steps"}]
    raw = body(items, style)
    for n in range(turns):
        req = heads.parse("id", raw)
        found = heads.lookup("id", req, n)
        if n:
            assert req.base is not None, f"turn {n} was not fast-parsed"
            assert found.match is not None, found.reason
            assert found.match.new_items == [items[-1]]
            frame = orjson.loads(
                build_frame(req, previous_response_id=found.match.response_id, items=found.match.new_items)
            )
            assert frame["input"] == [items[-1]] and frame["previous_response_id"] == f"resp_{n - 1}"
        full = orjson.loads(build_frame(req))
        slow = parse_request(raw)
        assert full == orjson.loads(build_frame(slow)), "full frames differ between fast and slow parse"
        assert full["input"] == items
        heads.record("id", "s1", req, {"id": f"resp_{n}", "output": [call(n)]}, n)
        items = items + [call(n), output(n, texts[n % len(texts)])]
        raw = body(items, style)
    return heads, items, raw


@pytest.mark.parametrize("hot", [True, False], ids=["bytes-compared", "digest-compared"])
@pytest.mark.parametrize("style", ["compact", "spaced", "indented"])
def test_chain_is_fast_parsed_every_turn(style: str, hot: bool) -> None:
    run_chain(6, style, ['tricky ","input":[ ] }', "é ✓ \\u00e9", "x" * 5000], hot)


def test_hot_bodies_are_bounded_and_cool_down() -> None:
    heads = HeadTable(max_heads=10, ttl_seconds=1e9, hot_bytes=1000, hot_seconds=5.0)
    for n in range(3):
        items = [{"role": "user", "content": f"{n}" * 400}]
        heads.record("id", f"s{n}", heads.parse("id", body(items)), {"id": f"r{n}", "output": [call(n)]}, float(n))
    hot = [a for a in ("s0", "s1", "s2") if heads.prefixes.body(a) is not None]
    assert hot == ["s2"]  # two ~500-byte bodies do not fit in 1000 bytes
    heads.expire(100.0)
    assert heads.prefixes.body("s2") is None and heads.prefixes.raw("s2") is not None
    # Cold heads still fast-parse (digest comparison).
    items = [{"role": "user", "content": "2" * 400}, call(2), output(2, "x")]
    assert heads.parse("id", body(items)).base is not None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=40), min_size=1, max_size=4), st.sampled_from(["compact", "spaced"]))
def test_fast_and_slow_parse_agree_on_any_tool_output(texts: list[str], style: str) -> None:
    run_chain(4, style, texts)


def test_retry_of_same_body_is_not_a_continuation() -> None:
    heads = HeadTable(max_heads=10, ttl_seconds=1e9)
    items = [{"role": "user", "content": "hi"}]
    first = body(items)
    heads.record("id", "s1", heads.parse("id", first), {"id": "resp_0", "output": [call(0)]}, 0)
    again = heads.parse("id", first)
    assert heads.lookup("id", again, 1).reason == "retry"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:-1] + b", }",  # trailing comma in the object
        lambda b: b.replace(b'"store":false', b'"store":"no"'),  # wrong type after input
        lambda b: b.replace(b'{"type":"function_call_output"', b'["not an object"', 1),
    ],
)
def test_invalid_bodies_are_rejected_like_a_full_parse(mutate: Any) -> None:
    heads, items, raw = run_chain(2, "compact", ["out"])
    bad = mutate(raw)
    with pytest.raises(InvalidRequest):
        parse_request(bad)
    with pytest.raises(InvalidRequest):
        heads.parse("id", bad)


def test_trailing_comma_inside_input_is_rejected() -> None:
    heads, items, raw = run_chain(2, "compact", ["out"])
    span_end = raw.rindex(b'],"tools"')
    bad = raw[:span_end] + b",]" + raw[span_end + 1 :]
    with pytest.raises(InvalidRequest):
        heads.parse("id", bad)


def test_duplicate_input_key_falls_back_to_full_parse() -> None:
    heads, items, raw = run_chain(2, "compact", ["out"])
    dup = raw[:-1] + b',"input":[{"role":"user","content":"other"}]}'
    req = heads.parse("id", dup)
    assert req.base is None
    assert req.items == [{"role": "user", "content": "other"}]


def test_other_identity_gets_no_fast_parse() -> None:
    heads, items, raw = run_chain(2, "compact", ["out"])
    assert heads.parse("someone-else", raw).base is None


def test_settings_change_after_input_is_seen_by_fast_parse() -> None:
    heads, items, raw = run_chain(2, "compact", ["out"])
    changed = raw.replace(b'"store":false', b'"store":false,"temperature":0.1')
    req = heads.parse("id", changed)
    assert heads.lookup("id", req, 9).match is None


@pytest.mark.parametrize("style", ["compact", "spaced", "indented"])
def test_hot_turns_reuse_the_settings_and_never_parse_the_prefix(style: str) -> None:
    heads = HeadTable(max_heads=100, ttl_seconds=1e9)
    items: list[Any] = [{"role": "user", "content": "do 5 steps"}]
    raw = body(items, style)
    for n in range(5):
        req = heads.parse("id", raw)
        slow = parse_request(raw)
        assert req.settings_digest == slow.settings_digest
        assert req.fields == slow.fields | {"input": req.fields["input"]}
        found = heads.lookup("id", req, n)
        if n:
            assert req.settings is not None, f"turn {n}: settings parsed again"
            assert found.match is not None, found.reason
            frame = build_frame(req, previous_response_id=f"resp_{n - 1}", items=found.match.new_items)
            want = build_frame(slow, previous_response_id=f"resp_{n - 1}", items=found.match.new_items)
            assert orjson.loads(frame) == orjson.loads(want)
            # digests the fast parse covers need no parse; shorter ones parse only the prefix, once
            lengths = {req.n_items - 1, req.n_items}
            assert req.prefix_digests(lengths) == slow.prefix_digests(lengths) and req.prefix_parses == 0
            assert req.input_state().digest() == slow.input_state().digest() and req.prefix_parses == 0
            assert req.base is not None
            shorter = {req.base.count - 1}
            assert req.prefix_digests(shorter) == slow.prefix_digests(shorter) and req.prefix_parses == 1
            assert req.all_items() == slow.all_items() == items and req.prefix_parses == 1
        heads.record("id", "s1", req, {"id": f"resp_{n}", "output": [call(n)]}, n)
        items = items + [call(n), output(n, f'out {n} ]}}, "input": [')]
        raw = body(items, style)


@pytest.mark.parametrize(
    "change",
    [
        {"store": True},  # a setting after the input changed: parsed again, new digest
        {"tools": []},
    ],
)
def test_changed_settings_bytes_are_parsed_again(change: dict[str, Any]) -> None:
    heads = HeadTable(max_heads=100, ttl_seconds=1e9)
    items: list[Any] = [{"role": "user", "content": "go"}]
    first = heads.parse("id", body(items))
    heads.record("id", "s1", first, {"id": "resp_0", "output": [call(0)]}, 0)
    items = items + [call(0), output(0, "x")]
    raw = body(items, **change)
    req = heads.parse("id", raw)
    assert req.settings is None and req.settings_digest == parse_request(raw).settings_digest != first.settings_digest


def test_cooled_head_drops_its_settings() -> None:
    heads = HeadTable(max_heads=100, ttl_seconds=1e9)
    items: list[Any] = [{"role": "user", "content": "go"}]
    first = heads.parse("id", body(items))
    heads.record("id", "s1", first, {"id": "resp_0", "output": [call(0)]}, 0)
    heads.expire(1e6)  # past hot_prefix_seconds: the body (and with it the parsed settings) goes
    req = heads.parse("id", body(items + [call(0), output(0, "x")]))
    assert req.base is not None and req.settings is None


def test_conversations_with_the_same_settings_share_one_block() -> None:
    heads = HeadTable(max_heads=100, ttl_seconds=1e9)
    blocks = []
    for n in range(3):
        req = heads.parse("id", body([{"role": "user", "content": f"conversation {n}"}]))
        heads.record("id", f"s{n}", req, {"id": f"resp_{n}", "output": [call(n)]}, 0)
        raw = heads.prefixes.raw(f"s{n}")
        assert raw is not None and raw.settings is not None
        blocks.append(raw.settings)
    assert blocks[0] is blocks[1] is blocks[2]  # a head holds a reference, not a copy of the settings
    other = heads.parse("id", body([{"role": "user", "content": "x"}], store=True))
    heads.record("id", "s9", other, {"id": "resp_9", "output": [call(9)]}, 0)
    nine = heads.prefixes.raw("s9")
    assert nine is not None and nine.settings is not blocks[0]


@pytest.mark.parametrize("hot", [True, False])
@pytest.mark.parametrize(("count", "pad"), [(40, 0), (4, 6000)])  # one digest finds them; each compared
def test_templated_conversations_of_one_length_and_ending_each_continue_from_their_own_head(
    hot: bool, count: int, pad: int
) -> None:
    """Conversations of one key whose prefixes have one length and end in the same bytes (one
    template, the same tool output): each next body is fast-parsed from its own head, hot (the
    body compared) or cooled (the digest), and a forgotten head is found by none."""
    heads = HeadTable(max_heads=1000, ttl_seconds=1e9, hot_bytes=1 << 30 if hot else 0)
    chats = [[{"role": "user", "content": f"ticket {c:04d}: do the steps" + "." * pad}] for c in range(count)]
    for n in range(3):
        for c, items in enumerate(chats):
            raw = body(items)
            req = heads.parse("id", raw)
            if n:
                assert req.base is not None and req.base.anchor == f"lane{c}", (n, c, req.base)
                assert req.all_items() == parse_request(raw).all_items() == items
            heads.record("id", f"lane{c}", req, {"id": f"resp_{c}_{n}", "output": [call(n)]}, n * 100 + c)
            chats[c] = items + [call(n), output(n, "done")]
    for c in range(0, count, 2):
        heads.discard(f"lane{c}")
    for c, items in enumerate(chats):
        req = heads.parse("id", body(items))
        assert (req.base is None) if c % 2 == 0 else (req.base is not None and req.base.anchor == f"lane{c}")
    for c in range(1, count, 2):
        heads.discard(f"lane{c}")
    assert len(heads.prefixes) == 0 and heads.parse("id", body(chats[1])).base is None
