"""A body's promise is backed by evidence. A keyless head that declares the body limit and
trickles its body at ~20 KiB/s (above ``limits.body_min_bytes_per_second``, so no body deadline
closes it early) must not make every other tenant's body over one budget step wait for memory:
a reading body counts against others only as far as its observed rate can deliver it before its
deadline, and keyless requests share one small quota. With the sidecar's defaults, as a user
starts it, a few such heads of decreasing sizes must not fill the promise space of the whole
budget (2-8 MiB bodies of another key would wait ``limits.memory_wait_seconds`` for a 429)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import aiohttp
import orjson
import pytest

from tests.security.ingress import Spawn, answer, body_limit, raw_request, started
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator, context_digest

pytestmark = pytest.mark.timeout(180)

MIB = 1024 * 1024
SIZES = (2 * MIB, 4 * MIB, 8 * MIB)
RATE = 20 * 1024
NORMAL = 6.0
"""Seconds a victim's body may take over its own unhindered time (a busy 2-core CI machine);
a body held back by the promises waits ``limits.memory_wait_seconds`` (30 s) for a 429."""


async def _largest(side: SidecarProcess) -> int:
    name, port = side.api.removeprefix("http://").rsplit(":", 1)
    reader, writer = await raw_request(name, int(port), f"{name}:{port}", length=1 << 40, key="")
    status, _, data = await answer(reader)
    writer.close()
    assert status == 413
    return body_limit(data)


def _keyless_hog(side: SidecarProcess, length: int, stop: threading.Event, answers: list[bytes]) -> None:
    """A ``POST /v1/responses`` with no credential at all that declares ``length`` body bytes and
    trickles it at 20 KiB/s on average (above the minimum rate), in a thread of its own so the
    test's busy loop cannot slow it down; whatever the sidecar answers is put in ``answers``."""
    name, port = side.api.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((name, int(port))) as sock:
        head = f"POST /v1/responses HTTP/1.1\r\nHost: {name}:{port}\r\nContent-Length: {length}\r\n\r\n"
        sock.sendall(head.encode() + b'{"model":"gpt-6.1-sol","input":"')
        sock.settimeout(0.1)
        began, sent = time.monotonic(), 0
        while not stop.is_set():
            due = int((time.monotonic() - began) * RATE) - sent
            try:
                if due > 0:
                    sock.sendall(b"x" * due)
                    sent += due
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError as exc:
                answers.append(repr(exc).encode())
                return
            answers.append(data or b"closed")
            return


async def _victim(http: aiohttp.ClientSession, side: SidecarProcess, size: int, key: str) -> tuple[int, float]:
    history = [{"role": "user", "content": "y" * size}]
    data = orjson.dumps({"model": "gpt-6.1-sol", "input": history, "store": False})
    t0 = time.monotonic()
    try:
        async with http.post(
            side.base_url + "/responses",
            data=data,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=20),
        ) as resp:
            text = await resp.read()
            status = resp.status
    except TimeoutError:
        return 0, time.monotonic() - t0
    if status == 200:
        assert orjson.loads(text)["status"] == "completed"
    return status, time.monotonic() - t0


async def test_a_keyless_trickle_at_the_limit_holds_back_no_tenants_large_body(
    emulator: Emulator, spawn: Spawn
) -> None:
    side = await started(spawn, emulator.base_url)  # the defaults: the memory budget as users get it
    largest = await _largest(side)
    async with aiohttp.ClientSession() as http:
        # The control: each size alone, unhindered.
        alone = {}
        for size in SIZES:
            status, took = await _victim(http, side, size, "sk-victim-control")
            assert status == 200
            alone[size] = took

        # The attack: keyless heads declaring the limit (three), then halves of it down to one
        # budget step, each trickling; with promises counted at their declared need they fill the
        # budget's whole promise space.
        lengths = [largest] * 3 + [largest >> k for k in range(1, 8) if largest >> k >= MIB]
        stop, answers = threading.Event(), list[bytes]()
        hogs = [threading.Thread(target=_keyless_hog, args=(side, n, stop, answers)) for n in lengths]
        for hog in hogs:
            hog.start()
        try:
            await asyncio.sleep(1.5)
            served = {size: await _victim(http, side, size, f"sk-victim-{size}") for size in SIZES}
            # The attack was live throughout: no hog was answered or closed meanwhile.
            live = len(hogs) - len(answers)
        finally:
            stop.set()
            for hog in hogs:
                await asyncio.to_thread(hog.join, 5)
    print(f"\nbody limit {largest}; alone {alone}; during {len(hogs)} keyless trickles {served}")
    for size, (status, took) in served.items():
        assert status == 200, (size, status, took)  # 0: no answer in 20 s (waiting for memory)
        assert took <= alone[size] + NORMAL, (size, took, alone[size])
    assert live == len(hogs), answers


async def test_a_keyless_body_alone_still_gets_its_large_body_through(emulator: Emulator, spawn: Spawn) -> None:
    # The control of the keyless quota: an app behind an injected key that sends no
    # placeholder at all is one keyless tenant; a large body of it alone is served.
    env = {"UPSHIFT_API_KEY_SOURCE": "env", "UPSHIFT_API_KEY_ENV": "INJ", "INJ": "sk-injected-0123456789"}
    side = await started(spawn, emulator.base_url, **env)
    history = [{"role": "user", "content": "z" * (12 * MIB)}]
    async with aiohttp.ClientSession() as http:
        async with http.post(
            side.base_url + "/responses",
            data=orjson.dumps({"model": "gpt-6.1-sol", "input": history, "store": False}),
            headers={"Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 200, await resp.text()
            record = emulator.record((await resp.json())["id"])
    assert record is not None and record["context_digest"] == context_digest(history)
