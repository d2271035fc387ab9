"""SIGTERM with streams in flight (docs/reliability.md §1): the sidecar runs as a real process.

While it drains, ``/readyz`` answers 503, the API listener refuses new connections, and every
in-flight response (streamed or not) completes with the right answer; then the upstream sockets
close with 1001 and the process exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import aiohttp
import orjson
import pytest

from tests.reliability.conftest import EmulatorFactory
from tests.reliability.helpers import MODEL, Reply, auth, check_answer, parse_sse, user, wait_for
from tests.sidecar import SidecarProcess
from upshift_emulator import LatencyModel

pytestmark = pytest.mark.timeout(90)


async def test_sigterm_lets_in_flight_streams_finish(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, spawn: Callable[..., SidecarProcess]
) -> None:
    # ~100 output tokens at 50 tokens/s: each response lasts about 2 s.
    emu = await make_emulator(latency=LatencyModel(tokens_per_second=50.0))
    sc = spawn(emu.base_url, env={"UPSHIFT_SHUTDOWN_GRACE_SECONDS": "15"})
    await sc.wait_ready(http)
    histories = {i: [user(f"drain {i} reply_bytes=400")] for i in range(4)}
    first_delta = asyncio.Event()
    finished: dict[int, float] = {}

    async def request(i: int) -> Reply:
        stream = i != 3  # three streams and one non-streaming request in flight
        body = {"model": MODEL, "store": False, "input": histories[i], "stream": stream}
        headers = {**auth(), "Content-Type": "application/json"}
        async with http.post(sc.base_url + "/responses", data=orjson.dumps(body), headers=headers) as resp:
            chunks = []
            async for chunk in resp.content.iter_any():
                chunks.append(chunk)
                if b"output_text.delta" in chunk:
                    first_delta.set()
            finished[i] = time.monotonic()
            return Reply(resp.status, resp.headers, b"".join(chunks))

    tasks = [asyncio.create_task(request(i)) for i in range(4)]
    await asyncio.wait_for(first_delta.wait(), 10)
    await asyncio.sleep(0.1)
    sc.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    # Draining: /readyz fails at once (the admin listener stays up) ...
    ready = 200
    while ready != 503 and time.monotonic() - signalled < 1.5:
        async with http.get(sc.admin + "/readyz") as probe:
            ready = probe.status
        await asyncio.sleep(0.02)
    assert ready == 503, "/readyz did not turn 503 while draining"
    not_ready_at = time.monotonic()
    # ... and the API listener takes no new connection.
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
            async with fresh.post(sc.base_url + "/responses", json={"model": MODEL, "input": "late"}, headers=auth()):
                pass
    assert all(not t.done() for t in tasks), "a response ended before the drain was observed"

    replies = await asyncio.wait_for(asyncio.gather(*tasks), 20)
    for i, reply in enumerate(replies):
        assert reply.status == 200, reply.raw[:300]
        if i == 3:
            check_answer(emu, orjson.loads(reply.raw), histories[i])
            continue
        types = [name for name, _ in parse_sse(reply.raw)]
        assert types[-1] == "response.completed" and "error" not in types, types[-3:]
        check_answer(emu, reply.response, histories[i])
    assert min(finished.values()) > not_ready_at, "the streams were not in flight during the drain"
    assert sc.proc.wait(15) == 0, sc.logs()
    # Upstream sockets were closed as "going away".
    assert await wait_for(lambda: emu.stats.ws_connections["open"] == 0), emu.stats.ws_connections
    codes = {c.close_code for c in emu.stats.connections.values()}
    assert codes == {1001}, codes


async def stream_through_a_short_grace(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, spawn: Callable[..., SidecarProcess]
) -> tuple[bytes, str, float, float, int]:
    """A ~5 s stream, SIGTERM after its first delta with a 1 s grace; returns (bytes received,
    client error name or "", seconds from SIGTERM to the end of the stream, to the exit, exit code)."""
    emu = await make_emulator(latency=LatencyModel(tokens_per_second=50.0))
    sc = spawn(emu.base_url, env={"UPSHIFT_SHUTDOWN_GRACE_SECONDS": "1"})
    await sc.wait_ready(http)
    body = {"model": MODEL, "store": False, "stream": True, "input": "a long story reply_bytes=1000"}
    data, error, signalled = b"", "", 0.0
    try:
        async with http.post(sc.base_url + "/responses", json=body, headers=auth()) as resp:
            async for chunk in resp.content.iter_any():
                data += chunk
                if not signalled and b"output_text.delta" in data:
                    sc.proc.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
    except aiohttp.ClientError as exc:
        error = type(exc).__name__
    ended = time.monotonic() - signalled
    code = await asyncio.to_thread(sc.proc.wait, 20)
    return data, error, ended, time.monotonic() - signalled, code


async def test_sigterm_drain_is_bounded_by_the_grace(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, spawn: Callable[..., SidecarProcess]
) -> None:
    data, error, ended, exited, code = await stream_through_a_short_grace(http, make_emulator, spawn)
    assert code == 0
    assert ended < 2.5, f"a stream outlived the 1 s grace by {ended - 1:.1f} s"
    assert exited < 4.5, f"the process exited {exited:.1f} s after SIGTERM (grace 1 s)"
    # Never a clean end of a cut stream: either an error event, or a visibly incomplete body.
    types = [name for name, _ in parse_sse(data.rsplit(b"\n\n", 1)[0] + b"\n\n")] if data else []
    assert "response.completed" not in types
    assert error or (types and types[-1] == "error"), (error, types[-3:])


async def test_stream_cut_by_the_grace_ends_with_an_error_event(
    http: aiohttp.ClientSession, make_emulator: EmulatorFactory, spawn: Callable[..., SidecarProcess]
) -> None:
    data, error, _, _, _ = await stream_through_a_short_grace(http, make_emulator, spawn)
    assert error == "", f"the stream was cut: {error}"
    events = [event for _, event in parse_sse(data)]
    assert events[-1]["type"] == "error" and set(events[-1]["error"]) == {"type", "code", "message", "param"}
