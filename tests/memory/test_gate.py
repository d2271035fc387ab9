"""The memory gate (proxy/intake/memory.py): the budget's size, one buffer per body, leases that wait."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from proxy.config import LimitsSettings, Settings
from proxy.core.budget import AMPLIFICATION, HEADER_ROOM, MIN_RESERVATION, STEP, Derived, derive
from proxy.core.conversation import HeadTable
from proxy.errors import BodyTimeout
from proxy.intake.body import BodyBuffer
from proxy.intake.memory import (
    Lease,
    MemoryBusy,
    MemoryGate,
    MemoryTooLarge,
    cgroup_memory_limit,
    effective_settings,
)

MIB = 1024 * 1024


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_of_the_own_cgroup_and_its_parents(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1/sidecar\n")
    root = tmp_path / "fs"
    _write(root / "kubepods/pod1/sidecar/memory.max", "max\n")
    _write(root / "kubepods/pod1/memory.max", f"{256 * MIB}\n")
    _write(root / "kubepods/memory.max", f"{1024 * MIB}\n")
    assert cgroup_memory_limit(str(root), str(proc)) == 256 * MIB
    _write(root / "kubepods/pod1/memory.max", "max\n")
    _write(root / "kubepods/memory.max", "max\n")
    assert cgroup_memory_limit(str(root), str(proc)) is None


def test_cgroup_v1_limit_and_its_no_limit_number(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    _write(proc, "9:name=systemd:/\n4:memory:/docker/abc\n0::/\n")
    root = tmp_path / "fs"
    _write(root / "memory/docker/abc/memory.limit_in_bytes", f"{192 * MIB}\n")
    _write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert cgroup_memory_limit(str(root), str(proc)) == 192 * MIB
    # In a container (cgroup namespace) the own cgroup is the mount's root.
    _write(proc, "4:memory:/\n")
    _write(root / "memory/memory.limit_in_bytes", f"{128 * MIB}\n")
    assert cgroup_memory_limit(str(root), str(proc)) == 128 * MIB
    assert cgroup_memory_limit(str(tmp_path / "nothing"), str(tmp_path / "none")) is None


def test_effective_settings_derive_the_size_limits_from_the_budget() -> None:
    settings, derived = effective_settings(Settings(limits=LimitsSettings(memory_bytes=256 * MIB)), baseline=45 * MIB)
    assert derived == derive(256 * MIB, 45 * MIB)
    assert settings.limits.memory_bytes == 256 * MIB
    assert settings.limits.max_body_bytes == derived.max_body_bytes
    assert derived.max_body_bytes * AMPLIFICATION + MIN_RESERVATION + HEADER_ROOM <= derived.capacity
    assert settings.matching.hot_prefix_bytes == derived.capacity // 2
    explicit = Settings(limits=LimitsSettings(memory_bytes=256 * MIB, max_body_bytes=1000))
    assert effective_settings(explicit, baseline=45 * MIB)[0].limits.max_body_bytes == 1000


@pytest.mark.parametrize("length", [0, 1, 1000, 64 * 1024, 3 * MIB + 7])
def test_a_body_buffer_holds_exactly_the_bytes_written(length: int) -> None:
    data = bytes(i % 251 for i in range(length))
    buffer = BodyBuffer(length)
    for i in range(0, length, 65_000):
        buffer.write(data[i : i + 65_000])
    assert buffer.full and buffer.missing == 0
    body = buffer.value()
    assert type(body) is bytes and body == data and hash(body) == hash(data)
    with pytest.raises(ValueError):
        BodyBuffer(4).value()
    with pytest.raises(ValueError):
        BodyBuffer(2).write(b"abc")


def _gate(capacity: int, wait: float = 30.0, heads: HeadTable | None = None) -> MemoryGate:
    prefixes = heads.prefixes if heads is not None else None
    return MemoryGate(Derived(capacity * 2, capacity, capacity, capacity), prefixes, heads=heads, wait_seconds=wait)


async def _taken(gate: MemoryGate, length: int) -> Lease:
    """A lease whose ``length``-byte body has all arrived (it holds its whole need)."""
    lease = gate.lease(length)
    await lease.__aenter__()
    await lease.arrived(length)
    return lease


async def test_a_lease_pays_as_its_body_arrives_and_small_ones_never_wait_behind_large() -> None:
    # Entering a lease reserves its first step, not 4 x the declared length.
    gate = _gate(10 * MIB)
    first = gate.lease(2 * MIB)
    async with first:
        assert first.held == STEP * AMPLIFICATION + MIN_RESERVATION
        await first.arrived(2 * MIB)
        assert first.held == 2 * MIB * AMPLIFICATION + MIN_RESERVATION
        order: list[str] = []

        async def later(name: str, size: int) -> None:
            async with gate.lease(size):
                order.append(name)

        big = asyncio.ensure_future(later("b", 1 * MIB))
        while gate.budget.waiting < 1:
            await asyncio.sleep(0)
        await later("c", 1)  # fits: granted at once, past the waiting "b" (no head-of-line blocking)
        assert order == ["c"]
        first.read(2 * MIB)
        first.sent()  # the frame is gone: only the body stays
        assert first.held == 2 * MIB + MIN_RESERVATION
        await big
    assert order == ["c", "b"]
    assert gate.budget.in_flight == 0 and gate.budget.idle


async def test_a_lease_that_waits_too_long_is_a_429_and_gives_its_place_back() -> None:
    gate = _gate(10 * MIB, wait=0.05)
    taken = await _taken(gate, 2 * MIB)
    with pytest.raises(MemoryBusy) as busy:
        async with gate.lease(1 * MIB):
            raise AssertionError("granted while the budget is taken")
    assert busy.value.status == 429 and busy.value.headers("req_1")["retry-after"] == "1"
    assert gate.budget.waiting == 0
    await taken.__aexit__(None, None, None)
    assert gate.budget.in_flight == 0


async def test_a_lease_too_large_for_an_empty_budget_is_a_503_at_once() -> None:
    gate = _gate(10 * MIB)
    with pytest.raises(MemoryTooLarge) as refused:
        async with gate.lease(3 * MIB):
            raise AssertionError("granted")
    assert refused.value.status == 503 and int(refused.value.headers("req_1")["retry-after"]) >= 1
    assert gate.budget.in_flight == 0


async def test_a_waiting_lease_cancelled_by_a_disconnect_is_released() -> None:
    gate = _gate(10 * MIB)
    taken = await _taken(gate, 2 * MIB)
    waiter = asyncio.ensure_future(gate.lease(1 * MIB).__aenter__())
    while gate.budget.waiting == 0:
        await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.budget.waiting == 0
    await taken.__aexit__(None, None, None)
    assert gate.budget.in_flight == 0 and gate.budget.idle


async def test_an_admission_wait_ends_at_the_body_deadline_with_a_408() -> None:
    gate = _gate(10 * MIB)
    taken = await _taken(gate, 2 * MIB)
    deadline = asyncio.get_running_loop().time() + 0.05
    with pytest.raises(BodyTimeout) as late:
        async with gate.lease(1 * MIB, deadline=deadline):
            raise AssertionError("granted while the budget is taken")
    assert late.value.status == 408 and gate.budget.waiting == 0
    await taken.__aexit__(None, None, None)


async def test_a_growth_that_waits_too_long_is_a_429() -> None:
    gate = _gate(10 * MIB, wait=0.05)
    async with gate.lease(2 * MIB) as growing:
        taken = await _taken(gate, 1 * MIB)  # 4 MiB more: 4 + 4 + ... the growth cannot fit
        with pytest.raises(MemoryBusy):
            await growing.arrived(2 * MIB)
        assert gate.budget.waiting == 0
        await taken.__aexit__(None, None, None)
        await growing.arrived(2 * MIB)  # now it fits
        assert growing.held == 2 * MIB * AMPLIFICATION + MIN_RESERVATION
    assert gate.budget.in_flight == 0


async def test_a_chunked_lease_grows_as_it_reads() -> None:
    gate = _gate(10 * MIB)
    async with gate.lease(None) as lease:
        await lease.arrived(MIB)
        assert lease.held >= AMPLIFICATION * MIB
        await lease.arrived(2 * MIB)
        assert lease.held >= AMPLIFICATION * 2 * MIB
        lease.read(2 * MIB + 5)  # the step paid ahead of a body of unknown size is given back
        assert lease.held == AMPLIFICATION * (2 * MIB + 5) + MIN_RESERVATION
    assert gate.budget.in_flight == 0 and gate.budget.tickets == 0


def _record(heads: HeadTable, index: int) -> None:
    body = orjson.dumps(
        {"model": "gpt-6.1-sol", "input": [{"role": "user", "content": f"conversation {index} " + "x" * 200_000}]}
    )
    req = heads.parse("ident", body)
    response = {"id": f"resp_{index}", "output": [{"type": "message", "role": "assistant", "content": []}]}
    heads.record("ident", ("socket", index), req, response, 0.0)


async def test_kept_bodies_draw_from_the_budget_and_give_way_to_requests() -> None:
    heads = HeadTable(max_heads=10, ttl_seconds=1e9)
    gate = _gate(2 * MIB, heads=heads)
    _record(heads, 0)
    _record(heads, 1)
    hot = [heads.prefixes.raw(("socket", i)) for i in range(2)]
    assert all(r is not None and r.body is not None for r in hot)
    assert gate.budget.kept == sum(len(r.body) for r in hot if r is not None and r.body is not None)
    async with gate.lease(400_000):  # needs the memory: the oldest kept body goes first
        assert hot[0] is not None and hot[0].body is None
        assert hot[1] is not None and hot[1].body is not None
    heads.discard(("socket", 1))
    assert gate.budget.kept == 0


async def test_a_whole_frame_pays_for_its_masked_copy_until_it_is_sent() -> None:
    # One frame per message (no fragments) holds ~2.5x its size while it is masked
    # and written; the lease pays half a frame more than AMPLIFICATION until it is sent.
    gate = _gate(64 * MIB)
    async with gate.lease(8 * MIB) as lease:
        await lease.arrived(8 * MIB)
        lease.read(8 * MIB)
        body = lease.held
        await lease.whole_frame(8 * MIB + 100)
        assert lease.held == body + (8 * MIB + 100) // 2
        lease.sent()
        assert lease.held == 8 * MIB + MIN_RESERVATION
    async with gate.lease(1000) as small:  # a small frame needs nothing more
        await small.arrived(1000)
        before = small.held
        await small.whole_frame(1200)
        assert small.held == before
    assert gate.budget.in_flight == 0


async def test_memory_goes_back_to_the_os_only_after_the_gate_stayed_idle() -> None:
    # malloc_trim walks the whole heap: under steady load (short idle gaps between requests) the
    # memory is about to be used again, so it is handed back only once the load stops.
    gate = _gate(10 * MIB)
    loop = asyncio.get_running_loop()
    until = loop.time() + 0.8  # more than three trim delays of requests 50 ms apart
    while loop.time() < until:
        async with gate.lease(64 * 1024) as lease:
            await lease.arrived(64 * 1024)
        await asyncio.sleep(0.05)
    assert gate.trims == 0
    await asyncio.sleep(0.4)  # the load stopped: one trim, a trim delay later
    assert gate.trims == 1 and gate.budget.idle
