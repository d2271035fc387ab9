"""Upstream faults, each injected through the emulator's fault hooks (docs/reliability.md §1).

The contract under test: before any byte reached the app a lost anchor, an aged socket or a
socket closed early is replayed once, invisibly, with the app's full input; after output reached
the app the stream ends with exactly one nested ``error`` event (or a 5xx JSON body), never a
replay, never duplicated output; upstream errors keep their HTTP status, body and rate-limit
headers; an unreachable or silent upstream is an OpenAI-style 502/504, never a hang.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from bench.ports import free_port
from proxy.upstream.pool import SocketUse
from tests.conftest import SidecarFactory
from tests.reliability.conftest import EmulatorFactory, SidecarFor
from tests.reliability.helpers import (
    KEY,
    MODEL,
    Conversation,
    Reply,
    assert_heads_completed,
    assert_openai_error,
    assert_pool_quiet,
    auth,
    head_response_ids,
    post,
    replays,
    user,
    wait_for,
)
from tests.sidecar import Sidecar
from upshift_emulator import NOT_FOUND_SHAPES, Emulator, LatencyModel
from upshift_emulator.state import identity_of

pytestmark = pytest.mark.timeout(60)

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
MID_STREAM_EVENTS = 5
"""created, in_progress, output_item.added, content_part.added, one delta: output reached the app."""


async def quiet(sc: Sidecar) -> None:
    """Wait until no socket is connecting (the pool warms a spare socket in the background, and a
    refuse_upgrade fault must not be consumed by it)."""
    assert await wait_for(lambda: sc.pool.count(SocketUse.CONNECTING) == 0), repr(sc.pool)


async def started(http: aiohttp.ClientSession, sc: Sidecar, emu: Emulator, **fields: Any) -> Conversation:
    """A conversation with one completed turn, so the next turn is a continuation."""
    conv = Conversation(http, sc.base_url, emu, **fields)
    record = await conv.turn()
    assert record["continuation"] is False
    await quiet(sc)
    return conv


def assert_no_duplicates(reply: Reply) -> None:
    """Every lifecycle event at most once, sequence numbers strictly increasing."""
    types = reply.types
    for kind in ("response.created", "response.in_progress", "response.completed", "error"):
        assert types.count(kind) <= 1, types
    seqs = [event["sequence_number"] for event in reply.events]
    assert seqs == sorted(set(seqs)), seqs


def assert_one_error_event(reply: Reply, code: str, output: str = "response.output_text.delta") -> dict[str, Any]:
    """The stream ended with exactly one nested error event, after real output, cleanly."""
    assert reply.status == 200 and reply.is_sse, (reply.status, reply.raw[:200])
    assert reply.raw.endswith(b"\n\n"), reply.raw[-100:]
    types = reply.types
    assert types[-1] == "error" and types.count("error") == 1, types
    assert "response.completed" not in types and output in types, types
    assert_no_duplicates(reply)
    event = reply.events[-1]
    assert set(event) == {"type", "sequence_number", "error"}, event
    assert set(event["error"]) == {"type", "code", "message", "param"}, event
    assert event["error"]["code"] == code, event
    assert event["sequence_number"] == reply.events[-2]["sequence_number"] + 1, event
    return event


# -- the socket closes or drops before the first event: one transparent replay --------------------


@STREAM
@pytest.mark.parametrize(
    ("kind", "close_code"),
    [("drop", 1006), ("close", 1001), ("close", 1011)],
    ids=["drop-1006", "close-1001", "close-1011"],
)
async def test_closed_before_first_event_is_replayed(
    http: aiohttp.ClientSession,
    emulator: Emulator,
    sidecar: Sidecar,
    kind: str,
    close_code: int,
    stream: bool,
) -> None:
    conv = await started(http, sidecar, emulator)
    before = replays("closed_before_first_event")
    requests = emulator.stats.requests["ws"]
    emulator.faults.arm(kind, after_events=0, close_code=close_code)
    reply = await conv.send("next", stream=stream)
    record = conv.accept(reply)
    assert emulator.stats.faults_fired == {kind: 1}
    assert replays("closed_before_first_event") == before + 1
    assert emulator.stats.requests["ws"] == requests + 2  # the failed create and one replay
    assert record["continuation"] is False and record["transport"] == "ws"  # the full input, new socket
    if stream:
        assert_no_duplicates(reply)
    assert_pool_quiet(sidecar)
    await conv.turn()  # and the conversation goes on


@STREAM
async def test_close_1009_before_first_event_goes_over_http(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, stream: bool
) -> None:
    # 1009 says the frame itself was too big: the same frame would be refused again (pitfall 16),
    # so the turn goes over plain HTTP with the app's own body, once.
    conv = await started(http, sidecar, emulator)
    before = replays("frame_too_big")
    requests = dict(emulator.stats.requests)
    emulator.faults.arm("close", after_events=0, close_code=1009)
    reply = await conv.send("next", stream=stream)
    record = conv.accept(reply)
    assert reply.mode == "passthrough" and record["transport"] == "http"
    assert replays("frame_too_big") == before + 1
    assert emulator.stats.requests == {"ws": requests["ws"] + 1, "http": requests["http"] + 1}
    if stream:
        assert_no_duplicates(reply)
    assert_pool_quiet(sidecar)


@STREAM
async def test_drop_after_lifecycle_events_before_output_is_replayed(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, stream: bool
) -> None:
    # response.created and response.in_progress were sent, then the socket dropped: they were held
    # back, so the app never saw them and the turn can still be replayed without duplicates.
    conv = await started(http, sidecar, emulator)
    before = replays("closed_before_first_event")
    emulator.faults.arm("drop", after_events=2)
    reply = await conv.send("next", stream=stream)
    conv.accept(reply)
    assert replays("closed_before_first_event") == before + 1
    if stream:
        assert_no_duplicates(reply)
        assert reply.types[:2] == ["response.created", "response.in_progress"]


@STREAM
async def test_second_close_before_first_event_surfaces(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, stream: bool
) -> None:
    conv = await started(http, sidecar, emulator)
    before = replays("closed_before_first_event")
    emulator.faults.arm("drop", after_events=0, count=2)
    reply = await conv.send("next", stream=stream)
    # Nothing reached the app, so even a stream gets a plain HTTP error it can retry.
    assert_openai_error(reply, 502, "upstream_closed")
    assert replays("closed_before_first_event") == before + 1  # one replay, never two
    assert emulator.stats.faults_fired == {"drop": 2}
    assert_pool_quiet(sidecar)
    conv.accept(await conv.send(None, stream=stream))  # the app's retry succeeds


# -- the socket closes after output reached the app: one error event, no replay --------------------


@pytest.mark.parametrize(
    ("kind", "close_code"),
    [("drop", 1006), ("close", 1001), ("close", 1009), ("close", 1011)],
    ids=["drop-1006", "close-1001", "close-1009", "close-1011"],
)
async def test_close_mid_stream_ends_sse_with_one_error_event(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, kind: str, close_code: int
) -> None:
    conv = await started(http, sidecar, emulator)
    before = replays("closed_before_first_event")
    requests = emulator.stats.requests["ws"]
    emulator.faults.arm(kind, after_events=MID_STREAM_EVENTS, close_code=close_code)
    reply = await conv.send("next", stream=True)
    assert_one_error_event(reply, "upstream_closed")
    assert reply.types[:MID_STREAM_EVENTS] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert emulator.stats.requests["ws"] == requests + 1, "replayed after output reached the app"
    assert replays("closed_before_first_event") == before
    failed_id = reply.events[0]["response"]["id"]
    assert failed_id not in head_response_ids(sidecar)
    assert_pool_quiet(sidecar)
    assert_heads_completed(sidecar, emulator)
    conv.items.pop()  # the app drops the failed turn and asks again
    conv.accept(await conv.send("next", stream=True))


@pytest.mark.parametrize(
    ("kind", "close_code"),
    [("drop", 1006), ("close", 1001), ("close", 1009), ("close", 1011)],
    ids=["drop-1006", "close-1001", "close-1009", "close-1011"],
)
async def test_close_mid_response_non_streaming_is_5xx(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, kind: str, close_code: int
) -> None:
    conv = await started(http, sidecar, emulator)
    requests = emulator.stats.requests["ws"]
    emulator.faults.arm(kind, after_events=MID_STREAM_EVENTS, close_code=close_code)
    reply = await conv.send("next")
    error = assert_openai_error(reply, 502, "upstream_closed")
    assert error["type"] == "server_error"
    assert emulator.stats.requests["ws"] == requests + 1
    assert_pool_quiet(sidecar)
    assert_heads_completed(sidecar, emulator)


async def test_sdk_raises_api_error_on_mid_stream_close(emulator: Emulator, sidecar: Sidecar) -> None:
    client = AsyncOpenAI(base_url=sidecar.base_url, api_key=KEY, max_retries=0)
    try:
        emulator.faults.arm("close", after_events=MID_STREAM_EVENTS, close_code=1011)
        stream = await client.responses.create(model=MODEL, input="hello", stream=True, store=False)
        seen: list[str] = []
        with pytest.raises(openai.APIError) as info:
            async for event in stream:
                seen.append(event.type)
        assert "response.output_text.delta" in seen and "response.completed" not in seen
        assert info.value.code == "upstream_closed"
        # Non-streaming: the SDK sees a 5xx it may retry.
        emulator.faults.arm("close", after_events=MID_STREAM_EVENTS, close_code=1011)
        with pytest.raises(openai.InternalServerError) as err:
            await client.responses.create(model=MODEL, input="hello", store=False)
        assert err.value.status_code == 502 and err.value.code == "upstream_closed"
    finally:
        await client.close()


async def test_response_failed_mid_stream_is_relayed_and_never_anchored(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar
) -> None:
    # The upstream's own terminal failure after output (pitfalls 1 and 6): relayed as it is, the
    # turn ends (no hang, no replay) and the failed response never becomes a head.
    conv = await started(http, sidecar, emulator)
    requests = emulator.stats.requests["ws"]
    emulator.faults.arm("fail", after_events=MID_STREAM_EVENTS)
    reply = await conv.send("next", stream=True)
    assert reply.status == 200 and reply.types[-1] == "response.failed", reply.types
    assert "response.output_text.delta" in reply.types and "error" not in reply.types
    assert_no_duplicates(reply)
    failed_id = reply.events[-1]["response"]["id"]
    assert emulator.record(failed_id)["status"] == "failed"  # type: ignore[index]
    assert emulator.stats.requests["ws"] == requests + 1
    assert failed_id not in head_response_ids(sidecar)
    assert_pool_quiet(sidecar)
    assert_heads_completed(sidecar, emulator)
    conv.items.pop()
    record = conv.accept(await conv.send("next", stream=True))
    assert record["continuation"] is False  # the anchor consumed by the failed turn is gone


async def test_response_failed_non_streaming_is_what_http_gives(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar
) -> None:
    emulator.faults.arm("fail", after_events=MID_STREAM_EVENTS, transport="http")
    direct = await post(http, emulator.base_url, {"model": MODEL, "input": "hi", "store": False})
    conv = await started(http, sidecar, emulator)
    emulator.faults.arm("fail", after_events=MID_STREAM_EVENTS, transport="ws")
    reply = await conv.send("next")
    assert_openai_error(reply, direct.status, "server_error")
    assert reply.json == direct.json
    assert head_response_ids(sidecar) == []


# -- previous_response_not_found, every shape -------------------------------------------------------


@STREAM
@pytest.mark.parametrize("shape", NOT_FOUND_SHAPES)
async def test_not_found_in_every_shape_is_replayed(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, shape: str, stream: bool
) -> None:
    conv = await started(http, sidecar, emulator)
    before = replays("previous_response_not_found")
    requests = emulator.stats.requests["ws"]
    emulator.faults.arm("miss", shape=shape, match={"previous_response_id_present": True})
    reply = await conv.send("next", stream=stream)
    record = conv.accept(reply)
    assert emulator.stats.faults_fired == {"miss": 1} and emulator.stats.misses["ws"] == 1
    assert replays("previous_response_not_found") == before + 1
    assert emulator.stats.requests["ws"] == requests + 2
    assert record["continuation"] is False  # the replay carried the full input, no anchor
    if stream:
        assert_no_duplicates(reply)
        assert "error" not in reply.types and "response.failed" not in reply.types
    assert (await conv.turn())["continuation"] is True  # the replay's response is the new head
    assert_pool_quiet(sidecar)


async def test_not_found_then_a_second_failure_surfaces(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar
) -> None:
    conv = await started(http, sidecar, emulator)
    before = replays("previous_response_not_found")
    emulator.faults.arm("miss", match={"previous_response_id_present": True})
    emulator.faults.arm("error", status=500, transport="ws", match={"previous_response_id_present": False})
    reply = await conv.send("next", stream=True)
    assert_openai_error(reply, 500, "server_error")
    assert replays("previous_response_not_found") == before + 1
    assert emulator.stats.faults_fired == {"miss": 1, "error": 1}


@STREAM
async def test_app_chained_unknown_previous_response_id_surfaces_with_its_code(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, stream: bool
) -> None:
    # The app chains itself: its own body would fail again, so no replay; the code name is kept.
    before = replays("previous_response_not_found")
    body = {"model": MODEL, "store": False, "input": [user("hi")], "previous_response_id": "resp_unknown"}
    reply = await post(http, sidecar.base_url, {**body, "stream": stream})
    error = assert_openai_error(reply, 400, "previous_response_not_found")
    assert error["param"] == "previous_response_id"
    assert replays("previous_response_not_found") == before
    assert emulator.stats.requests["ws"] == 1


# -- websocket_connection_limit_reached ---------------------------------------------------------


@STREAM
async def test_connection_limit_is_replayed_on_a_new_socket(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, sidecar_for: SidecarFor, stream: bool
) -> None:
    emu = await make_emulator(ws_max_age_s=0.5)
    sc = await sidecar_for(emu.base_url)
    conv = await started(http, sc, emu)
    before = replays("connection_limit")
    await asyncio.sleep(0.6)  # the sockets age out upstream; the sidecar's own rotation is 55 min
    reply = await conv.send("next", stream=stream)
    record = conv.accept(reply)
    assert replays("connection_limit") == before + 1
    assert record["continuation"] is False
    assert emu.stats.connections[record["connection_id"]].requests == 1  # a socket opened for the replay
    if stream:
        assert_no_duplicates(reply)
    assert_pool_quiet(sc)


async def test_connection_limit_twice_surfaces_as_an_error(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, sidecar_for: SidecarFor
) -> None:
    emu = await make_emulator(ws_max_age_s=0.0)  # every create on every socket hits the limit
    sc = await sidecar_for(emu.base_url)
    before = replays("connection_limit")
    reply = await post(http, sc.base_url, {"model": MODEL, "input": "hi", "store": False})
    assert_openai_error(reply, 400, "websocket_connection_limit_reached")
    assert replays("connection_limit") == before + 1
    assert emu.stats.requests["ws"] == 2
    assert_pool_quiet(sc)


# -- upstream error frames before any output ----------------------------------------------------

ERROR_CASES = {
    401: {},
    403: {},
    429: {"retry-after": "7", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "7s"},
    500: {},
    503: {"retry-after": "3"},
}


@STREAM
@pytest.mark.parametrize("status", list(ERROR_CASES))
async def test_error_frame_gives_what_http_would_give(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, status: int, stream: bool
) -> None:
    headers = ERROR_CASES[status]
    # The reference: the same fault answered over plain HTTP by the upstream itself.
    emulator.faults.arm("error", status=status, headers=headers, transport="http")
    direct = await post(http, emulator.base_url, {"model": MODEL, "input": "hi", "store": False, "stream": stream})
    assert direct.status == status
    conv = await started(http, sidecar, emulator)
    emulator.faults.arm("error", status=status, headers=headers, transport="ws")
    reply = await conv.send("next", stream=stream)
    assert_openai_error(reply, status)
    assert reply.json == direct.json
    for name, value in headers.items():
        assert reply.headers.get(name) == value, (name, dict(reply.headers))
    assert not any(h.lower().startswith("x-ratelimit") for h in reply.headers if h.lower() not in headers)
    assert_pool_quiet(sidecar)
    # A retry of the same body continues the conversation correctly.
    conv.accept(await conv.send(None, stream=stream))


async def test_sdk_sees_rate_limit_and_retries_through_it(emulator: Emulator, sidecar: Sidecar) -> None:
    strict = AsyncOpenAI(base_url=sidecar.base_url, api_key=KEY, max_retries=0)
    retrying = AsyncOpenAI(base_url=sidecar.base_url, api_key=KEY, max_retries=2)
    try:
        emulator.faults.arm("error", status=429, headers={"retry-after": "0"}, transport="ws")
        with pytest.raises(openai.RateLimitError) as info:
            await strict.responses.create(model=MODEL, input="hi", store=False)
        assert info.value.response.headers["retry-after"] == "0"
        assert info.value.code == "rate_limit_exceeded"
        emulator.faults.arm("error", status=429, headers={"retry-after": "0"}, transport="ws")
        response = await retrying.responses.create(model=MODEL, input="hi", store=False)
        assert response.status == "completed"
        assert emulator.stats.faults_fired == {"error": 2}
    finally:
        await strict.close()
        await retrying.close()


# -- the upgrade is refused ---------------------------------------------------------------------


@STREAM
@pytest.mark.parametrize("status", [401, 403, 429, 500, 503])
async def test_refused_upgrade_falls_back_to_http(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, status: int, stream: bool
) -> None:
    # handlers.py: no socket can be had → the request goes over plain HTTP (slower, never wrong).
    emulator.faults.arm("refuse_upgrade", status=status, headers={"retry-after": "1"})
    conv = Conversation(http, sidecar.base_url, emulator)
    reply = await conv.send("hello", stream=stream)
    record = conv.accept(reply)
    assert reply.mode == "passthrough"
    assert record["transport"] == "http"
    assert emulator.stats.ws_connections["refused"] == 1
    assert_pool_quiet(sidecar)
    # The refusal's retry-after (1 s) is honoured, then the next turn is back on WebSocket mode.
    reply = await conv.send("meanwhile", stream=stream)
    assert conv.accept(reply)["transport"] == "http" and reply.mode == "passthrough"
    await asyncio.sleep(1.05)
    reply = await conv.send("next", stream=stream)
    assert conv.accept(reply)["transport"] == "ws" and reply.mode == "full"


@STREAM
@pytest.mark.parametrize("status", [401, 403, 429, 500, 503])
async def test_refused_upgrade_and_refused_http_give_the_same_status(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, status: int, stream: bool
) -> None:
    headers = ERROR_CASES[status]
    emulator.faults.arm("error", status=status, headers=headers, transport="http")
    direct = await post(http, emulator.base_url, {"model": MODEL, "input": "hi", "stream": stream})
    emulator.faults.arm("refuse_upgrade", status=status, headers=headers)
    emulator.faults.arm("error", status=status, headers=headers, transport="http")
    reply = await post(http, sidecar.base_url, {"model": MODEL, "input": "hi", "stream": stream})
    assert_openai_error(reply, status)
    assert reply.json == direct.json
    for name, value in headers.items():
        assert reply.headers.get(name) == value, (name, dict(reply.headers))


async def test_bad_key_gets_the_upstreams_401(emulator: Emulator, sidecar: Sidecar) -> None:
    client = AsyncOpenAI(base_url=sidecar.base_url, api_key="sk-bad-0123456789abcdef", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError) as info:
            await client.responses.create(model=MODEL, input="hi")
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        assert "0123456789abcdef" not in info.value.message  # the upstream's own redaction survives
    finally:
        await client.close()
    assert sidecar.pool.count() == 0


@pytest.mark.parametrize("status", [401, 403, 429])
async def test_websocket_relay_refused_upgrade_keeps_its_status(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, status: int
) -> None:
    emulator.faults.arm("refuse_upgrade", status=status, match={"identity": identity_of(f"Bearer {KEY}")})
    url = sidecar.base_url.replace("http://", "ws://") + "/responses"
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        async with http.ws_connect(url, headers=auth(), timeout=aiohttp.ClientWSTimeout(ws_close=5)):
            pass
    assert info.value.status == status


# -- the upstream cannot be reached ---------------------------------------------------------------


def closed_port() -> int:
    """A port nothing listens on (and no connection of the suite can come to hold)."""
    return free_port()


@STREAM
@pytest.mark.parametrize("where", ["refused", "dns"])
async def test_unreachable_upstream_is_a_502(
    http: aiohttp.ClientSession, sidecar_for: SidecarFor, where: str, stream: bool
) -> None:
    upstream = f"http://127.0.0.1:{closed_port()}/v1" if where == "refused" else "http://upstream.invalid/v1"
    sc = await sidecar_for(upstream, timeouts={"connect_seconds": 3.0})
    t0 = time.monotonic()
    reply = await post(http, sc.base_url, {"model": MODEL, "input": "hi", "stream": stream}, timeout=20)
    assert time.monotonic() - t0 < 8.0, "no prompt answer"
    error = assert_openai_error(reply, 502, "upstream_unavailable")
    assert error["type"] == "server_error"
    assert sc.pool.count() == 0


# -- the upstream goes silent --------------------------------------------------------------------


@STREAM
async def test_upstream_slower_than_idle_timeout_before_output(
    http: aiohttp.ClientSession, emulator: Emulator, make_sidecar: SidecarFactory, stream: bool
) -> None:
    sc = await make_sidecar(timeouts={"stream_idle_seconds": 0.5})
    conv = await started(http, sc, emulator)
    anchor_connection = emulator.record(head_response_ids(sc)[0])["connection_id"]  # type: ignore[index]
    emulator.faults.arm("delay", seconds=2.0)
    t0 = time.monotonic()
    reply = await conv.send("next", stream=stream)
    assert time.monotonic() - t0 < 1.8
    assert_openai_error(reply, 504, "upstream_timeout")
    assert_pool_quiet(sc)
    # The socket with the unfinished response is closed, never handed to another request.
    assert await wait_for(lambda: not emulator.stats.connections[anchor_connection].open)
    assert head_response_ids(sc) == []
    record = conv.accept(await conv.send(None, stream=stream))
    assert record["connection_id"] != anchor_connection


async def test_upstream_stalls_mid_stream(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, sidecar_for: SidecarFor
) -> None:
    emu = await make_emulator(latency=LatencyModel(tokens_per_second=1.5))  # a delta every ~2.7 s
    sc = await sidecar_for(emu.base_url, timeouts={"stream_idle_seconds": 0.5})
    reply = await post(http, sc.base_url, {"model": MODEL, "input": "hi", "stream": True, "store": False})
    assert_one_error_event(reply, "upstream_timeout", output="response.output_item.added")
    assert_pool_quiet(sc)
    assert head_response_ids(sc) == []
    assert await wait_for(lambda: emu.stats.ws_connections["open"] == 0)  # closed, never reused
    reply = await post(http, sc.base_url, {"model": MODEL, "input": "hi", "store": False})
    assert_openai_error(reply, 504, "upstream_timeout")


# -- a frame the upstream finds too big ------------------------------------------------------------


async def test_real_1009_oversized_frame_goes_to_http_not_replayed(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, sidecar_for: SidecarFor
) -> None:
    emu = await make_emulator(ws_max_message_bytes=64 * 1024)  # the sidecar's own budget is 15 MiB
    sc = await sidecar_for(emu.base_url)
    body = {"model": MODEL, "store": False, "input": [user("x" * 100_000)]}
    direct = await post(http, emu.base_url, body)  # what plain HTTP gives (here: the upstream's 413)
    reply = await post(http, sc.base_url, body)
    assert emu.stats.ws_connections["opened"] == 1, "the same too-big frame was sent again"
    assert reply.mode == "passthrough"
    assert (reply.status, reply.raw) == (direct.status, direct.raw)
