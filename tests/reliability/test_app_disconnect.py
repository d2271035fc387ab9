"""The app goes away mid-response (docs/reliability.md §1, pitfall 20).

Afterwards the upstream response was either drained to its end (socket and chain kept) or its
socket closed (head dropped); no socket stays busy, no head points at an unfinished response, the
in-flight gauge is back to where it was, and no asyncio task is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import aiohttp
import orjson
import pytest

from tests.reliability.conftest import SidecarFor, ThreadedEmulatorFactory
from tests.reliability.helpers import (
    MODEL,
    Conversation,
    assert_heads_completed,
    assert_pool_quiet,
    auth,
    leaked_tasks,
    metric,
    wait_for,
)
from upshift_emulator import LatencyModel

pytestmark = pytest.mark.timeout(60)

SLOW = LatencyModel(tokens_per_second=400.0)
"""A 800-byte reply takes about half a second: long enough to hang up in the middle."""


async def hang_up_after(url: str, body: dict[str, object], events: int) -> int:
    """Stream ``body`` on a connection of its own and close it after ``events`` SSE events."""
    seen = 0
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        resp = await session.post(url, data=orjson.dumps(body), headers={**auth(), "Content-Type": "application/json"})
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                seen += 1
                if seen >= events:
                    break
        resp.close()  # drop the TCP connection mid-stream
    return seen


async def give_up_after(url: str, body: dict[str, object], seconds: float) -> None:
    """A non-streaming request the app abandons before the answer."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        with contextlib.suppress(TimeoutError):
            async with session.post(
                url,
                data=orjson.dumps(body),
                headers={**auth(), "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=seconds),
            ) as resp:
                await resp.read()


async def test_app_disconnects_leave_nothing_behind(
    http: aiohttp.ClientSession,
    threaded_emulator: ThreadedEmulatorFactory,
    sidecar_for: SidecarFor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emu = threaded_emulator(latency=SLOW)
    sc = await sidecar_for(emu.base_url)
    warm = Conversation(http, sc.base_url, emu, name="warm")
    await warm.turn()
    await asyncio.sleep(0.2)
    baseline = set(asyncio.all_tasks())
    inflight = metric("upshift_inflight_requests")
    url = sc.base_url + "/responses"
    rng = random.Random(7)
    streams = [
        hang_up_after(url, {"model": MODEL, "store": False, "stream": True, "input": f"story {i} reply_bytes=800"},
                      rng.randint(1, 12))
        for i in range(12)
    ]  # fmt: skip
    waits = [
        give_up_after(url, {"model": MODEL, "store": False, "input": f"wait {i} reply_bytes=800"}, 0.1)
        for i in range(3)
    ]
    with caplog.at_level(logging.ERROR, logger="proxy"):
        await asyncio.gather(*streams, *waits)
        # Everything the app abandoned is drained or closed within the response time.
        assert await wait_for(lambda: metric("upshift_inflight_requests") == inflight, timeout=10), "requests stuck"
    # A hang-up is the app's doing, not a bug of ours: answers that settle after the app left
    # (``stream: false``) are dropped quietly, not logged as unhandled errors.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert_pool_quiet(sc)
    assert_heads_completed(sc, emu)
    assert await wait_for(lambda: all(not c.in_flight for c in emu.stats.connections.values() if c.open), 5)
    # Every open upstream socket is one the pool knows (none orphaned).
    assert emu.stats.ws_connections["open"] == sc.pool.count()
    assert await leaked_tasks(baseline, open_sockets=sc.pool.count()) == []
    # The conversation that was not abandoned goes on, and new ones work.
    await warm.turn()
    await Conversation(http, sc.base_url, emu, name="after").turn(stream=True)
