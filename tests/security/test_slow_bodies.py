"""One connection must not stall every request. A head that declares the largest body and
sends nothing, or a body trickled at 1 byte/s, would hold memory forever if its
``Content-Length`` were reserved before a byte was read (every other key would get ``429
memory_busy``). A body pays as it arrives, admission is fair and never blocked by a larger
waiter, and a body that does not keep arriving gets 408 and is closed. A client gone mid-body
is one INFO line and a counter, never an ERROR traceback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import aiohttp
import orjson
import pytest

from proxy.config import Settings
from tests.exposition import metric
from tests.loops import LOOP_KINDS, loop_runner
from tests.security.ingress import (
    ALICE,
    MALLORY,
    Spawn,
    answer,
    body,
    body_limit,
    metrics,
    openai_error,
    raw_head,
    started,
)
from tests.sidecar import Sidecar
from upshift_emulator import Emulator, context_digest

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024
BUDGET = 256 * MIB
DEADLINE = 8.0
"""limits.body_timeout_seconds for the attack test, for speed: with the default (120 s) the
trickle and the first stalled head are closed after the 5 s grace just the same (minimum rate,
silence), the two heads whose admission waits behind the first one's promise are admitted in
turn and closed 5 s after each, ~15 s in all; 8 s bounds them all."""


async def _until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the sidecar sends until it closes the connection."""
    data = b""
    async with asyncio.timeout(timeout):
        try:
            while chunk := await reader.read(65536):
                data += chunk
        except ConnectionError:  # closed with the trickle's unread byte in its buffers: a reset
            pass
    return data


async def test_stalled_and_trickled_bodies_hold_nothing_and_are_closed_at_the_deadline(
    emulator: Emulator, spawn: Spawn
) -> None:
    side = await started(
        spawn,
        emulator.base_url,
        UPSHIFT_LIMITS_MEMORY_BYTES=str(BUDGET),
        UPSHIFT_LIMITS_BODY_TIMEOUT_SECONDS=str(DEADLINE),
    )
    # The largest body the sidecar accepts (derived from the budget): a 413 names it.
    reader, writer = await raw_head(side, 1 << 40)
    status, _, data = await answer(reader)
    writer.close()
    assert status == 413
    largest = body_limit(data)
    assert largest >= 16 * MIB

    # The attack: three heads declaring the largest body and sending none, one trickle.
    opened = time.monotonic()
    stalled = [await raw_head(side, largest) for _ in range(3)]
    trickle_reader, trickle_writer = await raw_head(side, largest, first=b"{")

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            while not trickle_writer.is_closing():
                await asyncio.sleep(1.0)
                trickle_writer.write(b" ")
                await trickle_writer.drain()

    trickler = asyncio.ensure_future(trickle())
    await asyncio.sleep(0.5)
    held = metric(await metrics(side), "upshift_memory_bytes", kind="in_flight")
    # A promise reserves nothing: one step each (4 x 1 MiB + 128 KiB + its head) at most.
    assert held <= 4 * (4 * MIB + 512 * 1024), held / MIB

    # 20 small requests from another key each complete in well under 5 s, all at once ...
    async with aiohttp.ClientSession() as http:

        async def small(i: int) -> tuple[int, float]:
            t0 = time.monotonic()
            async with http.post(
                side.base_url + "/responses",
                data=body(f"small {i}"),
                headers={"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"},
            ) as resp:
                await resp.read()
                return resp.status, time.monotonic() - t0

        results = await asyncio.gather(*(small(i) for i in range(20)))
        assert [s for s, _ in results] == [200] * 20, results
        slowest = max(t for _, t in results)
        assert slowest < 5.0, results
        # ... and so does a large one (3 MB) of a third key: it pays as it arrives too.
        history = [{"role": "user", "content": "x" * (3 * MIB)}]
        large = orjson.dumps({"model": "gpt-6.1-sol", "input": history, "store": False})
        async with http.post(
            side.base_url + "/responses", data=large, headers={"Authorization": "Bearer sk-bob-security-000111"}
        ) as resp:
            assert resp.status == 200, await resp.text()
            record = emulator.record((await resp.json())["id"])
        assert record is not None and record["context_digest"] == context_digest(history)

    # Every stalled connection is closed within the configured deadline: 408 when it was being
    # read; one still waiting for admission may get 503 memory_too_large first (the conversation
    # heads of the small requests take memory too: the largest body can no longer fit).
    closed_after, timed_out = [], 0
    for r, _ in [*stalled, (trickle_reader, trickle_writer)]:
        data = await _until_closed(r, max(DEADLINE + 5.0 - (time.monotonic() - opened), 0.5))
        closed_after.append(time.monotonic() - opened)
        if data:
            status = int(data.split(b" ", 2)[1])
            assert status in (408, 503), data[:200]
            code = "request_timeout" if status == 408 else "memory_too_large"
            openai_error(data.partition(b"\r\n\r\n")[2], code)
            timed_out += status == 408
    trickler.cancel()
    for _, w in stalled:
        w.close()
    trickle_writer.close()
    assert max(closed_after) <= DEADLINE + 2.0, closed_after
    text = await metrics(side)
    aborted = sum(metric(text, "upshift_request_bodies_aborted_total", reason=r) for r in ("too_slow", "timeout"))
    assert aborted >= timed_out >= 1, text
    assert metric(text, "upshift_memory_refusals_total", reason="wait_timeout") == 0
    assert await _settled(side)
    logs = side.logs()
    assert "Traceback" not in logs and '"level":"error"' not in logs, logs[-2000:]
    print(f"\nslowest small request {slowest:.3f} s; stalled connections closed after {closed_after} s")


