"""The fidelity oracle: canonical forms (client-echo.md §4) and end-to-end digest equality."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import AsyncOpenAI

from upshift_emulator import Emulator, canonical_item, context_digest, settings_digest
from upshift_emulator.oracle import Segment

from .conftest import TOOLS, final_response, read_turn

pytestmark = pytest.mark.timeout(30)

EQUIVALENT = [
    (
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    ),
    (
        {"role": "assistant", "content": "ab", "phase": "final_answer"},
        {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant", "phase": "final_answer",
         "content": [{"type": "output_text", "text": "ab", "annotations": [], "logprobs": [], "parsed": None}]},
    ),
    (
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": 1.0, "b": [-1.2E-5]}'},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"b":[-1.2e-05],"a":1}', "id": "fc_1",
         "status": "completed", "async_": None, "caller": None, "namespace": None, "parsed_arguments": {"a": 1}},
    ),
    (
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ),
    (
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
         "encrypted_content": "E"},
        {"type": "reasoning", "summary": [{"text": "s", "type": "summary_text"}], "encrypted_content": "E",
         "content": None, "status": None},
    ),
    (
        {"type": "message", "role": "user", "content": "x",
         "internal_chat_message_metadata_passthrough": {"turn_id": 1}},
        {"role": "user", "content": [{"type": "input_text", "text": "x"}], "phase": None},
    ),
    ({"type": "function_call_output", "call_id": "c", "output": "o", "id": "fco_1"},
     {"type": "function_call_output", "call_id": "c", "output": "o", "status": "completed"}),
]  # fmt: skip

DIFFERENT = [
    ({"role": "user", "content": "hi"}, {"role": "developer", "content": "hi"}),
    ({"role": "user", "content": "hi"}, {"role": "user", "content": "hi "}),
    (
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a":1}'},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a":2}'},
    ),
    (
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "d", "name": "f", "arguments": "{}"},
    ),
    (
        {"type": "reasoning", "summary": [], "encrypted_content": "E"},
        {"type": "reasoning", "summary": [], "encrypted_content": "F"},
    ),
    ({"role": "assistant", "content": "x", "phase": "commentary"}, {"role": "assistant", "content": "x"}),
    ({"role": "assistant", "content": "x", "phase": "commentary"},
     {"role": "assistant", "content": "x", "phase": "final_answer"}),
    # Two parts are not their concatenation (how the model sees two parts is not documented).
    ({"role": "assistant", "content": "ab"},
     {"role": "assistant", "content": [{"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]}),
    ({"role": "assistant", "content": [{"type": "output_text", "text": "a", "annotations": []}]},
     {"role": "assistant",
      "content": [{"type": "output_text", "text": "a", "annotations": [{"type": "url_citation"}]}]}),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
     {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "crm"}),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "caller": {"type": "direct"}},
     {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "future_field": 1},
     {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}),
    ({"type": "reasoning", "summary": [], "encrypted_content": "E",
      "content": [{"type": "reasoning_text", "text": "t"}]},
     {"type": "reasoning", "summary": [], "encrypted_content": "E"}),
]  # fmt: skip


@pytest.mark.parametrize(("a", "b"), EQUIVALENT)
def test_equivalent_items(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert canonical_item(a) == canonical_item(b)
    assert canonical_item(canonical_item(a)) == canonical_item(a)  # idempotent


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_different_items(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert canonical_item(a) != canonical_item(b)


def test_segments_extend_like_one_list() -> None:
    items = [{"role": "user", "content": str(i)} for i in range(5)]
    chained = Segment.root().extend(items[:2]).extend([]).extend(items[2:])
    assert chained.digest == context_digest(items)
    assert chained.count == 5 and chained.to_list() == [canonical_item(i) for i in items]
    assert context_digest(items[::-1]) != chained.digest


def test_settings_digest() -> None:
    assert settings_digest("a", TOOLS) == settings_digest("a", json.loads(json.dumps(TOOLS)))
    assert settings_digest("a", TOOLS) != settings_digest("b", TOOLS)
    assert settings_digest(None, None) == settings_digest(None, [])


def _echo(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Echo output items the way different clients do (client-echo.md §2)."""
    echoed: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":  # chat-style: string content, no id/type/status
            echoed.append({"role": "assistant", "content": item["content"][0]["text"]})
        elif item["type"] == "function_call":  # re-serialised arguments, SDK model_dump() nulls
            args = json.dumps(json.loads(item["arguments"]), ensure_ascii=False)
            echoed.append({**item, "arguments": args, "async_": None, "caller": None, "namespace": None})
        else:  # reasoning, key order changed, content: null added (Codex)
            echoed.append({"content": None, **dict(reversed(list(item.items())))})
    return echoed


