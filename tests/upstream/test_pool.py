"""The pool as executor, against the emulator: plans become open sockets and leased lanes.

The decisions themselves are tested without sockets in tests/core/test_planner.py; here the
I/O around them: handshakes, leases that end on every path, draining, gauges, close codes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from bench.ports import free_port
from proxy.config import PoolSettings, Settings, TimeoutSettings
from proxy.core.conversation import HeadTable
from proxy.core.plans import Full, Http, Plan, Ready
from proxy.core.request import build_frame, parse_request
from proxy.core.waiting import Send, Waiting
from proxy.intake.identity import Identity, identify
from proxy.observe.metrics import REGISTRY
from proxy.upstream.pool import Pool, SocketUse, Turn
from upshift_emulator import Emulator, LatencyModel

PoolFactory = Callable[..., Pool]


def who(key: str, upstream: str) -> Identity:
    return identify({"Authorization": f"Bearer {key}"}, upstream=upstream, authorization=f"Bearer {key}")


def req(text: str) -> Any:
    return parse_request(orjson.dumps({"model": "gpt-6.1-sol", "input": [{"role": "user", "content": text}]}))


@pytest.fixture
async def make_pool(emulator: Emulator) -> AsyncIterator[PoolFactory]:
    pools: list[Pool] = []

    def make(**pool: Any) -> Pool:
        settings = Settings(upstream=emulator.base_url, pool=PoolSettings(**pool))
        created = Pool(settings, HeadTable(max_heads=100, ttl_seconds=3600))
        created.start()
        pools.append(created)
        return created

    yield make
    for created in pools:
        await created.close()


async def run(turn: Turn, r: Any, plan: Plan) -> dict[str, Any]:
    """One response on the leased lane, to its terminal event; the lane's head is recorded."""
    await turn.send(build_frame(r, stream_id=plan.stream_id))
    while True:
        _, event = await turn.recv(5)
        assert "stream_id" not in event  # the app never sees the lane
        if event["type"] == "response.completed":
            turn.finish(req=r, response=event["response"])
            return dict(event["response"])


def gauge(name: str, state: str) -> float:
    return REGISTRY.get_sample_value(name, {"state": state}) or 0.0


async def test_two_conversations_share_one_socket_in_parallel_once_its_lanes_are_proven(
    emulator: Emulator, make_pool: PoolFactory
) -> None:
    emulator.state.latency = LatencyModel(ttft_ms=100)
    pool = make_pool(max_sockets_per_identity=1, wait_seconds=0.05)

    async def one(plan: Plan, text: str) -> dict[str, Any]:
        async with pool.lease(plan) as turn:
            return await run(turn, req(text), plan)

    alice = who("sk-a", emulator.base_url)
    a, _ = await pool.plan(alice, req("a"))
    busy, _ = await pool.plan(alice, req("not while a runs"))
    assert a.lane == (1, None) and type(busy) is Http  # unproven: one response at a time
    await one(a, "a")
    b, _ = await pool.plan(alice, req("b"))
    assert b.lane == (1, "u1")  # the probe: the socket is idle, its first named lane
    await one(b, "b")
    assert pool.planner.sockets()[0].demux.proven  # the stream_id came back on its events
    (c, _), (d, _) = await pool.plan(alice, req("c")), await pool.plan(alice, req("d"))
    assert (c.lane, d.lane) == ((1, "u2"), (1, "u3"))
    done = await asyncio.gather(one(c, "c"), one(d, "d"))
    assert all(r["status"] == "completed" for r in done)
    assert emulator.stats.ws_connections["opened"] == 1
    (conn,) = emulator.stats.connections.values()
    assert conn.max_in_flight == 2 and conn.named_streams == 3
    assert pool.count(SocketUse.IDLE) == 1 and len(pool.heads) == 4


def worth_waiting(pool: Pool, who: Identity, size: int) -> None:
    """What the pool has measured for ``who``: a lane stays busy for a second and saves ten
    against plain HTTP, so a turn without a lane waits for one, for seconds (the waiting rule's
    inputs; the emulator's responses here take a few milliseconds)."""
    estimates = pool.planner.estimates
    estimates.observe_upstream(who.digest, Send.HTTP_FULL, size, 10.0)
    estimates.observe_upstream(who.digest, Send.FULL, size, 0.05)
    estimates.observe_busy(who.digest, 1.0)


async def queue_up(pool: Pool, *turns: tuple[Identity, str]) -> list[asyncio.Task[tuple[Ready, Waiting]]]:
    """Each turn asks for a lane, in this order (the first is the longest-waiting)."""
    tasks = []
    for one, text in turns:
        tasks.append(asyncio.create_task(pool.plan(one, req(text))))
        await asyncio.sleep(0)  # it has planned, and waits
    return tasks


