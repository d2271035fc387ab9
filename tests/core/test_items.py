"""Echo matching for every client pattern of client-echo.md, and the mutations that must fail."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from proxy.core.items import canonical, echo_matches, fingerprint, item_key, phase_dropped

REASONING = {
    "id": "rs_1",
    "type": "reasoning",
    "summary": [{"type": "summary_text", "text": "Thinking about São Paulo 🌧"}],
    "encrypted_content": "gAAAAB-opaque==",
}
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "status": "completed",
    "role": "assistant",
    "phase": "commentary",
    "content": [{"type": "output_text", "text": "Checking the weather.", "annotations": [], "logprobs": []}],
}
CALL = {
    "id": "fc_1",
    "type": "function_call",
    "status": "completed",
    "arguments": '{"city":"São Paulo","unit":"celsius"}',
    "call_id": "call_1",
    "name": "get_weather",
}
CALL_ASYNC = dict(CALL, **{"async": False})
OUTPUT = [REASONING, MESSAGE, CALL]
UNLABELLED = {k: v for k, v in MESSAGE.items() if k != "phase"}
"""The same message from a model that does not label its messages (no ``phase``)."""


def _sdk_model_dump(item: dict[str, Any]) -> dict[str, Any]:
    """openai SDK ``model_dump()``: nulls for every optional field the server omitted."""
    out = copy.deepcopy(item)
    if item["type"] == "reasoning":
        out.update(content=None, status=None)
    if item["type"] == "function_call":
        out.update(async_=None, caller=None, namespace=None)
    if item["type"] == "message":
        out.setdefault("phase", None)
    return out


def _reordered(item: dict[str, Any]) -> dict[str, Any]:
    return dict(reversed(list(item.items())))


def _chat_style(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {"role": item["role"], "content": item["content"]}
    return item


def _string_content(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {"role": "assistant", "content": "".join(p["text"] for p in item["content"])}
    return item


def _langchain_v0(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "function_call":
        args = json.dumps(json.loads(item["arguments"]), ensure_ascii=False)
        return {
            "type": "function_call",
            "name": item["name"],
            "arguments": args,
            "call_id": item["call_id"],
            "id": item["id"],
        }
    if item["type"] == "message":
        parts = [{"type": "output_text", "text": p["text"], "annotations": p["annotations"]} for p in item["content"]]
        return {"type": "message", "content": parts, "role": "assistant", "phase": item.get("phase")}
    return {k: v for k, v in item.items() if v is not None}


def _langchain_v1(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "function_call":
        args = json.dumps(json.loads(item["arguments"]), separators=(",", ":"))  # \u00e3 escapes
        return {
            "type": "function_call",
            "name": item["name"],
            "arguments": args,
            "call_id": item["call_id"],
            "id": item["id"],
        }
    return _langchain_v0(item)


def _vercel_store_false(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "reasoning":
        return {
            "type": "reasoning",
            "id": item["id"],
            "encrypted_content": item["encrypted_content"],
            "summary": item["summary"],
        }
    if item["type"] == "function_call":
        return {
            "type": "function_call",
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": json.dumps(json.loads(item["arguments"]), separators=(",", ":"), ensure_ascii=False),
        }
    return {
        "role": "assistant",
        "content": [{"type": "output_text", "text": p["text"]} for p in item["content"]],
        "id": item["id"],
        "phase": item.get("phase"),
    }


def _vercel_default(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] in ("reasoning", "message"):
        return {"type": "item_reference", "id": item["id"]}
    return _vercel_store_false(item)


def _node_stream_helper(item: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(item)
    if item["type"] == "function_call":
        out["parsed_arguments"] = json.loads(item["arguments"])
    if item["type"] == "message":
        for part in out["content"]:
            part["parsed"] = None
    return out


def _codex(item: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any]
    if item["type"] == "reasoning":
        out = {
            "type": "reasoning",
            "id": item["id"],
            "summary": item["summary"],
            "content": None,
            "encrypted_content": item["encrypted_content"],
        }
    elif item["type"] == "function_call":
        out = {k: item[k] for k in ("type", "status", "id", "name", "arguments", "call_id")}
    else:
        out = _reordered(item)
    out["internal_chat_message_metadata_passthrough"] = {"turn_id": "t1"}
    return out


def _agents_omit_reasoning_id(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "reasoning":
        return {k: v for k, v in item.items() if k != "id"}
    return {k: v for k, v in item.items() if v is not None}


ECHO_STYLES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "sdk_plus_equals": lambda i: copy.deepcopy(i),
    "sdk_model_dump_nulls": _sdk_model_dump,
    "sdk_exclude_none": lambda i: {k: v for k, v in i.items() if v is not None},
    "key_order_changed": _reordered,
    "chat_role_content": _chat_style,
    "assistant_string_content": _string_content,
    "langchain_v0_reserialised_args": _langchain_v0,
    "langchain_v1_ascii_escaped_args": _langchain_v1,
    "vercel_store_false": _vercel_store_false,
    "vercel_item_reference": _vercel_default,
    "node_parsed_extras": _node_stream_helper,
    "codex_content_null_and_metadata": _codex,
    "agents_reasoning_id_omitted": _agents_omit_reasoning_id,
}


PHASE_DROPPING = frozenset({"chat_role_content", "assistant_string_content"})
"""Styles that rebuild a message from ``role`` and ``content`` only (client-echo.md §2.1)."""


@pytest.mark.parametrize("style", ECHO_STYLES, ids=list(ECHO_STYLES))
@pytest.mark.parametrize("message", [MESSAGE, UNLABELLED], ids=["phase", "no_phase"])
def test_every_client_echo_style_matches(style: str, message: dict[str, Any]) -> None:
    output = [REASONING, message, CALL]
    echo = [ECHO_STYLES[style](item) for item in output]
    matched = [echo_matches(fingerprint(o), e) for o, e in zip(output, echo, strict=True)]
    if style in PHASE_DROPPING and "phase" in message:
        # the model would see a phase the app did not send: only a (counted) tolerance
        assert matched == [True, False, True]
        assert phase_dropped(fingerprint(message), echo[1])
    else:
        assert matched == [True] * 3
        assert not any(phase_dropped(fingerprint(o), e) for o, e in zip(output, echo, strict=True))


def test_async_renamed_async_underscore_matches() -> None:
    echo = {k: v for k, v in CALL_ASYNC.items() if k != "async"} | {"async_": False}
    assert echo_matches(fingerprint(CALL_ASYNC), echo)


def _mut(item: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(item)
    out.update(changes)
    return out


MUTATIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "edited_message_text": (MESSAGE, _mut(MESSAGE, content=[{"type": "output_text", "text": "Other."}])),
    "edited_string_content": (MESSAGE, {"role": "assistant", "content": "Checking the weather!"}),
    "role_changed": (MESSAGE, _mut(MESSAGE, role="user")),
    "phase_changed": (MESSAGE, _mut(MESSAGE, phase="final_answer")),
    "phase_dropped": (MESSAGE, _mut(MESSAGE, phase=None)),
    "phase_added": (UNLABELLED, _mut(UNLABELLED, phase="commentary")),
    "annotation_dropped": (
        _mut(MESSAGE, content=[{"type": "output_text", "text": "Checking.", "annotations": [{"type": "url"}]}]),
        _mut(MESSAGE, content=[{"type": "output_text", "text": "Checking."}]),
    ),
    "two_parts_as_one_string": (
        _mut(UNLABELLED, content=[{"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]),
        {"role": "assistant", "content": "ab"},
    ),
    "namespace_dropped": (_mut(CALL, namespace="crm"), CALL),
    "caller_dropped": (_mut(CALL, caller={"type": "program", "caller_id": "prog_1"}), CALL),
    "unknown_call_field_dropped": (_mut(CALL, future_field={"a": 1}), CALL),
    "reasoning_content_dropped": (_mut(REASONING, content=[{"type": "reasoning_text", "text": "t"}]), REASONING),
    "annotation_added": (
        MESSAGE,
        _mut(
            MESSAGE,
            content=[
                {"type": "output_text", "text": "Checking the weather.", "annotations": [{"type": "url_citation"}]}
            ],
        ),
    ),
    "message_id_changed": (MESSAGE, _mut(MESSAGE, id="msg_2")),
    "changed_argument_value": (CALL, _mut(CALL, arguments='{"city":"Paris","unit":"celsius"}')),
    "extra_argument": (CALL, _mut(CALL, arguments='{"city":"São Paulo","unit":"celsius","x":1}')),
    "changed_call_id": (CALL, _mut(CALL, call_id="call_2")),
    "changed_tool_name": (CALL, _mut(CALL, name="get_time")),
    "reasoning_summary_edited": (REASONING, _mut(REASONING, summary=[{"type": "summary_text", "text": "x"}])),
    "reasoning_encrypted_changed": (REASONING, _mut(REASONING, encrypted_content="gAAAAB-other==")),
    "reasoning_without_content_or_id": (REASONING, {"type": "reasoning", "summary": REASONING["summary"]}),
    "wrong_item_reference": (MESSAGE, {"type": "item_reference", "id": "msg_9"}),
    "type_changed": (CALL, _mut(CALL, type="custom_tool_call")),
    "not_an_object": (CALL, "function_call"),  # type: ignore[dict-item]
    "user_message_instead_of_echo": (MESSAGE, {"role": "user", "content": "Checking the weather."}),
}


@pytest.mark.parametrize("name", MUTATIONS, ids=list(MUTATIONS))
def test_meaning_changing_mutations_do_not_match(name: str) -> None:
    stored, echo = MUTATIONS[name]
    assert not echo_matches(fingerprint(stored), echo)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"role": "user", "content": "hi"}, {"content": "hi", "role": "user"}),
        ({"role": "user", "content": "hi"}, {"type": "message", "role": "user", "content": "hi"}),
        (
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ),
        ({"type": "x", "v": -3}, {"type": "x", "v": -3.0}),
        ({"type": "x", "v": -1.2e-5}, {"type": "x", "v": -0.000012}),
        ({"type": "x", "v": 1, "w": None}, {"type": "x", "v": 1}),
        (
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
            {"call_id": "c", "output": "ok", "type": "function_call_output"},
        ),
    ],
)
def test_item_key_equal_for_equivalent_inputs(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert item_key(a) == item_key(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"role": "user", "content": "hi"}, {"role": "user", "content": "hi "}),
        ({"role": "user", "content": "hi"}, {"role": "developer", "content": "hi"}),
        ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}),
        (
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
            {"type": "function_call_output", "call_id": "c", "output": "OK"},
        ),
        ({"type": "x", "v": 1}, {"type": "x", "v": True}),
        ({"type": "x", "v": [1, 2]}, {"type": "x", "v": [2, 1]}),
    ],
)
def test_item_key_differs_when_meaning_differs(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert item_key(a) != item_key(b)


def test_canonical_handles_big_ints_and_conflicting_async() -> None:
    assert canonical({"a": 2**70}) == {"a": {"$bigint": str(2**70)}}
    assert canonical({"async": True, "async_": False}) != canonical({"async": True})
    assert canonical({"async_": True}) == canonical({"async": True})
