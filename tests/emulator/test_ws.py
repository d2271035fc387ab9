"""WebSocket mode through the SDK's own client (``client.responses.connect()``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets
from openai import AsyncOpenAI, OpenAI

from upshift_emulator import Emulator, LatencyModel

from .conftest import KEY, TERMINAL, TOOLS, ClientFactory, EmulatorFactory, final_response, read_turn, recv_json

pytestmark = pytest.mark.timeout(30)


async def test_three_turn_store_false_chain_hits_cache(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="turn one", store=False)
        first = final_response(await read_turn(conn))
        await conn.response.create(model="gpt-6.1-sol", input="turn two", store=False, previous_response_id=first["id"])
        second = final_response(await read_turn(conn))
        await conn.response.create(
            model="gpt-6.1-sol", input="turn three", store=False, previous_response_id=second["id"]
        )
        third = final_response(await read_turn(conn))
    stats = emulator.stats
    assert stats.requests["ws"] == 3
    assert stats.continuations["ws"] == 2
    assert stats.cache_hits == 2
    assert stats.misses["ws"] == 0 and stats.hydrations["ws"] == 0
    record = emulator.record(third["id"])
    assert record is not None
    assert record["cache_hit"] and record["continuation"] and not record["hydrated"]
    assert record["context_items"] == 5  # 3 user messages + 2 assistant replies
    assert record["input_items"] == 1
    assert third["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert third["previous_response_id"] == second["id"] and third["store"] is False
    # store=false responses are not retrievable over HTTP
    with pytest.raises(Exception, match="404"):
        await client.responses.retrieve(third["id"])


async def test_miss_gives_exact_previous_response_not_found(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="x", store=False, previous_response_id="resp_unknown")
        events = await read_turn(conn)
        # the socket stays open and takes a full-context create
        await conn.response.create(model="gpt-6.1-sol", input="x", store=False)
        assert final_response(await read_turn(conn))["status"] == "completed"
    assert events == [
        {
            "type": "error",
            "status": 400,
            "error": {
                "message": "Previous response with id 'resp_unknown' not found.",
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "previous_response_not_found",
            },
        }
    ]
    assert emulator.stats.misses["ws"] == 1


async def test_forced_miss_fault_and_sdk_typed_error(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="a", store=False)
        first = final_response(await read_turn(conn))
        emulator.faults.arm("miss")
        await conn.response.create(model="gpt-6.1-sol", input="b", store=False, previous_response_id=first["id"])
        event = await conn.recv()
        assert event.type == "error"
        assert event.error.code == "previous_response_not_found"  # type: ignore[union-attr]
        assert event.error.message == f"Previous response with id '{first['id']}' not found."  # type: ignore[union-attr]
        # the parent was evicted: a retry with the same anchor misses too
        await conn.response.create(model="gpt-6.1-sol", input="b", store=False, previous_response_id=first["id"])
        assert (await read_turn(conn))[-1]["error"]["code"] == "previous_response_not_found"
    assert emulator.stats.misses["ws"] == 2
    assert emulator.stats.faults_fired == {"miss": 1}


async def test_generate_false_warmup_then_chained_turn(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(
            model="gpt-6.1-sol",
            input="You are terse.",
            store=False,
            generate=False,
            tools=TOOLS,
            instructions="be nice",
        )
        warm = await read_turn(conn)
        assert [e["type"] for e in warm] == ["response.created", "response.completed"]
        assert [e["sequence_number"] for e in warm] == [0, 1]
        done = warm[-1]["response"]
        assert done["output"] == [] and done["status"] == "completed"
        assert done["usage"]["output_tokens"] == 0
        await conn.response.create(
            model="gpt-6.1-sol", input="now answer", store=False, previous_response_id=done["id"]
        )
        reply = final_response(await read_turn(conn))
    assert emulator.stats.generate_false == 1
    assert emulator.stats.cache_hits == 1
    record = emulator.record(reply["id"])
    assert record is not None and record["context_items"] == 2 and record["cache_hit"]


async def test_age_limit(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(ws_max_age_s=1)
    client = sdk(emu)
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="early")
        assert final_response(await read_turn(conn))["status"] == "completed"
        await asyncio.sleep(1.05)
        await conn.response.create(model="gpt-6.1-sol", input="late")
        event = await recv_json(conn)
        assert event == {
            "type": "error",
            "status": 400,
            "error": {
                "message": "Responses websocket connection limit reached (1 seconds). "
                "Create a new websocket connection to continue.",
                "type": "invalid_request_error",
                "param": None,
                "code": "websocket_connection_limit_reached",
            },
        }
        with pytest.raises(websockets.ConnectionClosedOK):
            await conn.recv_bytes()
    assert list(emu.stats.connections.values())[0].close_code == 1000


def test_age_limit_default_text() -> None:
    from upshift_emulator.errors import connection_limit_reached

    assert connection_limit_reached(3600).message == (
        "Responses websocket connection limit reached (60 minutes). Create a new websocket connection to continue."
    )


async def test_second_create_is_queued_fifo(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(latency=LatencyModel(tokens_per_second=2000.0), reply_bytes=400)
    client = sdk(emu)
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="first")
        await conn.response.create(model="gpt-6.1-sol", input="second")
        events = await read_turn(conn) + await read_turn(conn)
    ids = [e["response"]["id"] if "response" in e else e["item_id"] if "item_id" in e else None for e in events]
    first_done = next(i for i, e in enumerate(events) if e["type"] == "response.completed")
    assert events[first_done + 1]["type"] == "response.created"
    assert len({i for i in ids[: first_done + 1] if i and i.startswith("resp_")}) == 1
    assert all(e["type"] != "error" for e in events)
    assert "stream_id" not in events[0]
    assert list(emu.stats.connections.values())[0].max_in_flight == 1


async def test_two_named_lanes_run_in_parallel(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(latency=LatencyModel(tokens_per_second=1500.0), reply_bytes=400)
    client = sdk(emu)
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="lane a", stream_id="a", store=False)
        await conn.response.create(model="gpt-6.1-sol", input="lane b", stream_id="b", store=False)
        events: list[dict[str, Any]] = []
        while sum(e["type"] == "response.completed" for e in events) < 2:
            events.append(await recv_json(conn))
        lanes = [e["stream_id"] for e in events]
        # continue lane b from its own latest, and fork lane a's response into a new lane
        latest = {e["stream_id"]: e["response"]["id"] for e in events if e["type"] == "response.completed"}
        await conn.response.create(
            model="gpt-6.1-sol", input="more", stream_id="b", store=False, previous_response_id=latest["b"]
        )
        assert final_response(await read_turn(conn))["status"] == "completed"
        await conn.response.create(
            model="gpt-6.1-sol", input="fork", stream_id="c", store=False, previous_response_id=latest["a"]
        )
        fork = await read_turn(conn)
    assert set(lanes) == {"a", "b"}
    switches = sum(1 for x, y in zip(lanes, lanes[1:], strict=False) if x != y)
    assert switches > 2, "events of the two lanes should interleave"
    assert list(emu.stats.connections.values())[0].max_in_flight == 2
    assert all(e["stream_id"] == "c" for e in fork)
    assert emu.stats.cache_hits == 2


async def test_invalid_stream_id(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        for bad in ("", "has space", "x" * 257):
            await conn.response.create(model="gpt-6.1-sol", input="x", stream_id=bad)
            event = await recv_json(conn)
            assert event["type"] == "error" and "stream_id" not in event
            assert event["error"]["code"] == "invalid_stream_id"
            assert event["error"]["param"] == "stream_id"
            assert event["error"]["message"] == (
                "The 'stream_id' field must be a non-empty string with at most 256 characters and may only "
                "contain letters, numbers, underscores, hyphens, and periods."
            )


async def test_named_stream_limit(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        for index in range(32):
            await conn.response.create(model="gpt-6.1-sol", input="x", stream_id=f"lane-{index}", store=False)
        done = 0
        while done < 32:
            done += (await recv_json(conn))["type"] == "response.completed"
        await conn.response.create(model="gpt-6.1-sol", input="x", stream_id="lane-32")
        event = await recv_json(conn)
        assert event == {
            "type": "error",
            "status": 400,
            "stream_id": "lane-32",
            "error": {
                "message": "This WebSocket connection has reached its maximum number of distinct stream IDs "
                "(32). Reuse an existing stream_id or open a new WebSocket connection.",
                "type": "invalid_request_error",
                "param": "stream_id",
                "code": "websocket_stream_limit_reached",
            },
        }
        await conn.response.create(model="gpt-6.1-sol", input="reuse", stream_id="lane-0")
        assert final_response(await read_turn(conn))["status"] == "completed"


async def test_in_flight_limit_queues(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(latency=LatencyModel(ttft_ms=50.0), ws_max_in_flight=2)
    client = sdk(emu)
    async with client.responses.connect() as conn:
        for index in range(5):
            await conn.response.create(model="gpt-6.1-sol", input="x", stream_id=f"s{index}")
        done = 0
        while done < 5:
            event = await recv_json(conn)
            assert event["type"] != "error"
            done += event["type"] == "response.completed"
    assert list(emu.stats.connections.values())[0].max_in_flight == 2


async def test_background_rejected_and_stream_ignored(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="x", background=True, stream_id="bg")
        event = await recv_json(conn)
        assert event["type"] == "error" and event["status"] == 400 and event["stream_id"] == "bg"
        assert event["error"]["param"] == "background" and event["error"]["code"] is None
        assert event["error"]["type"] == "invalid_request_error"
        await conn.response.create(model="gpt-6.1-sol", input="x", stream=True, previous_response_id=None)
        assert final_response(await read_turn(conn))["status"] == "completed"


async def test_steer_unknown_type_invalid_json(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.steer(input="hurry", previous_response_id="resp_x")
        steer = await recv_json(conn)
        assert steer["type"] == "response.steer.failed"
        assert steer["error"]["code"] == "steering_not_supported"
        await conn.send_raw(json.dumps({"type": "response.cancel"}))
        unknown = await recv_json(conn)
        assert unknown["type"] == "error" and unknown["error"]["type"] == "invalid_request_error"
        await conn.send_raw("{not json")
        bad = await recv_json(conn)
        assert bad["type"] == "error" and bad["status"] == 400
        assert bad["error"]["message"].startswith("We could not parse the JSON body")


async def test_store_true_hydrates_on_new_socket(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="stored")
        first = final_response(await read_turn(conn))
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="next", previous_response_id=first["id"])
        second = final_response(await read_turn(conn))
    assert emulator.stats.hydrations["ws"] == 1 and emulator.stats.cache_hits == 0
    record = emulator.record(second["id"])
    assert record is not None and record["hydrated"] and not record["cache_hit"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert (await client.responses.retrieve(second["id"])).id == second["id"]


async def test_store_false_does_not_survive_new_socket(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="ephemeral", store=False)
        first = final_response(await read_turn(conn))
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="next", store=False, previous_response_id=first["id"])
        assert (await read_turn(conn))[-1]["error"]["code"] == "previous_response_not_found"


async def test_failed_same_lane_continuation_evicts_parent(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="a", store=False)
        first = final_response(await read_turn(conn))
        # an unpaired function_call_output is a 400: the failed continuation evicts its parent
        bad = [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
        await conn.response.create(model="gpt-6.1-sol", input=bad, store=False, previous_response_id=first["id"])
        error = (await read_turn(conn))[-1]
        assert error["error"]["message"] == "No tool call found for function call output with call_id call_nope."
        await conn.response.create(model="gpt-6.1-sol", input="b", store=False, previous_response_id=first["id"])
        assert (await read_turn(conn))[-1]["error"]["code"] == "previous_response_not_found"


async def test_failed_cross_lane_fork_keeps_parent(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="a", store=False, stream_id="main")
        first = final_response(await read_turn(conn))
        emulator.faults.arm("error", status=500)
        await conn.response.create(
            model="gpt-6.1-sol", input="fork", store=False, stream_id="fork", previous_response_id=first["id"]
        )
        assert (await read_turn(conn))[-1]["status"] == 500
        await conn.response.create(
            model="gpt-6.1-sol", input="b", store=False, stream_id="main", previous_response_id=first["id"]
        )
        assert final_response(await read_turn(conn))["status"] == "completed"


async def test_tool_loop_over_ws(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.connect() as conn:
        await conn.response.create(model="gpt-6.1-sol", input="run 2 tool calls", tools=TOOLS, store=False)
        response = final_response(await read_turn(conn))
        for step in (1, 2):
            call = response["output"][-1]
            assert call["type"] == "function_call" and json.loads(call["arguments"])["path"].endswith(f"{step}.txt")
            output = [{"type": "function_call_output", "call_id": call["call_id"], "output": f"content {step}"}]
            await conn.response.create(
                model="gpt-6.1-sol", input=output, tools=TOOLS, store=False, previous_response_id=response["id"]
            )
            response = final_response(await read_turn(conn))
    assert response["output"][-1]["type"] == "message"
    assert "content 2" in response["output"][-1]["content"][0]["text"]
    assert emulator.stats.cache_hits == 2


async def test_bad_key_refused_on_upgrade(emulator: Emulator, sdk: ClientFactory) -> None:
    client = sdk(emulator, "sk-bad-key-1234")
    with pytest.raises(websockets.InvalidStatus) as info:
        async with client.responses.connect():
            pass
    assert info.value.response.status_code == 401
    body = json.loads(info.value.response.body or b"{}")
    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("Incorrect API key provided: sk-bad")


async def test_permessage_deflate_ping_and_identity(emulator: Emulator) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "OpenAI-Beta": "responses_websockets=2026-02-06"}
    async with websockets.connect(emulator.ws_url, additional_headers=headers, compression="deflate") as ws:
        assert ws.response is not None
        assert "permessage-deflate" in ws.response.headers.get("Sec-WebSocket-Extensions", "")
        assert "x-request-id" not in ws.response.headers
        latency = await ws.ping()
        await asyncio.wait_for(latency, 2)
        await ws.send(json.dumps({"type": "response.create", "model": "gpt-6.1-sol", "input": "zip"}))
        while json.loads(await ws.recv())["type"] != "response.completed":
            pass
    [conn] = emulator.stats.connections.values()
    assert conn.identity and KEY not in conn.identity and conn.requests == 1 and not conn.open


async def test_binary_frame_and_oversized_frame(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator(ws_max_message_bytes=1024)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with websockets.connect(emu.ws_url, additional_headers=headers) as ws:
        await ws.send(b"\x00\x01")
        assert json.loads(await ws.recv())["type"] == "error"
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 1003
    async with websockets.connect(emu.ws_url, additional_headers=headers, max_size=None) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "gpt-6.1-sol", "input": "x" * 2000}))
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 1009


async def test_idle_timeout(make_emulator: EmulatorFactory) -> None:
    emu = await make_emulator(ws_idle_timeout_s=0.2)
    async with websockets.connect(emu.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 3)
    assert ws.close_code == 1001


def test_sync_sdk_connect(threaded: Emulator, sync_client: OpenAI) -> None:
    with sync_client.responses.connect() as conn:
        conn.response.create(model="gpt-6.1-sol", input="sync hello", store=False)
        first = next(event for event in conn if event.type in TERMINAL)
        assert first.type == "response.completed"
        conn.response.create(model="gpt-6.1-sol", input="again", store=False, previous_response_id=first.response.id)
        second = next(event for event in conn if event.type in TERMINAL)
        assert second.type == "response.completed", second
        assert second.response.usage is not None
        assert second.response.usage.input_tokens_details.cached_tokens > 0
    assert threaded.stats.cache_hits == 1