async def _ws_chain(client: AsyncOpenAI, settings: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Tool loop + a follow-up over WS with previous_response_id; returns (full history, last response)."""
    history: list[Any] = [{"role": "developer", "content": "house rules"}, {"role": "user", "content": "2 tool calls"}]
    async with client.responses.connect() as conn:
        await conn.response.create(input=history, **settings)
        response = final_response(await read_turn(conn))
        step = 0
        while True:
            history += _echo(response["output"])
            last = response["output"][-1]
            if last["type"] == "function_call":
                step += 1
                new: list[Any] = [{"type": "function_call_output", "call_id": last["call_id"], "output": f"out {step}"}]
            elif step == 2:
                new = [{"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}]
                step += 1
            else:
                return history, response
            history += new
            await conn.response.create(input=new, previous_response_id=response["id"], **settings)
            response = final_response(await read_turn(conn))


async def test_full_history_http_digest_equals_ws_chain(emulator: Emulator, client: AsyncOpenAI) -> None:
    settings: dict[str, Any] = {
        "model": "gpt-6.1-sol",
        "store": False,
        "tools": TOOLS,
        "instructions": "You are a test.",
        "reasoning": {"effort": "low", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
    }
    history, ws_last = await _ws_chain(client, settings)
    ws_record = emulator.record(ws_last["id"])
    assert ws_record is not None and ws_record["cache_hit"] and ws_record["input_items"] == 1
    # the same conversation as one full-history HTTP request, echoed in other clients' shapes
    body = {**settings, "input": history[: -len(_echo(ws_last["output"]))]}
    http = await client.responses.create(**body)
    http_record = emulator.record(http.id)
    assert http_record is not None and http_record["transport"] == "http" and not http_record["continuation"]
    assert http_record["context_items"] == ws_record["context_items"] == 11
    assert http_record["context_digest"] == ws_record["context_digest"]
    assert http_record["settings_digest"] == ws_record["settings_digest"]
    assert http.output_text == ws_last["output"][-1]["content"][0]["text"]  # same context → same reply
    assert http_record["input_bytes"] > ws_record["input_bytes"]

    # alter one earlier tool output: a different digest and a visibly different reply
    altered = json.loads(json.dumps(body))
    outputs = [i for i in altered["input"] if i.get("type") == "function_call_output"]
    outputs[0]["output"] = "out 1 (edited)"
    other = await client.responses.create(**altered)
    other_record = emulator.record(other.id)
    assert other_record is not None and other_record["context_digest"] != ws_record["context_digest"]
    assert other.output_text != http.output_text

    # instructions are not inherited: a change shows in settings_digest only
    changed = await client.responses.create(**{**body, "instructions": "Something else."})
    changed_record = emulator.record(changed.id)
    assert changed_record is not None
    assert changed_record["context_digest"] == ws_record["context_digest"]
    assert changed_record["settings_digest"] != ws_record["settings_digest"]


@pytest.mark.parametrize("fault", [None, "fail"])
async def test_a_response_is_recorded_before_its_terminal_event_goes_out(fault: str | None) -> None:
    """A client that reads ``response.completed`` (or ``response.failed``) and at once asks for
    the oracle record or the stored response finds it (the sidecar, on another thread, is that
    fast). The WebSocket and SSE paths record in ``play``'s ``settle``, before the last send."""
    from upshift_emulator.config import EmulatorConfig, LatencyModel
    from upshift_emulator.engine import execute, finish
    from upshift_emulator.faults import Fault
    from upshift_emulator.runner import play
    from upshift_emulator.state import EmulatorState
    from upshift_emulator.turn import prepare

    config = EmulatorConfig()
    state = EmulatorState(config)
    body = {"model": "gpt-6.1-sol", "input": "hi", "store": True}
    turn = prepare(body, config=config, transport="ws", owner="o", base=Segment.root(),
                   lookup_item=lambda _: None, input_bytes=40)  # fmt: skip
    seen: list[tuple[str, bool, bool]] = []

    class Client:
        async def send(self, payload: dict[str, Any]) -> None:
            stored = state.get(turn.id, "o") is not None
            seen.append((payload["type"], turn.id in state.records, stored))

        async def abort(self) -> None: ...
        async def close(self, code: int) -> None: ...

    cut = Fault(kind="fail", after_events=2) if fault else None
    outcome = await play(execute(turn, config), turn, Client(), latency=LatencyModel(), fault=cut,
                         settle=lambda final: finish(state, turn, final))  # fmt: skip
    kind, recorded, stored = seen[-1]
    assert kind == ("response.failed" if fault else "response.completed") == f"response.{outcome.status}"
    assert recorded and stored == (not fault)  # a failed response is recorded, never stored
    assert not any(r for _, r, _ in seen[:-1])  # and not before its end
