"""``POST /v1/responses`` end to end: real sockets, the emulator upstream, the real openai SDK.

Continuations, every recovery path (each through the emulator's fault hooks), input errors,
identity separation, busy heads, app disconnects, the access log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI

from bench.ports import free_ports
from proxy.observe.metrics import REGISTRY
from proxy.upstream.pool import SocketUse
from tests.conftest import SidecarFactory
from tests.sidecar import Sidecar
from upshift_emulator import NOT_FOUND_SHAPES, Emulator, LatencyModel

KEY = "sk-test"


def client(sidecar: Sidecar, key: str = KEY) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=sidecar.base_url, api_key=key, max_retries=0)


async def chat(c: AsyncOpenAI, turns: int, *, first: str = "hello", **kwargs: Any) -> tuple[list[Any], list[str]]:
    """Run a full-history conversation; returns (history, modes per turn)."""
    history: list[Any] = [{"role": "user", "content": first}]
    modes = []
    for turn in range(turns):
        raw = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input=history, **kwargs)
        modes.append(raw.headers["x-upshift-mode"])
        response = raw.parse()
        assert response.status == "completed"
        assert response.previous_response_id is None  # the app sent none; never the sidecar's
        history += [item.model_dump(exclude_none=True) for item in response.output]
        history.append({"role": "user", "content": f"next {turn}"})
    return history, modes


def used_sockets(emulator: Emulator) -> int:
    """Upstream sockets that carried at least one request (spares opened ahead do not count)."""
    return sum(1 for c in emulator.stats.connections.values() if c.requests)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_three_turn_continuation(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    _, modes = await chat(client(sidecar), 3)
    assert modes == ["full", "continuation", "continuation"]
    stats = emulator.stats
    assert stats.requests == {"http": 0, "ws": 3}
    assert stats.continuations["ws"] == 2 and stats.cache_hits == 2 and stats.misses["ws"] == 0
    assert used_sockets(emulator) == 1
    frames = [c.bytes_received for c in stats.connections.values()]
    assert sum(frames) < 1500  # deltas only: the history is never resent
    assert sidecar.pool.count(SocketUse.BUSY) == 0


@pytest.mark.parametrize("shape", NOT_FOUND_SHAPES)
async def test_not_found_in_every_shape_is_replayed_invisibly(stack: tuple[Emulator, Sidecar], shape: str) -> None:
    emulator, sidecar = stack
    c = client(sidecar)
    history, _ = await chat(c, 1)
    before = metric("upshift_replays_total", cause="previous_response_not_found")
    emulator.faults.arm("miss", shape=shape)
    raw = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input=history)
    response = raw.parse()
    assert response.status == "completed" and response.output_text
    assert raw.headers["x-upshift-mode"] == "full"
    assert emulator.stats.faults_fired == {"miss": 1}
    assert metric("upshift_replays_total", cause="previous_response_not_found") == before + 1
    # the replay carried the app's whole input: the emulator's oracle saw every item
    record = emulator.record(response.id)
    assert record is not None
    assert used_sockets(emulator) == 1  # same socket is fine for not_found


async def test_not_found_replay_streams_cleanly(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    c = client(sidecar)
    history, _ = await chat(c, 1)
    emulator.faults.arm("miss", shape="response_failed")
    stream = await c.responses.create(model="gpt-6.1-sol", input=history, stream=True)
    types = [event.type async for event in stream]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.failed" not in types and "error" not in types


async def test_connection_limit_replays_on_a_new_socket(make_sidecar: SidecarFactory) -> None:
    async with Emulator(ws_max_age_s=0.5) as emulator:
        sidecar = Sidecar(emulator.base_url)
        async with sidecar:
            c = client(sidecar)
            history, _ = await chat(c, 1)
            await asyncio.sleep(0.6)
            raw = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input=history)
            assert raw.parse().status == "completed"
            assert raw.headers["x-upshift-mode"] == "full"
            assert used_sockets(emulator) == 2
            assert sidecar.pool.count(SocketUse.BUSY) == 0


async def test_drop_before_first_event_replays(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    c = client(sidecar)
    history, _ = await chat(c, 1)
    emulator.faults.arm("drop", after_events=0)
    before = metric("upshift_replays_total", cause="closed_before_first_event")
    response = await c.responses.create(model="gpt-6.1-sol", input=history)
    assert response.status == "completed"
    assert metric("upshift_replays_total", cause="closed_before_first_event") == before + 1
    assert used_sockets(emulator) == 2
    assert sidecar.pool.count(SocketUse.BUSY) == 0


async def test_a_replay_is_tried_once(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    emulator.faults.arm("drop", after_events=0, count=2)
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-6.1-sol", "input": "hi"}
        async with http.post(sidecar.base_url + "/responses", json=body, headers=auth()) as resp:
            assert resp.status == 502
            error = (await resp.json())["error"]
            assert error["code"] == "upstream_closed"
    assert sidecar.pool.count() == 0


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'"just a string"', 400, None),
        (b'{"model": "gpt-6.1-sol", "input": 5}', 400, "input"),
        (b'{"model": "gpt-6.1-sol", "input": "x", "stream": "yes"}', 400, "stream"),
        (b'{"model": "gpt-6.1-sol", "input": "\xff\xfe"}', 400, None),
        (b'{"model": "gpt-6.1-sol", "input": "' + b"x" * 2000 + b'"}', 413, None),
    ],
    ids=["malformed", "array", "string", "input-type", "stream-type", "invalid-utf8", "too-large"],
)
async def test_bad_input_is_refused_and_nothing_is_forwarded(
    emulator: Emulator, make_sidecar: SidecarFactory, body: bytes, status: int, param: str | None
) -> None:
    sidecar = await make_sidecar(limits={"max_body_bytes": 1000})
    async with aiohttp.ClientSession() as http:
        headers = {**auth(), "Content-Type": "application/json"}
        async with http.post(sidecar.base_url + "/responses", data=body, headers=headers) as resp:
            assert resp.status == status
            assert resp.headers["x-request-id"].startswith("req_")
            error = (await resp.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and error["param"] == param
    assert emulator.stats.requests == {"http": 0, "ws": 0}
    assert emulator.stats.ws_connections["opened"] == 0


async def test_chunked_body_over_the_limit_is_refused_while_reading(
    emulator: Emulator, make_sidecar: SidecarFactory
) -> None:
    sidecar = await make_sidecar(limits={"max_body_bytes": 1000})

    async def chunks() -> Any:
        for _ in range(100):
            yield b"x" * 100

    async with aiohttp.ClientSession() as http:
        async with http.post(sidecar.base_url + "/responses", data=chunks(), headers=auth()) as resp:
            assert resp.status == 413
    assert emulator.stats.requests == {"http": 0, "ws": 0}


async def test_second_request_for_a_busy_head_goes_full_on_another_lane(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    c = client(sidecar)
    history, _ = await chat(c, 1)
    emulator.faults.arm("delay", seconds=0.3)
    first = asyncio.ensure_future(c.responses.with_raw_response.create(model="gpt-6.1-sol", input=history))
    await asyncio.sleep(0.1)
    second = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input=history)
    assert second.headers["x-upshift-mode"] == "full"
    assert (await first).headers["x-upshift-mode"] == "continuation"
    # Both ran at once, the second on a socket of its own: the first socket had not proven its
    # lanes yet, and such a socket never carries a second response.
    assert used_sockets(emulator) == 2
    assert max(c.max_in_flight for c in emulator.stats.connections.values()) == 1
    assert sidecar.pool.count(SocketUse.BUSY) == 0


async def test_identities_never_share_sockets_or_heads(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    alice, bob = client(sidecar, "sk-alice"), client(sidecar, "sk-bob")
    history, _ = await chat(alice, 1)
    # Bob sends Alice's exact history: no continuation of Alice's head, Bob's own socket.
    raw = await bob.responses.with_raw_response.create(model="gpt-6.1-sol", input=history)
    assert raw.headers["x-upshift-mode"] == "full"
    assert used_sockets(emulator) == 2
    assert emulator.stats.continuations["ws"] == 0


async def test_app_chained_previous_response_id_goes_to_its_socket(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    c = client(sidecar)
    first = await c.responses.create(model="gpt-6.1-sol", input="hello", store=False)
    other = await client(sidecar).responses.with_raw_response.create(
        model="gpt-6.1-sol", input="more", previous_response_id=first.id, store=False
    )
    response = other.parse()
    assert response.previous_response_id == first.id  # the app's own id, relayed as is
    assert emulator.stats.cache_hits == 1  # on the socket that holds it (store=false would miss elsewhere)


async def test_generate_is_never_sent_over_http(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-6.1-sol", "input": "hi", "generate": False}
        async with http.post(sidecar.base_url + "/responses", json=body, headers=auth()) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "generate"
    assert emulator.stats.requests == {"http": 0, "ws": 0}


@pytest.mark.parametrize("status", [403, 426, 500])
async def test_refused_upgrade_falls_back_to_http(stack: tuple[Emulator, Sidecar], status: int) -> None:
    emulator, sidecar = stack
    emulator.faults.arm("refuse_upgrade", status=status)
    c = client(sidecar)
    raw = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input="hi")
    assert raw.headers["x-upshift-mode"] == "passthrough"
    assert raw.parse().status == "completed"
    # 426 means "use HTTP" and 403 a refused key: the identity stays on HTTP for a while;
    # a bare 500 (transient) pins nothing.
    raw = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input="hi")
    assert raw.headers["x-upshift-mode"] == ("full" if status == 500 else "passthrough")


async def test_mode_http_never_opens_a_socket(emulator: Emulator, make_sidecar: SidecarFactory) -> None:
    sidecar = await make_sidecar(mode="http")
    _, modes = await chat(client(sidecar), 2)
    assert modes == ["passthrough", "passthrough"]
    assert emulator.stats.ws_connections["opened"] == 0


async def test_a_full_socket_shares_its_lanes(emulator: Emulator, make_sidecar: SidecarFactory) -> None:
    sidecar = await make_sidecar(pool={"max_sockets_per_identity": 1})
    c = client(sidecar)
    await c.responses.create(model="gpt-6.1-sol", input="zero")  # the default lane
    await c.responses.create(model="gpt-6.1-sol", input="probe")  # the idle socket's first named lane: lanes proven
    emulator.faults.arm("delay", seconds=0.3)
    first = asyncio.ensure_future(c.responses.with_raw_response.create(model="gpt-6.1-sol", input="one"))
    await asyncio.sleep(0.1)
    second = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input="two")
    assert second.headers["x-upshift-mode"] == "full"  # on a named lane of the same socket
    assert (await first).headers["x-upshift-mode"] == "full"
    assert used_sockets(emulator) == 1
    (conn,) = emulator.stats.connections.values()
    assert conn.named_streams == 3 and conn.max_in_flight == 2


async def test_pool_limit_falls_back_to_http(emulator: Emulator, make_sidecar: SidecarFactory) -> None:
    sidecar = await make_sidecar(pool={"max_sockets_per_identity": 1, "lanes_per_socket": 1, "wait_seconds": 0})
    emulator.faults.arm("delay", seconds=0.3)
    c = client(sidecar)
    first = asyncio.ensure_future(c.responses.with_raw_response.create(model="gpt-6.1-sol", input="one"))
    await asyncio.sleep(0.1)
    second = await c.responses.with_raw_response.create(model="gpt-6.1-sol", input="two")
    assert second.headers["x-upshift-mode"] == "passthrough"
    assert (await first).headers["x-upshift-mode"] == "full"


async def test_app_disconnect_mid_stream_leaves_the_pool_consistent(stack: tuple[Emulator, Sidecar]) -> None:
    emulator, sidecar = stack
    emulator.state.latency = LatencyModel(tokens_per_second=200)
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-6.1-sol", "input": "tell me a long story", "stream": True}
        resp = await http.post(sidecar.base_url + "/responses", json=body, headers=auth())
        await resp.content.readuntil(b"response.output_text.delta")
        resp.close()  # the app goes away mid-stream
    for _ in range(100):  # the sidecar drains the response to its end, then frees the socket
        await asyncio.sleep(0.05)
        if sidecar.pool.count(SocketUse.BUSY) == 0:
            break
    assert sidecar.pool.count(SocketUse.BUSY) == 0
    assert emulator.stats.responses["completed"] == 1
    emulator.state.latency = LatencyModel()
    _, modes = await chat(client(sidecar), 1)
    assert modes == ["full"]
    # The drained socket is idle again and keeps its (completed) head, so the new conversation
    # got a lane of its own (on that socket) rather than evicting that head.
    assert sidecar.pool.count(SocketUse.BUSY) == 0 and len(sidecar.heads) == 2
    assert used_sockets(emulator) == 1
    assert metric("upshift_inflight_requests") == 0


async def test_access_log_line(stack: tuple[Emulator, Sidecar], caplog: pytest.LogCaptureFixture) -> None:
    _, sidecar = stack
    caplog.set_level(logging.INFO, logger="upshift.access")
    await chat(client(sidecar), 2)
    lines = [r for r in caplog.records if r.name == "upshift.access"]
    assert len(lines) == 2
    fields = vars(lines[1])
    assert fields["mode"] == "continuation" and fields["status"] == 200 and fields["items_in"] == 3
    assert fields["items_sent"] == 1 and fields["request_id"].startswith("req_")
    for key in ("bytes_in", "bytes_sent", "upstream_ms", "added_ms", "reason", "route"):
        assert key in fields
    assert KEY not in orjson.dumps({k: str(v) for k, v in fields.items()}).decode()


async def test_drain_lets_in_flight_streams_finish(emulator: Emulator) -> None:
    emulator.state.latency = LatencyModel(tokens_per_second=150)
    sidecar = await Sidecar(emulator.base_url, shutdown={"grace_seconds": 5.0}).start()
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-6.1-sol", "input": "a story", "stream": True}
        resp = await http.post(sidecar.base_url + "/responses", json=body, headers=auth())
        await resp.content.readuntil(b"response.output_text.delta")
        stopping = asyncio.ensure_future(sidecar.stop())
        await asyncio.sleep(0.05)
        async with http.get(sidecar.admin_url + "/readyz") as ready:
            assert ready.status == 503  # draining: no new work is routed here
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.post(sidecar.base_url + "/responses", json=body, headers=auth())
        rest = await resp.read()
        assert rest.rstrip().split(b"\n")[-1].startswith(b'data: {"type":"response.completed"')
        await stopping
    await asyncio.sleep(0.05)
    assert [c.close_code for c in emulator.stats.connections.values()] == [1001]


async def test_run_serves_until_sigterm_and_exits_0(emulator: Emulator) -> None:
    ports = free_ports(2)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        "--listen",
        f"127.0.0.1:{ports[0]}",
        "--admin-listen",
        f"127.0.0.1:{ports[1]}",
        "--upstream",
        emulator.base_url,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "UPSHIFT_SHUTDOWN_GRACE_SECONDS": "2"},
    )
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                try:
                    async with http.get(f"http://127.0.0.1:{ports[1]}/readyz") as ready:
                        if ready.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
            sc = AsyncOpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key=KEY, max_retries=0)
            assert (await sc.responses.create(model="gpt-6.1-sol", input="hi")).status == "completed"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