async def test_a_freed_lane_wakes_the_longest_waiting_turn_not_every_turn(
    emulator: Emulator, make_pool: PoolFactory
) -> None:
    emulator.state.latency = LatencyModel(ttft_ms=20)
    pool = make_pool(max_sockets_per_identity=1, lanes_per_socket=1, wait_seconds=30)
    alice = who("sk-a", emulator.base_url)
    worth_waiting(pool, alice, len(req("w0").body))
    first, _ = await pool.plan(alice, req("first"))
    served: list[int] = []

    async def waiter(i: int) -> None:
        plan, waiting = await pool.plan(alice, req(f"w{i}"))
        assert type(plan) is Full and waiting.seconds > 0  # it waited, then had the lane
        served.append(i)
        async with pool.lease(plan) as turn:
            await run(turn, req(f"w{i}"), plan)

    tasks = []
    for i in range(8):
        tasks.append(asyncio.create_task(waiter(i)))
        await asyncio.sleep(0)  # each asks (and begins to wait) in turn
    async with pool.lease(first) as turn:
        await run(turn, req("first"), first)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert served == list(range(8))  # the longest-waiting first
    # One plan per freed lane: waking every waiting turn at each turn's end would plan
    # 8 + 7 + ... + 1 = 36 times again.
    assert pool.replans <= 10


async def test_a_turn_woken_for_a_lane_it_cannot_use_hands_the_wake_on(
    emulator: Emulator, make_pool: PoolFactory
) -> None:
    emulator.state.latency = LatencyModel(ttft_ms=20)
    pool = make_pool(max_sockets_per_identity=1, lanes_per_socket=1, wait_seconds=5)
    alice, bob = who("sk-a", emulator.base_url), who("sk-b", emulator.base_url)
    for one in (alice, bob):
        worth_waiting(pool, one, len(req("x").body))
    bobs, _ = await pool.plan(bob, req("bob's long turn"))
    alices, _ = await pool.plan(alice, req("alice's turn"))
    bob_waits, alice_waits = await queue_up(pool, (bob, "bob waits"), (alice, "alice waits"))
    async with pool.lease(alices) as turn:
        await run(turn, req("alice's turn"), alices)
    # Bob's turn is woken first and cannot use Alice's lane: it hands the wake on at once,
    # so Alice's turn does not sit out its deadline (1.5 s away) with her lane free.
    plan, waiting = await asyncio.wait_for(alice_waits, 3)
    assert type(plan) is Full and plan.lane == alices.lane and waiting.seconds < 0.5
    assert not bob_waits.done()
    async with pool.lease(bobs) as turn:
        await run(turn, req("bob's long turn"), bobs)
    later, _ = await asyncio.wait_for(bob_waits, 3)
    assert type(later) is Full and later.lane == bobs.lane
    for taken in (plan, later):
        pool.planner.finished(taken.lane, 0.0)


async def test_a_turn_gone_while_woken_hands_the_wake_on(emulator: Emulator, make_pool: PoolFactory) -> None:
    emulator.state.latency = LatencyModel(ttft_ms=20)
    pool = make_pool(max_sockets_per_identity=1, lanes_per_socket=1, wait_seconds=5)
    alice = who("sk-a", emulator.base_url)
    worth_waiting(pool, alice, len(req("x").body))
    first, _ = await pool.plan(alice, req("first"))
    gone, stays = await queue_up(pool, (alice, "the app leaves"), (alice, "the app stays"))
    async with pool.lease(first) as turn:
        await run(turn, req("first"), first)
    gone.cancel()  # woken for the freed lane, and cancelled before it could plan again
    plan, waiting = await asyncio.wait_for(stays, 3)
    assert type(plan) is Full and plan.lane == first.lane and waiting.seconds < 0.5
    assert gone.cancelled()
    pool.planner.finished(plan.lane, 0.0)


async def test_new_heads_waiting_for_a_probed_lane_go_at_once_when_the_upstream_refuses_lanes() -> None:
    """A new head waits for lanes a moment away (its socket probing a named lane). The upstream
    refusing ``stream_id`` means no such lane will come: every such turn plans again at once,
    not when its wait ends or when some lane frees."""
    async with Emulator(ws_stream_ids="reject") as emu:
        settings = Settings(upstream=emu.base_url, pool=PoolSettings(max_sockets_per_identity=1, wait_seconds=5))
        pool = Pool(settings, HeadTable(max_heads=100, ttl_seconds=3600))
        try:
            alice = who("sk-a", emu.base_url)
            first, _ = await pool.plan(alice, req("first"))
            async with pool.lease(first) as turn:
                await run(turn, req("first"), first)
            probe, _ = await pool.plan(alice, req("the probe"))
            assert probe.lane == (first.lane[0], "u1")  # the socket's first named lane
            async with pool.lease(probe) as turn:
                await turn.send(build_frame(req("the probe"), stream_id=probe.stream_id))
                (waiting,) = await queue_up(pool, (alice, "a new head"))
                assert not waiting.done()  # it waits for the probe's lanes
                _, event = await turn.recv(5)
                assert event["type"] == "error"  # stream_id refused
                plan, _ = await asyncio.wait_for(waiting, 1)  # while the probe's lane is still held
                assert type(plan) is Http
        finally:
            await pool.close()


