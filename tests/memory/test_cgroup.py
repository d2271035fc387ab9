"""The sidecar in a real memory cgroup: with the default settings its budget is derived
from the cgroup's limit, and a load that would take several times the limit is served in full
without an OOM kill. The control run (the same harness, the budget set far above the limit)
is OOM-killed: the harness does catch a sidecar that outgrows its container."""

from __future__ import annotations

import aiohttp
import pytest

from bench.memory import conversation_load
from proxy.core.sizing import CGROUP_FRACTION
from tests.exposition import metric, scrape
from tests.memory.conftest import MIB, Cgroup, LimitedFactory
from tests.memory.test_load import assert_settles, run_load
from upshift_emulator import Emulator

LIMIT = 160 * MIB


@pytest.mark.timeout(300)
async def test_the_default_budget_follows_the_cgroup_limit_and_holds(
    emulator: Emulator, limited: LimitedFactory, cgroup: Cgroup
) -> None:
    cgroup.set_limit(LIMIT)
    side = limited(emulator.base_url, cgroup=cgroup)  # no limits.memory_bytes: derived
    async with aiohttp.ClientSession() as session:
        await side.wait_ready(session)
    idle = side.rss()
    text = await scrape(side.admin)
    budget = metric(text, "upshift_memory_budget_bytes")
    assert budget == int(LIMIT * CGROUP_FRACTION)
    await run_load(emulator, side, 16, 3.0, 2)  # ~50 MB of histories in flight: ~3x the limit's room
    assert side.proc.poll() is None and cgroup.oom_kills() == 0, side.logs()[-2000:]
    assert side.high_water() <= budget, f"peak RSS {side.high_water() / MIB:.1f} MiB"
    assert metric(await scrape(side.admin), "upshift_memory_waits_total") > 0
    await assert_settles(side, idle)


@pytest.mark.timeout(300)
async def test_the_harness_catches_a_sidecar_that_outgrows_its_limit(
    emulator: Emulator, limited: LimitedFactory, cgroup: Cgroup
) -> None:
    cgroup.set_limit(LIMIT)
    side = limited(emulator.base_url, cgroup=cgroup, UPSHIFT_LIMITS_MEMORY_BYTES=str(8192 * MIB))
    async with aiohttp.ClientSession() as session:
        await side.wait_ready(session)
    try:
        result = await conversation_load(side.base_url, 24, 4 * MIB, 1, digest=False)
    except aiohttp.ClientError:
        result = None
    await side.wait(20)
    assert side.proc.returncode == -9 and cgroup.oom_kills() >= 1, (side.proc.returncode, result)
