"""The newest protocol (protocol.md §6): steering, prompt_cache_options, the compaction event,
cache_write_tokens, function_call_arguments.done ``name``, obfuscation."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from upshift_emulator import Emulator

from .conftest import KEY, TOOLS, ClientFactory, EmulatorFactory
from .test_lanes import create, recv, until_terminals, wait_held

pytestmark = pytest.mark.timeout(30)
Event = dict[str, Any]
HEADERS = {"Authorization": f"Bearer {KEY}"}


def steer(target: str, text: Any = "also mention the tests", **extra: Any) -> str:
    return json.dumps({"type": "response.steer", "previous_response_id": target, "input": text, **extra})


async def started(conn: ClientConnection) -> str:
    event = await recv(conn)
    assert event["type"] == "response.created"
    response_id: str = event["response"]["id"]
    return response_id


async def until(conn: ClientConnection, kind: str) -> Event:
    """Skip events up to the first of type ``kind``."""
    while True:
        event = await recv(conn)
        if event["type"] == kind:
            return event


async def test_steer_default_is_not_supported(emulator: Emulator) -> None:
    async with websockets.connect(emulator.ws_url, additional_headers=HEADERS) as conn:
        await conn.send(steer("resp_x"))
        event = await recv(conn)
    assert event["type"] == "response.steer.failed" and event["error"]["code"] == "steering_not_supported"
    assert event["steer"] == {"input": "also mention the tests", "previous_response_id": "resp_x"}


@pytest.mark.parametrize("lane", [None, "lane-a"])
async def test_steer_accepted_ends_steered_then_successor(make_emulator: EmulatorFactory, lane: str | None) -> None:
    emu = await make_emulator(steer_models=("gpt-6.1-sol",))
    emu.faults.arm("hold", after_events=3)  # inside the message item
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        await conn.send(create(lane, input="write the report"))
        target = await started(conn)
        await wait_held(emu, 1)
        await conn.send(steer(target))
        accepted = await until(conn, "response.steer.accepted")
        emu.faults.release()
        events = await until_terminals(conn, 2)
    assert accepted["type"] == "response.steer.accepted" and accepted["steer"]["previous_response_id"] == target
    assert accepted["steer"]["id"].startswith("steer_") and accepted.get("stream_id") == lane
    kinds = [e["type"] for e in events]
    steered = events[kinds.index("response.incomplete")]["response"]
    assert steered["id"] == target and steered["incomplete_details"] == {"reason": "steered"}
    assert [item["type"] for item in steered["output"]] == ["message"]  # the item in progress was finished
    successor_created = events[kinds.index("response.incomplete") + 1]
    assert successor_created["type"] == "response.created" and successor_created["sequence_number"] == 0
    successor = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and successor["previous_response_id"] == target
    assert all(e.get("stream_id") == lane for e in events)
    record = emu.record(successor["id"])
    assert record is not None and record["context_items"] == 3 and record["input_items"] == 1
    assert record["cache_hit"] is True
    assert emu.stats.steers == {"accepted": 1, "successors": 1}


async def test_steer_pending_while_tool_output_is_awaited(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator(steer_models=("*",))
    emu.faults.arm("hold", after_events=2)
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        await conn.send(create(input="steps=1 read it", tools=TOOLS))
        target = await started(conn)
        await wait_held(emu, 1)
        await conn.send(steer(target, [{"role": "user", "content": "use the fast path"}]))
        await until(conn, "response.steer.accepted")
        emu.faults.release()
        events = await until_terminals(conn, 1)
        pending = await recv(conn)
        call = events[-1]["response"]["output"][0]
        assert events[-1]["type"] == "response.completed" and call["type"] == "function_call"
        assert pending["type"] == "response.steer.pending" and pending["reason"] == "waiting_for_required_input"
        assert pending["required_input"] == [
            {"type": "function_call_output", "call_id": call["call_id"], "name": call["name"]}
        ]
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "file body"}
        await conn.send(create(input=[output], tools=TOOLS, previous_response_id=target))
        final = (await until_terminals(conn, 1))[-1]["response"]
    record = emu.record(final["id"])
    assert record is not None and record["input_items"] == 2  # the steer message was prepended


async def test_steer_failures(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator(steer_models=("gpt-6.1-sol",))
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        await conn.send(create())
        done = (await until_terminals(conn, 1))[-1]["response"]["id"]
        codes = []
        for frame in (
            steer("resp_unknown"),
            steer(done),
            steer(done, stream_id="a"),
            steer(done, []),
            steer(done, [{"role": "assistant", "content": "x"}]),
        ):
            await conn.send(frame)
            codes.append((await recv(conn))["error"]["code"])
        assert codes == [
            "response_not_found",
            "response_already_completed",
            "invalid_input",
            "invalid_input",
            "invalid_input",
        ]
        emu.faults.arm("hold", after_events=2, count=2)
        await conn.send(create("x", model="gpt-4.1"))
        other = await started(conn)
        await wait_held(emu, 1)
        await conn.send(steer(other))
        refused = await until(conn, "response.steer.failed")
        assert refused["error"]["code"] == "steering_not_supported" and refused["stream_id"] == "x"
        emu.faults.release()
        await until_terminals(conn, 1)
        await conn.send(create())
        target = await started(conn)
        await wait_held(emu, 1)
        replies = []
        await until(conn, "response.in_progress")
        for _ in range(5):
            await conn.send(steer(target))
            replies.append(await recv(conn))
        assert [r["type"] for r in replies] == ["response.steer.accepted"] * 4 + ["response.steer.failed"]
        assert replies[-1]["error"]["code"] == "too_many_pending_steers"
        assert [r["sequence_number"] for r in replies] == sorted(r["sequence_number"] for r in replies)
        emu.faults.release()
        await until_terminals(conn, 2)


async def test_prompt_cache_options(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator()
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        body = {"model": "gpt-6.1-sol", "input": "hi", "prompt_cache_options": {"ttl": "12h", "mode": "explicit"}}
        async with session.post(emu.base_url + "/responses", json=body) as resp:
            response = await resp.json()
        assert response["prompt_cache_options"] == {"mode": "explicit", "ttl": "12h"}
        assert response["output"] and response["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
        body["prompt_cache_options"] = {"ttl": "1h"}
        async with session.post(emu.base_url + "/responses", json=body) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt_cache_options.ttl"
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        await conn.send(create(prompt_cache_options={"prewarm": True}))
        events = await until_terminals(conn, 1)
        assert [e["type"] for e in events] == ["response.created", "response.completed"]
        assert events[-1]["response"]["output"] == []
        await conn.send(create(previous_response_id=events[-1]["response"]["id"]))
        usage = (await until_terminals(conn, 1))[-1]["response"]["usage"]
    details = usage["input_tokens_details"]
    assert (
        details["cached_tokens"] > 0
        and details["cache_write_tokens"] == usage["input_tokens"] - details["cached_tokens"]
    )


async def test_compaction_event_on_threshold(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator()
    async with websockets.connect(emu.ws_url, additional_headers=HEADERS) as conn:
        cm: list[dict[str, Any]] = [{"type": "compaction", "compact_threshold": 1000}]
        await conn.send(create(input="x" * 4200, context_management=cm))
        events = await until_terminals(conn, 1)
        await conn.send(create(input="short", context_management=[{"type": "compaction", "compact_threshold": 10**6}]))
        quiet = await until_terminals(conn, 1)
        await conn.send(create(context_management=[{"type": "compaction", "compact_threshold": 10}]))
        refused = await recv(conn)
    assert refused["error"]["code"] == "integer_below_min_value"
    kinds = [e["type"] for e in events]
    index = kinds.index("response.compaction.compacting")
    assert kinds[index - 1] == "response.output_item.added" and kinds[index + 1] == "response.output_item.done"
    item = events[-1]["response"]["output"][0]
    assert item["type"] == "compaction" and item["encrypted_content"]
    assert events[index]["item_id"] == item["id"] and events[index]["output_index"] == 0
    assert "response.compaction.compacting" not in [e["type"] for e in quiet]


async def test_function_call_done_has_name_and_sse_obfuscation(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator()
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        events = []
        for include in (None, False):
            body: dict[str, Any] = {"model": "gpt-6.1-sol", "input": "steps=1", "tools": TOOLS, "stream": True}
            if include is not None:
                body["stream_options"] = {"include_obfuscation": include}
            async with session.post(emu.base_url + "/responses", json=body) as resp:
                text = await resp.text()
            events.append([json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")])
    default, plain = events
    done = next(e for e in default if e["type"] == "response.function_call_arguments.done")
    assert done["name"] == "read_file"
    deltas = [e for e in default if e["type"].endswith(".delta")]
    assert deltas and all(isinstance(e["obfuscation"], str) and e["obfuscation"] for e in deltas)
    assert all("obfuscation" not in e for e in plain)


async def test_steering_through_the_sdk_connection(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(steer_models=("gpt-6.1-sol",))
    emu.faults.arm("hold", after_events=3)
    client = sdk(emu)
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="draft it", store=False)
        created = await conn.recv()
        assert created.type == "response.created"
        await wait_held(emu, 1)
        await conn.response.steer(previous_response_id=created.response.id, input="shorter")
        kinds = []
        while True:
            event = await conn.recv()
            kinds.append(event.type)
            if event.type == "response.steer.accepted":
                assert event.steer.previous_response_id == created.response.id
                emu.faults.release()
            if event.type == "response.completed":
                break
    assert kinds[0] == "response.in_progress" and "response.steer.accepted" in kinds
    assert kinds.count("response.created") == 1 and "response.incomplete" in kinds  # the successor started