async def test_a_lease_left_mid_response_drains_its_lane(emulator: Emulator, make_pool: PoolFactory) -> None:
    emulator.state.latency = LatencyModel(tokens_per_second=300)
    pool = make_pool()
    alice = who("sk-a", emulator.base_url)
    plan, _ = await pool.plan(alice, req("a long story"))

    async def leave_early() -> None:
        async with pool.lease(plan) as turn:
            await turn.send(build_frame(req("a long story")))
            await turn.recv(5)
            raise asyncio.CancelledError  # the app went away

    with pytest.raises(asyncio.CancelledError):
        await leave_early()
    assert "1 draining" in repr(pool)
    for _ in range(200):
        if "0 draining" in repr(pool):
            break
        await asyncio.sleep(0.02)
    assert "Lanes: 0 busy, 1 idle, 0 draining" in repr(pool)
    assert pool.count(SocketUse.IDLE) == 1 and len(pool.heads) == 0  # drained, no head


async def test_gauges_follow_every_transition(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool()
    alice = who("sk-a", emulator.base_url)
    base = {s: gauge("upshift_upstream_sockets", s) for s in ("open", "busy", "idle")}

    def delta() -> dict[str, float]:
        return {s: gauge("upshift_upstream_sockets", s) - base[s] for s in base}

    plan, _ = await pool.plan(alice, req("a"))
    assert delta() == {"open": 1, "busy": 1, "idle": 0}
    async with pool.lease(plan) as turn:
        await run(turn, req("a"), plan)
    assert delta() == {"open": 1, "busy": 0, "idle": 1}
    await pool.close()
    assert delta() == {"open": 0, "busy": 0, "idle": 0}


async def test_close_uses_1001(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool()
    plan, _ = await pool.plan(who("sk-a", emulator.base_url), req("a"))
    async with pool.lease(plan) as turn:
        await run(turn, req("a"), plan)
    await pool.close()
    await asyncio.sleep(0.05)
    assert [c.close_code for c in emulator.stats.connections.values()] == [1001]


async def test_a_refused_upgrade_goes_http_only_without_a_socket(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool()
    alice = who("sk-a", emulator.base_url)
    emulator.faults.arm("refuse_upgrade", status=426)
    plan, _ = await pool.plan(alice, req("a"))
    assert (type(plan), plan.reason) == (Http, "upgrade_refused")
    assert pool.planner.held_off(alice.digest, pool._clock())
    again, _ = await pool.plan(alice, req("b"))
    assert (type(again), again.reason) == (Http, "upgrade_refused")
    other, _ = await pool.plan(who("sk-b", emulator.base_url), req("c"))
    assert type(other) is Full  # another identity is not held off
    async with pool.lease(other) as turn:
        await run(turn, req("c"), other)


async def test_cancelled_connect_leaves_nothing_behind() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.sleep(5)
        finally:
            writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = Settings(upstream=f"http://127.0.0.1:{port}/v1", timeouts=TimeoutSettings(connect_seconds=5))
    pool = Pool(settings, HeadTable(max_heads=10, ttl_seconds=3600))
    task = asyncio.ensure_future(pool.plan(who("sk-a", settings.upstream), req("a")))
    await asyncio.sleep(0.1)
    assert pool.count(SocketUse.CONNECTING) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "Lanes: 0 busy" in repr(pool)
    await pool.close()
    assert pool.count() == 0
    server.close()


async def test_unreachable_upstream_plans_http() -> None:
    port = free_port()
    settings = Settings(upstream=f"http://127.0.0.1:{port}/v1")
    pool = Pool(settings, HeadTable(max_heads=10, ttl_seconds=3600))
    plan, _ = await pool.plan(who("sk-a", settings.upstream), req("a"))
    assert (type(plan), plan.reason) == (Http, "ws_unavailable")
    assert pool.count() == 0
    await pool.close()


async def test_idle_sockets_close_and_the_sweep_expires(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool(idle_close_seconds=0.2)
    plan, _ = await pool.plan(who("sk-a", emulator.base_url), req("a"))
    async with pool.lease(plan) as turn:
        await run(turn, req("a"), plan)
    assert pool.count() == 1
    for _ in range(100):
        if pool.count() == 0:
            break
        await asyncio.sleep(0.02)
    assert pool.count() == 0 and len(pool.heads) == 1  # store defaults to true: the head outlives its socket