async def _settled(side: object) -> bool:
    for _ in range(100):
        if metric(await metrics(side), "upshift_memory_bytes", kind="in_flight") == 0:  # type: ignore[arg-type]
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_body_within_the_minimum_rate_and_the_deadline_is_served(emulator: Emulator, spawn: Spawn) -> None:
    # The control: a slow but steady app (its body in pieces over about 2 s) is not cut.
    side = await started(spawn, emulator.base_url)
    payload = body("steady " + "y" * 60_000)
    reader, writer = await raw_head(side, len(payload), key=ALICE)
    for i in range(0, len(payload), len(payload) // 8 + 1):
        writer.write(payload[i : i + len(payload) // 8 + 1])
        await writer.drain()
        await asyncio.sleep(0.25)
    status, _, data = await answer(reader)
    writer.close()
    assert status == 200, data[:300]
    assert orjson.loads(data)["status"] == "completed"


async def test_a_client_gone_mid_body_is_one_info_line_and_a_counter(emulator: Emulator, spawn: Spawn) -> None:
    side = await started(spawn, emulator.base_url)
    for _ in range(3):
        _, writer = await raw_head(side, 100_000, key=ALICE, first=b'{"model": "gpt-6.1-sol", ')
        await asyncio.sleep(0.1)
        writer.close()
    for _ in range(100):
        if metric(await metrics(side), "upshift_request_bodies_aborted_total", reason="client_gone") == 3:
            break
        await asyncio.sleep(0.05)
    assert metric(await metrics(side), "upshift_request_bodies_aborted_total", reason="client_gone") == 3
    for _ in range(100):  # the log is written off the event loop: let it catch up
        logs = side.logs()
        lines = [line for line in logs.splitlines() if "before its request body was complete" in line]
        if len(lines) >= 3:
            break
        await asyncio.sleep(0.05)
    assert len(lines) == 3 and all('"level":"info"' in line for line in lines), lines
    assert "Traceback" not in logs and '"level":"error"' not in logs, logs[-2000:]
    # The control: the next request is served.
    async with aiohttp.ClientSession() as http:
        async with http.post(
            side.base_url + "/responses", data=body(), headers={"Authorization": f"Bearer {MALLORY}"}
        ) as resp:
            assert resp.status == 200


async def test_a_stalled_upload_on_another_route_gets_408_at_the_deadline(emulator: Emulator, spawn: Spawn) -> None:
    """Bodies relayed as they arrive (``/v1/files`` uploads, any other ``/v1`` route) have the
    same deadline: a stalled one no longer holds an HTTP relay slot for the upstream's timeout."""
    side = await started(spawn, emulator.base_url, UPSHIFT_LIMITS_BODY_TIMEOUT_SECONDS="3")
    name, port = side.api.removeprefix("http://").rsplit(":", 1)
    form = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n--b\r\n'
        b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"a": 1}\n'
    )
    reader, writer = await asyncio.open_connection(name, int(port))
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: {name}:{port}\r\nAuthorization: Bearer {MALLORY}\r\n"
        f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {len(form) + 1000}\r\n\r\n"
    )
    opened = time.monotonic()
    writer.write(head.encode() + form)  # ... and the rest never comes
    await writer.drain()
    data = await _until_closed(reader, 20)
    waited = time.monotonic() - opened
    writer.close()
    assert data.startswith(b"HTTP/1.1 408"), data[:300]
    assert b"request_timeout" in data
    assert waited < 3 + 5, waited  # the deadline (3 s), not the upstream's timeout
    # The control: a whole upload is relayed and answered.
    async with aiohttp.ClientSession() as http:
        upload = aiohttp.FormData()
        upload.add_field("purpose", "assistants")
        upload.add_field("file", b'{"a": 1}\n', filename="a.jsonl")
        async with http.post(
            side.base_url + "/files", data=upload, headers={"Authorization": f"Bearer {MALLORY}"}
        ) as resp:
            assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("loop_kind", LOOP_KINDS)
