"""Backpressure before errors: a request the memory budget cannot take now waits with
its body unread; only one that waited longer than ``limits.memory_wait_seconds`` (429) or that
could never fit (503) is refused, with ``retry-after``, and nothing is read or forwarded. Every
exit path gives the reservation back (a disconnect while waiting, or mid-body)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from bench.clients import sdk_headers
from bench.memory import big_history
from bench.workload import body_fields
from tests.exposition import metric, scrape
from tests.memory.conftest import MIB, LimitedFactory, LimitedSidecar
from upshift_emulator import Emulator, context_digest

BUDGET = 96 * MIB
"""About 36 MiB for requests once the idle process and the slack are set aside."""


def _body(size: int, tag: str) -> bytes:
    return orjson.dumps({**body_fields(stream=False, light=True), "input": big_history(size, tag, 1)})


async def _start(limited: LimitedFactory, emulator: Emulator, **env: str) -> LimitedSidecar:
    side = limited(emulator.base_url, UPSHIFT_LIMITS_MEMORY_BYTES=str(BUDGET), **env)
    async with aiohttp.ClientSession() as session:
        await side.wait_ready(session)
    return side


async def _open(
    side: LimitedSidecar, length: int, first: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw ``POST`` that declares ``length`` bytes and sends only ``first`` of them."""
    host, port = side.api.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = "".join(f"{k}: {v}\r\n" for k, v in sdk_headers().items())
    writer.write(f"POST /v1/responses HTTP/1.1\r\nHost: {host}\r\n{head}Content-Length: {length}\r\n\r\n".encode())
    writer.write(first)
    await writer.drain()
    return reader, writer


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status_line = await reader.readline()
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = line.decode().partition(":")
        headers[key.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def _until(side: LimitedSidecar, name: str, value: float, **labels: str) -> str:
    for _ in range(400):
        text = await scrape(side.admin)
        if metric(text, name, **labels) == value:
            return text
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name}{labels} never reached {value}")


async def _until_at_least(side: LimitedSidecar, name: str, value: float, **labels: str) -> str:
    for _ in range(400):
        text = await scrape(side.admin)
        if metric(text, name, **labels) >= value:
            return text
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name}{labels} never reached {value}")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_a_request_that_can_never_fit_is_a_503_with_retry_after_and_nothing_read(
    emulator: Emulator, limited: LimitedFactory
) -> None:
    side = await _start(limited, emulator, UPSHIFT_LIMITS_MAX_BODY_BYTES=str(64 * MIB))
    reader, writer = await _open(side, 20 * MIB)  # 4 x 20 MB can never fit the budget
    status, headers, body = await _answer(reader)
    writer.close()
    assert status == 503 and int(headers["retry-after"]) >= 1, (status, headers)
    assert json.loads(body)["error"]["code"] == "memory_too_large"
    text = await scrape(side.admin)
    assert metric(text, "upshift_memory_refusals_total", reason="too_large") == 1
    assert sum(emulator.stats.requests.values()) == 0  # nothing was forwarded


async def test_a_request_waits_unread_then_429s_after_the_bound_and_every_exit_frees_memory(
    emulator: Emulator, limited: LimitedFactory, http: aiohttp.ClientSession
) -> None:
    side = await _start(limited, emulator, UPSHIFT_LIMITS_MEMORY_WAIT_SECONDS="1")
    # An app that declared 8 MB and sent all but 64 KB of them, then pauses: a body pays as it arrives
    # (the declared length alone reserves none of it), so this one holds its
    # whole share, 4 x 8 MB and its head. (It may pause for limits.body_grace_seconds, 5 s,
    # before the sidecar closes it: the steps below take about 2.)
    _, slow = await _open(side, 8 * MIB, b'{"input": [' + b" " * (8 * MIB - 64 * 1024))
    await _until_at_least(side, "upshift_memory_bytes", 8 * MIB * 4 + 128 * 1024, kind="in_flight")
    # A second request does not fit now: its body stays unread, /readyz stays green, then 429.
    body = _body(2 * MIB, "waiter")
    async with http.post(side.base_url + "/responses", data=body, headers=sdk_headers()) as resp:
        async with http.get(side.admin + "/readyz") as ready:
            assert ready.status == 200
        assert resp.status == 429, await resp.text()
        assert int(resp.headers["retry-after"]) >= 1
        assert (await resp.json())["error"]["code"] == "memory_busy"
    text = await scrape(side.admin)
    assert metric(text, "upshift_memory_refusals_total", reason="wait_timeout") == 1
    assert metric(text, "upshift_memory_waits_total") == 1
    # A third one gives up while waiting (the app disconnects): its place is given back. (Its
    # first megabyte is paid for at once now; it waits to grow past it.)
    reader, gone = await _open(side, 2 * MIB, b" " * (1200 * 1024))
    await _until(side, "upshift_memory_waiting_requests", 1)
    gone.close()
    await _until(side, "upshift_memory_waiting_requests", 0)
    # The slow app goes away mid-body: its reservation returns too.
    slow.close()
    await _until(side, "upshift_memory_bytes", 0, kind="in_flight")
    # And the retried request now goes through, the model seeing exactly its history.
    async with http.post(side.base_url + "/responses", data=body, headers=sdk_headers()) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    record = emulator.record(answer["id"])
    assert record is not None
    assert record["context_digest"] == context_digest(orjson.loads(body)["input"])


async def test_a_chunked_body_reserves_as_it_is_read(
    emulator: Emulator, limited: LimitedFactory, http: aiohttp.ClientSession
) -> None:
    side = await _start(limited, emulator)
    body = _body(3 * MIB, "chunked")

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 256 * 1024):
            yield body[i : i + 256 * 1024]

    async with http.post(side.base_url + "/responses", data=chunks(), headers=sdk_headers()) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    record = emulator.record(answer["id"])
    assert record is not None and record["context_digest"] == context_digest(orjson.loads(body)["input"])
    await _until(side, "upshift_memory_bytes", 0, kind="in_flight")


async def test_a_body_over_the_derived_size_limit_is_still_a_413(emulator: Emulator, limited: LimitedFactory) -> None:
    side = await _start(limited, emulator)  # max_body_bytes derived: the largest body that fits
    reader, writer = await _open(side, 50 * MIB)
    status, _, body = await _answer(reader)
    writer.close()
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large", (status, body)
    assert metric(await scrape(side.admin), "upshift_memory_refusals_total", reason="too_large") == 0
