"""The socket pool against the emulator: assignment, reuse, limits, expiry, rotation, repr, gauges."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from proxy.config import PoolSettings, Settings, TimeoutSettings
from proxy.core.conversation import HeadTable
from proxy.core.request import parse_request
from proxy.emulator import Emulator
from proxy.errors import UpstreamRefused, UpstreamUnavailable
from proxy.identity import Identity, identify
from proxy.metrics import REGISTRY
from proxy.pool import Lease, Pool, SocketState

PoolFactory = Callable[..., Pool]


def who(key: str, upstream: str) -> Identity:
    return identify({"Authorization": f"Bearer {key}"}, upstream=upstream, authorization=f"Bearer {key}")


@pytest.fixture
async def make_pool(emulator: Emulator) -> AsyncIterator[PoolFactory]:
    pools: list[Pool] = []

    def make(spare: bool = False, **pool: Any) -> Pool:
        settings = Settings(upstream=emulator.base_url, pool=PoolSettings(**pool))
        created = Pool(settings, HeadTable(max_heads=100, ttl_seconds=3600), spare=spare)
        created.start()
        pools.append(created)
        return created

    yield make
    for created in pools:
        await created.close()


async def complete(lease: Lease) -> dict[str, Any]:
    """Run one tiny response on the leased socket; returns the completed response."""
    await lease.socket.send(b'{"type":"response.create","model":"gpt-5","input":"hi"}')
    while True:
        event = orjson.loads(await lease.socket.recv(5))
        if event["type"] == "response.completed":
            return dict(event["response"])


def gauge(state: str) -> float:
    return REGISTRY.get_sample_value("upshift_upstream_sockets", {"state": state}) or 0.0


async def test_acquire_reuse_and_one_in_flight(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool()
    alice = who("sk-a", emulator.base_url)
    first = await pool.acquire(alice)
    assert first is not None and first.fresh and not first.anchored
    assert repr(pool) == "<Pool [Sockets: 1 busy, 0 idle, 0 connecting | Identities: 1]>"
    # a second request while the first is in flight never shares its socket
    second = await pool.acquire(alice)
    assert second is not None and second.key != first.key
    await complete(first)
    pool.release(first, reusable=True)
    pool.release(second, reusable=True)
    assert repr(pool) == "<Pool [Sockets: 0 busy, 2 idle, 0 connecting | Identities: 1]>"
    again = await pool.acquire(alice)
    assert again is not None and not again.fresh and again.key == second.key  # most recently used
    pool.release(again, reusable=False)  # an unfinished response: the socket is closed
    assert pool.count() == 1
    assert emulator.stats.ws_connections["opened"] == 2


async def test_anchor_and_heads(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool()
    alice = who("sk-a", emulator.base_url)
    lease = await pool.acquire(alice)
    assert lease is not None
    response = await complete(lease)
    req = parse_request(b'{"model":"gpt-5","input":"hi"}')
    pool.heads.record(alice.digest, lease.key, req, response, 0.0)
    pool.release(lease, reusable=True, head=True)
    assert pool.is_idle(lease.key) and not pool.is_idle(12345) and not pool.is_idle("x")
    # a full send prefers a socket without a head: it opens a new one
    other = await pool.acquire(alice)
    assert other is not None and other.fresh
    anchored = await pool.acquire(alice, lease.key)
    assert anchored is not None and anchored.anchored and anchored.key == lease.key
    assert not pool.is_idle(lease.key)
    # another identity never gets that socket, even when asking for its anchor
    pool.release(anchored, reusable=True, head=True)
    bob = await pool.acquire(who("sk-b", emulator.base_url), lease.key)
    assert bob is not None and bob.key != lease.key and not bob.anchored
    for lent in (other, bob):
        pool.release(lent, reusable=False)


async def test_per_identity_limit(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool(max_sockets_per_identity=2)
    alice = who("sk-a", emulator.base_url)
    one, two = await pool.acquire(alice), await pool.acquire(alice)
    assert one is not None and two is not None
    assert await pool.acquire(alice) is None  # all busy at the limit: use HTTP, never wait
    pool.release(one, reusable=True, head=True)
    pool.release(two, reusable=True, head=True)
    reused = await pool.acquire(alice)  # at the limit: the LRU idle socket (its head is lost)
    assert reused is not None and reused.key == one.key and not reused.fresh
    fresh = await pool.acquire(alice, fresh=True)  # a replay needs a new socket: LRU idle closed
    assert fresh is not None and fresh.fresh and pool.count(identity=alice) == 2
    assert two.key not in {reused.key, fresh.key}
    pool.release(reused, reusable=False)
    pool.release(fresh, reusable=False)


async def test_total_limit_evicts_the_lru_idle_socket_of_any_identity(
    emulator: Emulator, make_pool: PoolFactory
) -> None:
    pool = make_pool(max_sockets_total=2)
    alice, bob = who("sk-a", emulator.base_url), who("sk-b", emulator.base_url)
    a1, a2 = await pool.acquire(alice), await pool.acquire(alice)
    assert a1 is not None and a2 is not None
    assert await pool.acquire(bob) is None
    pool.release(a1, reusable=True)
    pool.release(a2, reusable=True)
    b1 = await pool.acquire(bob)
    assert b1 is not None and pool.count(identity=alice) == 1 and pool.count() == 2
    assert not pool.is_idle(a1.key) and pool.is_idle(a2.key)
    pool.release(b1, reusable=False)


async def test_idle_close_discards_heads(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool(idle_close_seconds=0.2)
    alice = who("sk-a", emulator.base_url)
    lease = await pool.acquire(alice)
    assert lease is not None
    response = await complete(lease)
    pool.heads.record(alice.digest, lease.key, parse_request(b'{"input":"hi"}'), response, 0.0)
    pool.release(lease, reusable=True, head=True)
    await asyncio.sleep(0.4)
    assert pool.count() == 0 and len(pool.heads) == 0
    await asyncio.sleep(0.05)
    assert emulator.stats.ws_connections["closed"] == 1


async def test_rotation_only_when_idle(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool(rotate_after_seconds=0.3)
    alice = who("sk-a", emulator.base_url)
    rotated = REGISTRY.get_sample_value("upshift_socket_age_at_rotation_seconds_count") or 0.0
    busy = await pool.acquire(alice)
    idle = await pool.acquire(alice)
    assert busy is not None and idle is not None
    pool.release(idle, reusable=True)
    await asyncio.sleep(0.5)
    assert pool.count(SocketState.IDLE) == 0  # the idle one was retired
    assert pool.count(SocketState.BUSY) == 1  # the busy one was left alone
    await complete(busy)
    pool.release(busy, reusable=True)  # too old: retired on release, never reused
    assert pool.count() == 0
    assert (REGISTRY.get_sample_value("upshift_socket_age_at_rotation_seconds_count") or 0) == rotated + 2


async def test_upstream_close_of_an_idle_socket_discards_its_head(make_pool: Any) -> None:
    async with Emulator(ws_idle_timeout_s=0.2) as emulator:
        settings = Settings(upstream=emulator.base_url)
        pool = Pool(settings, HeadTable(max_heads=10, ttl_seconds=3600))
        alice = who("sk-a", emulator.base_url)
        lease = await pool.acquire(alice)
        assert lease is not None
        response = await complete(lease)
        pool.heads.record(alice.digest, lease.key, parse_request(b'{"input":"hi"}'), response, 0.0)
        pool.release(lease, reusable=True, head=True)
        await asyncio.sleep(0.4)
        assert pool.count() == 0 and len(pool.heads) == 0
        await pool.close()


async def test_gauges_follow_every_transition(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool()
    alice = who("sk-a", emulator.base_url)
    base = {s: gauge(s) for s in ("open", "busy", "idle")}

    def delta() -> dict[str, float]:
        return {s: gauge(s) - base[s] for s in base}

    lease = await pool.acquire(alice)
    assert lease is not None and delta() == {"open": 1, "busy": 1, "idle": 0}
    pool.release(lease, reusable=True)
    assert delta() == {"open": 1, "busy": 0, "idle": 1}
    await pool.close()
    assert delta() == {"open": 0, "busy": 0, "idle": 0}


async def test_close_uses_1001(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool()
    lease = await pool.acquire(who("sk-a", emulator.base_url))
    assert lease is not None
    pool.release(lease, reusable=True)
    await pool.close()
    await asyncio.sleep(0.05)
    assert [c.close_code for c in emulator.stats.connections.values()] == [1001]


async def test_426_prefers_http_for_a_while(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool()
    alice = who("sk-a", emulator.base_url)
    emulator.faults.arm("refuse_upgrade", status=426)
    with pytest.raises(UpstreamRefused):
        await pool.acquire(alice)
    assert pool.prefers_http(alice) and not pool.prefers_http(who("sk-b", emulator.base_url))
    assert pool.count() == 0


async def test_cancelled_connect_leaves_nothing_behind() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = Settings(upstream=f"http://127.0.0.1:{port}/v1", timeouts=TimeoutSettings(connect_seconds=5))
    pool = Pool(settings, HeadTable(max_heads=10, ttl_seconds=3600))
    task = asyncio.ensure_future(pool.acquire(who("sk-a", settings.upstream)))
    await asyncio.sleep(0.1)
    assert pool.count(SocketState.CONNECTING) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.count() == 0 and repr(pool).endswith("Identities: 0]>")
    server.close()
    await pool.close()


async def test_unreachable_upstream_raises_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(upstream=f"http://127.0.0.1:{port}/v1")
    pool = Pool(settings, HeadTable(max_heads=10, ttl_seconds=3600))
    with pytest.raises(UpstreamUnavailable):
        await pool.acquire(who("sk-a", settings.upstream))
    assert pool.count() == 0
    await pool.close()


async def test_a_spare_socket_is_kept_warm(emulator: Emulator, make_pool: PoolFactory) -> None:
    pool = make_pool(spare=True, max_sockets_per_identity=3)
    alice = who("sk-a", emulator.base_url)
    lease = await pool.acquire(alice)
    assert lease is not None
    pool.release(lease, reusable=True)  # no head: no spare needed
    await asyncio.sleep(0.05)
    assert pool.count() == 1
    lease = await pool.acquire(alice)
    assert lease is not None
    pool.release(lease, reusable=True, head=True)  # every idle socket holds a head: warm one
    assert pool.count(SocketState.CONNECTING) == 1
    await asyncio.sleep(0.1)
    assert repr(pool) == "<Pool [Sockets: 0 busy, 2 idle, 0 connecting | Identities: 1]>"
    spare = await pool.acquire(alice)  # a new conversation: the warm spare, no handshake
    assert spare is not None and not spare.fresh and spare.key != lease.key
    pool.release(spare, reusable=False)