def test_a_body_that_arrived_while_the_sidecars_own_loop_stalled_is_not_late(loop_kind: str) -> None:
    """The app is judged by when its bytes arrived, not by when the sidecar got round to reading
    them: with the sidecar's own loop stalled past the body grace (a long GC pause, a blocked
    CPU), the rest of the body arrives 1 s into the stall. When the loop wakes, the grace timer is
    overdue and the bytes are unread: in the socket still (uvloop runs due timers before it
    polls), or read but not yet taken by the handler (asyncio). A 408 then would blame the app
    for the sidecar's stall. Under both event loops the sidecar runs on."""
    with loop_runner(loop_kind) as loop:
        status, data = loop.run(_stalled_sidecar())
    assert status == 200, data[:300]
    assert orjson.loads(data.partition(b"\r\n\r\n")[2])["status"] == "completed"


async def _stalled_sidecar() -> tuple[int, bytes]:
    grace = Settings().limits.body_grace_seconds  # the default a user has (5 s)
    async with Emulator() as emu, Sidecar(emu.base_url) as sc:
        # Larger than one read of the socket: the handler takes it in several chunks.
        payload = orjson.dumps({"model": "gpt-6.1-sol", "input": "x" * MIB, "store": False})
        head = (
            f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{sc.port}\r\nAuthorization: Bearer {ALICE}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        app = socket.create_connection(("127.0.0.1", sc.port))
        try:
            app.sendall(head.encode() + payload[:1])
            await asyncio.sleep(0.5)  # the sidecar reads the head: the body's clock runs
            rest = threading.Timer(1.0, app.sendall, args=(payload[1:],))  # the app is on time
            rest.start()
            time.sleep(grace + 1.5)  # the sidecar's loop (this one) stalls past the grace
            app.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=app)
            data = await _until_closed(reader, 15)
            writer.close()
            await asyncio.to_thread(rest.join)
        finally:
            app.close()
    return int(data.split(b" ", 2)[1]), data
