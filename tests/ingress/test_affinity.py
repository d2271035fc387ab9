"""Owner computation (proxy/core/affinity.py): same owner from any process, cheap, stable."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import orjson
import pytest

from proxy.core.affinity import MAX_ROOT_ITEMS, owner, owner_key, rank, root_digest, root_items

ID = "a" * 64


def body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "gpt-6.1-sol", **fields})


def key(raw: bytes, identity: str = ID) -> bytes:
    root = root_digest(raw)
    assert root is not None
    return owner_key(identity, root)


def test_every_turn_of_a_conversation_has_the_root_of_its_first() -> None:
    first = body(input="Fix the bug in parser.py")
    history: list[Any] = [{"role": "user", "content": "Fix the bug in parser.py"}]
    keys = {key(first)}
    for turn in range(5):
        history += [
            {"type": "function_call", "call_id": f"c{turn}", "name": "read", "arguments": "{}"},
            {"type": "function_call_output", "call_id": f"c{turn}", "output": "x" * 1000},
        ]
        keys.add(key(body(input=history, tools=[{"type": "function", "name": "read"}])))
    assert len(keys) == 1


def test_re_serialised_echoes_and_member_order_do_not_matter() -> None:
    a = b'{"model":"m","input":[{"role":"user","content":"hi"}]}'
    b = json.dumps(
        {
            "input": [
                {"content": [{"type": "input_text", "text": "hi"}], "type": "message", "role": "user", "id": None},
                {"role": "assistant", "content": "hello"},
            ],
            "model": "m",
            "store": True,
        },
        indent=2,
    ).encode()
    assert key(a) == key(b) == key(body(input="hi"))


def test_instructions_and_settings_are_not_part_of_the_key() -> None:
    """Sub-agents with their own instructions over a shared history keep one owner."""
    shared = [{"role": "developer", "content": "You are a coder."}, {"role": "user", "content": "Task 7"}]
    main = body(input=shared, instructions="main agent")
    sub = body(input=[*shared, {"role": "user", "content": "sub-agent 2: review"}], instructions="reviewer", tools=[])
    assert key(main) == key(sub)
    assert root_items(main) == shared  # the root stops at the first user message


def test_root_differs_by_first_user_message_and_identity() -> None:
    assert key(body(input="task 1")) != key(body(input="task 2"))
    assert key(body(input="task 1")) != key(body(input="task 1"), identity="b" * 64)


def test_without_a_user_message_the_first_items_are_the_root() -> None:
    items = [{"type": "function_call_output", "call_id": f"c{i}", "output": "o"} for i in range(MAX_ROOT_ITEMS + 4)]
    root = root_items(body(input=items))
    assert root == items[:MAX_ROOT_ITEMS]


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'{"model": "m"}',
        b'{"input": 5}',
        b'{"input": []}',
        b'{"input": [{"role": "user", "content": "a", "x": [}',  # truncated root
        orjson.dumps({"input": [{"role": "user", "content": "a"}], "previous_response_id": "resp_1"}),
        orjson.dumps({"previous_response_id": "resp_1", "input": [{"role": "user", "content": "a"}]}),
        orjson.dumps({"input": [{"role": "user", "content": "a"}], "conversation": "conv_1"}),
    ],
)
def test_no_key_means_served_where_it_landed(raw: bytes) -> None:
    assert root_digest(raw) is None


def test_chaining_words_inside_the_history_are_not_chaining() -> None:
    raw = body(
        input=[{"role": "user", "content": 'say "previous_response_id": 1', "x": {"previous_response_id": "r"}}],
        previous_response_id=None,
    )
    assert root_digest(raw) is not None


def test_only_the_root_is_parsed() -> None:
    """A body whose history after the root is not even valid JSON still has a key: nothing
    past the first user message is parsed."""
    raw = b'{"model":"m","input":[{"role":"user","content":"hi"},{"broken": ]}'
    assert root_items(raw) == [{"role": "user", "content": "hi"}]


def test_rendezvous_is_deterministic_and_balanced() -> None:
    peers = ["http://10.0.0.1:8080", "http://10.0.0.2:8080", "http://10.0.0.3:8080"]
    keys = [os.urandom(16) for _ in range(6000)]
    owners = Counter(owner(k, peers) for k in keys)
    assert set(owners) == set(peers)
    assert all(1600 < n < 2400 for n in owners.values()), owners
    assert all(owner(k, peers) == owner(k, list(reversed(peers))) == rank(k, peers)[0] for k in keys[:200])


def test_membership_changes_move_only_about_one_nth() -> None:
    peers = [f"http://127.0.0.{i}:8080" for i in range(1, 4)]
    keys = [os.urandom(16) for _ in range(6000)]
    before = {k: owner(k, peers) for k in keys}
    # a fourth replica joins: only the keys it wins move, about 1/4 of them
    grown = [*peers, "http://127.0.0.4:8080"]
    moved = [k for k in keys if owner(k, grown) != before[k]]
    assert all(owner(k, grown) == "http://127.0.0.4:8080" for k in moved)
    assert 0.20 < len(moved) / len(keys) < 0.30
    # one leaves: only its own keys move, each to its second choice
    shrunk = peers[1:]
    for k in keys:
        if before[k] != peers[0]:
            assert owner(k, shrunk) == before[k]
        else:
            assert owner(k, shrunk) == rank(k, peers)[1]
