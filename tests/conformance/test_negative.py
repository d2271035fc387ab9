"""The validators catch what they must: deliberately corrupted payloads fail, off-spec fault shapes fail."""

from __future__ import annotations

import copy
import json
from typing import Any

import aiohttp
import pytest
import websockets

from upshift_emulator import Emulator

from . import schema
from .lags import OFF_SPEC_SHAPES
from .scenarios import BODIES, HEADERS, recv

pytestmark = pytest.mark.timeout(60)
Event = dict[str, Any]


async def _sse(emu: Emulator, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        async with session.post(emu.base_url + "/responses", json={**body, "stream": True}) as resp:
            return await resp.read()


@pytest.fixture
async def good_events(emulator: Emulator) -> list[Event]:
    """A valid text + function-call stream (validated first, so the corruptions are the only difference)."""
    events = schema.validate_sse_bytes(await _sse(emulator, BODIES["reasoning"]))
    events += schema.validate_sse_bytes(await _sse(emulator, BODIES["text"]))
    return events


def _first(events: list[Event], kind: str) -> Event:
    return copy.deepcopy(next(e for e in events if e["type"] == kind))


@pytest.mark.parametrize(
    "kind,field",
    [
        ("response.output_text.delta", "item_id"),
        ("response.output_text.delta", "sequence_number"),
        ("response.function_call_arguments.done", "arguments"),
        ("response.output_item.added", "item"),
        ("response.reasoning_summary_text.delta", "summary_index"),
    ],
)
def test_missing_required_field_fails(good_events: list[Event], kind: str, field: str) -> None:
    event = _first(good_events, kind)
    del event[field]
    with pytest.raises(schema.ConformanceError) as info:
        schema.validate_stream_event(event)
    assert any(field in f.path for f in info.value.findings)
    with pytest.raises(schema.ConformanceError):
        schema.validate_ws_server_event(event)


def test_missing_required_field_in_the_response_fails(good_events: list[Event]) -> None:
    event = _first(good_events, "response.completed")
    del event["response"]["output"]
    with pytest.raises(schema.ConformanceError):
        schema.validate_stream_event(event)
    usage = _first(good_events, "response.completed")
    del usage["response"]["usage"]["input_tokens_details"]["cache_write_tokens"]  # a required field missing
    with pytest.raises(schema.ConformanceError) as info:
        schema.validate_response(usage["response"])
    assert {f.source for f in info.value.findings} == schema.LAYERS - {"sse"}  # both layers, when both run


@pytest.mark.parametrize("where", ["top", "nested_item", "nested_response", "usage"])
def test_unknown_key_fails_in_the_sdk_check(good_events: list[Event], where: str) -> None:
    if where == "top":
        event = _first(good_events, "response.output_text.delta")
        event["bogus"] = 1
    elif where == "nested_item":
        event = _first(good_events, "response.output_item.done")
        event["item"]["bogus"] = 1
    else:
        event = _first(good_events, "response.completed")
        target = event["response"] if where == "nested_response" else event["response"]["usage"]
        target["bogus"] = 1
    with pytest.raises(schema.ConformanceError) as info:
        schema.validate_stream_event(event)
    assert [(f.source, f.kind) for f in info.value.findings] == [("sdk", "unknown_key")]
    assert info.value.findings[0].path.endswith("bogus")


def test_wrong_types_and_unknown_event_types_fail(good_events: list[Event]) -> None:
    event = _first(good_events, "response.output_text.delta")
    event["output_index"] = "zero"
    with pytest.raises(schema.ConformanceError):
        schema.validate_stream_event(event)
    with pytest.raises(schema.ConformanceError) as info:
        schema.validate_stream_event({"type": "response.made_up", "sequence_number": 0})
    assert {f.kind for f in info.value.findings} == {"unknown_type"}
    with pytest.raises(schema.ConformanceError):
        schema.validate_error_body({"error": {"message": "no type, no code, no param"}})
    with pytest.raises(schema.ConformanceError):
        schema.validate_ws_server_event({"type": "error", "code": "x", "message": "flat"})
    with pytest.raises(schema.ConformanceError):
        schema.validate_client_event(json.dumps({"type": "response.create", "input": "no model", "bogus": 1}))


def test_wrong_event_name_and_done_marker_fail_in_sse(good_events: list[Event]) -> None:
    delta = _first(good_events, "response.output_text.delta")
    wrong = f"event: response.output_text.done\ndata: {json.dumps(delta)}\n\n".encode()
    with pytest.raises(schema.ConformanceError) as info:
        schema.validate_sse_bytes(wrong)
    assert info.value.findings[0].kind == "event_name"
    right = f"event: response.output_text.delta\ndata: {json.dumps(delta)}\n\n".encode()
    assert schema.validate_sse_bytes(right) == [delta]
    with pytest.raises(schema.ConformanceError):
        schema.validate_sse_bytes(right + b"data: [DONE]\n\n")
    with pytest.raises(schema.ConformanceError):
        schema.validate_sse_bytes(right[:-1])  # no blank line at the end


async def test_off_spec_fault_shapes(emulator: Emulator) -> None:
    """The ``miss`` shapes imitate other servers on purpose: the validators reject the off-spec ones."""
    verdicts: dict[str, bool] = {}
    async with websockets.connect(emulator.ws_url, additional_headers=HEADERS) as conn:
        for shape in OFF_SPEC_SHAPES:
            emulator.faults.arm("miss", shape=shape)
            frame = {"type": "response.create", **BODIES["text"], "store": False, "previous_response_id": "resp_x"}
            await conn.send(json.dumps(frame))
            events = [await recv(conn)]
            if events[0]["type"] == "response.created":
                events.append(await recv(conn))
            try:
                for event in events:
                    schema.validate_ws_server_event(event)
                verdicts[shape] = True
            except schema.ConformanceError:
                verdicts[shape] = False
    assert verdicts == {
        "no_type": False,
        "alpha": True,
        "flat": False,
        "top_level": False,
        "parameterless": True,
        "renamed": True,
        "response_failed": False,
    }
