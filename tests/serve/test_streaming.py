"""What the app receives: SSE bytes on the wire, JSON aggregation, headers, errors."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import orjson
import pytest
from openai import APIError, AsyncOpenAI, InternalServerError, RateLimitError

from tests.conftest import SidecarFactory
from tests.sidecar import Sidecar
from upshift_emulator import Emulator

HEADERS = {"Authorization": "Bearer sk-test"}
REQUEST_ID = re.compile(r"^req_[0-9a-f]{32}$")


def parse_sse(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Strictly parse OpenAI framing: ``event: T\\ndata: JSON\\n\\n`` blocks, nothing else."""
    assert data.endswith(b"\n\n")
    events = []
    for block in data[:-2].split(b"\n\n"):
        event_line, data_line = block.split(b"\n")
        assert event_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        payload = orjson.loads(data_line[len(b"data: ") :])
        assert payload["type"] == event_line[len(b"event: ") :].decode()
        events.append((payload["type"], payload))
    return events


async def post(url: str, body: dict[str, Any]) -> tuple[aiohttp.ClientResponse, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/responses", json=body, headers=HEADERS) as resp:
            return resp, await resp.read()


async def test_sse_bytes_on_the_wire(stack: tuple[Emulator, Sidecar]) -> None:
    _, sidecar = stack
    resp, data = await post(sidecar.base_url, {"model": "gpt-6.1-sol", "input": "hi", "stream": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert REQUEST_ID.match(resp.headers["x-request-id"])
    assert resp.headers["x-upshift-mode"] == "full"
    assert float(resp.headers["x-upshift-overhead-ms"]) >= 0
    assert b"[DONE]" not in data
    events = parse_sse(data)
    assert [e[1]["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    assert all(e[1]["response"]["previous_response_id"] is None for e in events if "response" in e[1])


async def test_json_aggregation_matches_the_stream(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    resp, data = await post(sidecar.base_url, {"model": "gpt-6.1-sol", "input": "hi"})
    assert resp.status == 200 and resp.headers["Content-Type"] == "application/json"
    assert REQUEST_ID.match(resp.headers["x-request-id"])
    body = orjson.loads(data)
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["previous_response_id"] is None
    assert body["output"][0]["content"][0]["text"]
    assert emulator.record(body["id"]) is not None


async def test_previous_response_id_rewritten_in_every_lifecycle_event(stack: tuple[Emulator, Sidecar]) -> None:
    _, sidecar = stack
    first = orjson.loads((await post(sidecar.base_url, {"model": "gpt-6.1-sol", "input": "hi"}))[1])
    history = [{"role": "user", "content": "hi"}, *first["output"], {"role": "user", "content": "more"}]
    resp, data = await post(sidecar.base_url, {"model": "gpt-6.1-sol", "input": history, "stream": True})
    assert resp.headers["x-upshift-mode"] == "continuation"
    lifecycle = [e for t, e in parse_sse(data) if "response" in e]
    assert [e["type"] for e in lifecycle] == ["response.created", "response.in_progress", "response.completed"]
    assert all(e["response"]["previous_response_id"] is None for e in lifecycle)


async def test_error_after_output_ends_with_one_nested_error_event(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    emulator.faults.arm("close", after_events=4, close_code=1011)
    resp, data = await post(sidecar.base_url, {"model": "gpt-6.1-sol", "input": "hi", "stream": True})
    assert resp.status == 200
    events = parse_sse(data)
    assert [t for t, _ in events].count("error") == 1 and events[-1][0] == "error"
    error = events[-1][1]
    assert set(error) == {"type", "sequence_number", "error"}
    assert error["sequence_number"] == events[-2][1]["sequence_number"] + 1
    assert error["error"]["code"] == "upstream_closed" and set(error["error"]) == {"type", "code", "message", "param"}
    assert stack[1].pool.count() == 0  # the broken socket is gone, its head too


async def test_error_after_output_with_the_sdk(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    emulator.faults.arm("drop", after_events=4)
    c = AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-test", max_retries=0)
    stream = await c.responses.create(model="gpt-6.1-sol", input="hi", stream=True)
    with pytest.raises(APIError) as info:
        async for _ in stream:
            pass
    assert info.value.code == "upstream_closed"


async def test_stream_false_failure_after_output_is_an_error_body(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    emulator.faults.arm("close", after_events=4)
    resp, data = await post(sidecar.base_url, {"model": "gpt-6.1-sol", "input": "hi"})
    assert resp.status == 502
    assert orjson.loads(data)["error"]["code"] == "upstream_closed"


@pytest.mark.parametrize("stream", [True, False])
async def test_rate_limit_error_frame_becomes_http_429(stack: tuple[Emulator, Sidecar], stream: bool) -> None:
    emulator, sidecar = stack
    emulator.faults.arm(
        "error",
        status=429,
        headers={"retry-after": "2", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"},
    )
    resp, data = await post(sidecar.base_url, {"model": "gpt-6.1-sol", "input": "hi", "stream": stream})
    assert resp.status == 429
    assert resp.headers["retry-after"] == "2" and resp.headers["x-ratelimit-remaining-requests"] == "0"
    assert resp.headers["x-ratelimit-reset-requests"] == "2s"
    assert REQUEST_ID.match(resp.headers["x-request-id"])
    assert orjson.loads(data) == {
        "error": {
            "type": "requests",
            "code": "rate_limit_exceeded",
            "message": "Rate limit reached for requests. Please try again in 2s.",
            "param": None,
        }
    }
    assert sidecar.pool.count() == 1  # a request-scoped error keeps the socket


async def test_rate_limit_with_the_sdk(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    emulator.faults.arm("error", status=429, headers={"retry-after": "0"})
    c = AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-test", max_retries=0)
    with pytest.raises(RateLimitError) as info:
        await c.responses.create(model="gpt-6.1-sol", input="hi", stream=True)
    assert info.value.code == "rate_limit_exceeded" and info.value.request_id
    assert REQUEST_ID.match(info.value.request_id or "")


async def test_response_failed_is_relayed(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    emulator.faults.arm("fail", after_events=3, message="boom", count=2)
    resp, data = await post(sidecar.base_url, {"model": "gpt-6.1-sol", "input": "hi", "stream": True})
    events = parse_sse(data)
    assert events[-1][0] == "response.failed"
    c = AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-test", max_retries=0)
    with pytest.raises(InternalServerError) as info:
        await c.responses.create(model="gpt-6.1-sol", input="hi")
    assert info.value.status_code == 500 and "boom" in info.value.message
    assert len(sidecar.heads) == 0  # never a head from a failed response


async def test_stream_idle_timeout_never_hangs(emulator: Emulator, make_sidecar: SidecarFactory) -> None:
    sidecar = await make_sidecar(timeouts={"stream_idle_seconds": 0.2})
    emulator.faults.arm("delay", seconds=1.0)
    resp, data = await post(sidecar.base_url, {"model": "gpt-6.1-sol", "input": "hi", "stream": True})
    assert resp.status == 504
    assert orjson.loads(data)["error"]["code"] == "upstream_timeout"
    assert sidecar.pool.count() == 0  # the socket with an unfinished response is closed
