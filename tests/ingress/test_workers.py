"""``--workers 3``: one address, three processes, one admin listener; conversations keep their
chain although SO_REUSEPORT spreads their connections over the workers."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Callable

import aiohttp
import orjson
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.clients.support import MODEL
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator, LatencyModel

from .support import (
    HEADERS,
    STEPS,
    assert_fidelity,
    continued,
    direct,
    free_ports,
    summary,
    task_text,
    tool_loop,
    wait_ready,
)

CONVERSATIONS = 200


async def start_workers(
    spawn: Callable[..., SidecarProcess], upstream: str, count: int = 3, env: dict[str, str] | None = None
) -> SidecarProcess:
    api, admin = free_ports(2)
    # 200 concurrent conversations of one key need 200 sockets between the workers (and the
    # default 64 per worker would not do for one process holding them all either).
    env = {"UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY": "256", **(env or {})}
    listen = ("--listen", f"127.0.0.1:{api}", "--admin-listen", f"127.0.0.1:{admin}")
    proc = spawn(upstream, "--workers", str(count), *listen, env=env)
    proc.api, proc.admin = f"http://127.0.0.1:{api}", f"http://127.0.0.1:{admin}"
    async with aiohttp.ClientSession() as session:
        await wait_ready(proc, session)
    return proc


Samples = dict[str, list[tuple[dict[str, str], float]]]


async def metrics(proc: SidecarProcess, session: aiohttp.ClientSession) -> Samples:
    async with session.get(proc.admin + "/metrics") as resp:
        text = await resp.text()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


async def test_three_workers_keep_two_hundred_conversations_continuing(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    proc = await start_workers(spawn, emulator.base_url)
    tasks = [task_text(STEPS, f"worker-conv-{i}") for i in range(CONVERSATIONS)]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        convs = await asyncio.gather(*(tool_loop(session, [proc.api], t) for t in tasks))
        want = await direct(emulator, session, tasks)
        seen = await metrics(proc, session)
        for conv, ref in zip(convs, want, strict=True):
            assert summary(conv) == summary(ref)  # every answer correct
            assert_fidelity(emulator, conv)  # oracle fidelity 100%
        later_turns = sum(len(c.response_ids) - 1 for c in convs)
        assert later_turns == CONVERSATIONS * STEPS
        hits = sum(continued(emulator, c) for c in convs)
        assert hits >= 0.95 * later_turns, (hits, later_turns)
        # every worker carried traffic, and requests reached the owning worker
        served = Counter()
        for labels, value in seen["upshift_requests_total"]:
            if labels["route"] == "responses" and labels["mode"] != "forwarded":
                served[labels["worker"]] += value
        assert set(served) == {"0", "1", "2"} and all(v > 0 for v in served.values()), served
        assert sum(served.values()) == CONVERSATIONS * (STEPS + 1)
        # requests reached their owner: forwarded as bytes, or their connection handed over
        forwarded = sum(v for labels, v in seen.get("upshift_forwards_total", []) if labels["outcome"] == "ok")
        handed = sum(v for labels, v in seen.get("upshift_handoffs_total", []) if labels["outcome"] == "adopted")
        assert forwarded + handed > 0
    assert await proc.terminate() == 0


async def test_a_dead_worker_is_restarted(emulator: Emulator, spawn: Callable[..., SidecarProcess]) -> None:
    proc = await start_workers(spawn, emulator.base_url, count=2)
    victim = psutil.Process(proc.proc.pid).children()[0]
    victim.send_signal(signal.SIGKILL)
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            children = psutil.Process(proc.proc.pid).children()
            if len(children) == 2 and victim.pid not in {c.pid for c in children}:
                break
            await asyncio.sleep(0.05)
        await wait_ready(proc, session)
        conv = await tool_loop(session, [proc.api], task_text(2, "after restart"))
        assert conv.modes[0] == "full" and conv.modes[1:] == ["continuation"] * 2, conv.modes
        seen = await metrics(proc, session)
        assert seen["upshift_worker_restarts_total"] == [({}, 1.0)]
        async with session.get(proc.admin + "/healthz") as resp:
            assert resp.status == 200 and (await resp.json())["workers_alive"] == 2
    assert await proc.terminate() == 0


async def test_sigterm_drains_every_worker(spawn: Callable[..., SidecarProcess]) -> None:
    """Streams in flight through the workers (some forwarded between them) finish after SIGTERM;
    /readyz fails at once; the supervisor exits 0 once all workers have."""
    async with Emulator(latency=LatencyModel(tokens_per_second=50.0)) as emu:  # ~2 s per response
        proc = await start_workers(spawn, emu.base_url, count=2)
        started = asyncio.Event()
        arrived = 0

        async def stream(i: int) -> bytes:
            nonlocal arrived
            body = {"model": MODEL, "input": f"drain {i} reply_bytes=400", "stream": True}
            async with aiohttp.ClientSession() as own:  # own connection: spread over the workers
                async with own.post(proc.base_url + "/responses", data=orjson.dumps(body), headers=HEADERS) as resp:
                    assert resp.status == 200
                    chunks: list[bytes] = []
                    counted = False
                    async for chunk in resp.content.iter_any():
                        chunks.append(chunk)
                        if not counted and b"output_text.delta" in chunk:
                            counted = True
                            arrived += 1
                            if arrived == 8:
                                started.set()
                    return b"".join(chunks)

        tasks = [asyncio.create_task(stream(i)) for i in range(8)]
        await asyncio.wait_for(started.wait(), 15)
        proc.proc.send_signal(signal.SIGTERM)
        async with aiohttp.ClientSession() as session:
            ready = 200
            for _ in range(50):
                async with session.get(proc.admin + "/readyz") as resp:
                    ready = resp.status
                if ready == 503:
                    break
                await asyncio.sleep(0.02)
            assert ready == 503
        assert not all(t.done() for t in tasks)
        for raw in await asyncio.gather(*tasks):
            events = [e.splitlines()[0] for e in raw.decode().split("\n\n") if e]
            assert events[-1] == "event: response.completed" and "event: error" not in events
        assert await proc.wait(30) == 0, proc.logs()
