"""The latency model: rebuild cost only for uncached context, output pacing, overhead before headers."""

from __future__ import annotations

import time

import pytest

from upshift_emulator import LatencyModel

from .conftest import ClientFactory, EmulatorFactory, final_response, read_turn

pytestmark = pytest.mark.timeout(30)

BIG = "x" * 3000  # ~3 KiB of canonical context


async def test_rebuild_paid_for_uncached_context_only(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(latency=LatencyModel(rebuild_ms_per_kb=100.0))
    client = sdk(emu)
    async with client.responses.connect() as conn:
        started = time.monotonic()
        await conn.response.create(model="gpt-6.1-sol", input=BIG, store=False)
        first = final_response(await read_turn(conn))
        cold = time.monotonic() - started
        started = time.monotonic()
        await conn.response.create(model="gpt-6.1-sol", input="small", store=False, previous_response_id=first["id"])
        second = final_response(await read_turn(conn))
        warm = time.monotonic() - started
    started = time.monotonic()
    history = [{"role": "user", "content": BIG}, *first["output"], {"role": "user", "content": "small"}]
    http = await client.responses.create(model="gpt-6.1-sol", input=history, store=False)
    full = time.monotonic() - started
    assert cold >= 0.28 and full >= 0.28
    assert warm < 0.15
    record = emu.record(second["id"])
    assert record is not None and record["cached_bytes"] > 3000
    assert emu.record(http.id)["context_digest"] == record["context_digest"]  # type: ignore[index]


async def test_tokens_per_second_and_overhead(make_emulator: EmulatorFactory, sdk: ClientFactory) -> None:
    emu = await make_emulator(latency=LatencyModel(tokens_per_second=2000.0, overhead_ms=100.0), reply_bytes=800)
    client = sdk(emu)
    started = time.monotonic()
    raw = await client.responses.with_raw_response.create(model="gpt-6.1-sol", input="pace me", stream=True)
    headers_at = time.monotonic() - started
    events = [event async for event in raw.parse()]
    total = time.monotonic() - started
    assert headers_at >= 0.1  # overhead is paid before the headers
    assert total >= 0.1 + 0.09  # ~200 output tokens at 2000 tokens/s
    assert events[-1].type == "response.completed"
