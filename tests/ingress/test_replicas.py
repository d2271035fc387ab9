"""Replicas on loopback: a client spreading requests round-robin keeps its continuations; a
replica SIGKILLed mid-run costs its conversations one full send each; a fourth replica joining
moves only the conversations it now owns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from proxy.config import ClusterSettings, Settings, ShutdownSettings
from proxy.server import Server
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

from .support import (
    STEPS,
    Conversation,
    assert_fidelity,
    continued,
    direct,
    free_ports,
    owner_of,
    summary,
    task_text,
    tool_loop,
    wait_ready,
)

CONVERSATIONS = 60
SPLIT = 3
"""Turns 0..2 before the membership change, 3..5 after."""


class Phases:
    """Holds every conversation at turn ``SPLIT`` until the test changed the membership."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.arrived = 0
        self.all_arrived = asyncio.Event()
        self.go = asyncio.Event()

    async def __call__(self, turn: int) -> None:
        if turn == SPLIT:
            self.arrived += 1
            if self.arrived == self.count:
                self.all_arrived.set()
            await self.go.wait()


def _full_sends_after_split(emulator: Emulator, conv: Conversation) -> list[int]:
    """Turns after the split that were not continued."""
    out = []
    for turn in range(SPLIT, len(conv.response_ids)):
        rec = emulator.record(conv.response_ids[turn])
        assert rec is not None
        if not (rec["continuation"] and rec["previous_response_id"] == conv.response_ids[turn - 1]):
            out.append(turn)
    return out


async def _single_replica_rate(emulator: Emulator, tasks: list[str]) -> float:
    sidecar = Server(
        Settings(
            upstream=emulator.base_url, listen="127.0.0.1:0", admin_listen="127.0.0.1:0", shutdown=ShutdownSettings(2.0)
        )
    )
    await sidecar.start()
    try:
        url = f"http://127.0.0.1:{sidecar.api_address[1]}"
        async with aiohttp.ClientSession() as session:
            convs = await asyncio.gather(*(tool_loop(session, [url], t) for t in tasks))
    finally:
        await sidecar.stop()
    return sum(continued(emulator, c) for c in convs) / sum(len(c.response_ids) - 1 for c in convs)


async def test_three_replicas_round_robin_and_one_sigkilled(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    ports = free_ports(6)
    urls = [f"http://127.0.0.1:{p}" for p in ports[:3]]
    env = {
        "UPSHIFT_CLUSTER_PEERS": ",".join(urls),
        "UPSHIFT_CLUSTER_PLAIN_HTTP_PEERS": "true",  # loopback: the documented opt-in
        "UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY": "256",
    }
    procs = []
    for url, admin in zip(urls, ports[3:], strict=True):
        proc = spawn(
            emulator.base_url,
            "--listen",
            url.removeprefix("http://"),
            "--admin-listen",
            f"127.0.0.1:{admin}",
            env={**env, "UPSHIFT_CLUSTER_SELF_URL": url},
        )
        proc.api, proc.admin = url, f"http://127.0.0.1:{admin}"
        procs.append(proc)
    tasks = [task_text(STEPS, f"replica-conv-{i}") for i in range(CONVERSATIONS)]
    phases = Phases(CONVERSATIONS)
    targets = list(urls)  # the client's round-robin list; the dead replica leaves it
    async with aiohttp.ClientSession() as session:
        for proc in procs:
            await wait_ready(proc, session)
        running = [
            asyncio.ensure_future(tool_loop(session, targets, t, start=i, before_turn=phases))
            for i, t in enumerate(tasks)
        ]
        await phases.all_arrived.wait()
        procs[2].proc.kill()  # SIGKILL, between turns: no app has a turn in flight there
        procs[2].proc.wait(5)
        targets.remove(urls[2])
        phases.go.set()
        convs = await asyncio.gather(*running)  # every turn answered 200 (tool_loop checks)
        http_before_direct = emulator.stats.requests["http"]  # the direct runs below go over HTTP
        want = await direct(emulator, session, tasks)
    # one upstream request per turn: nothing was replayed twice or forwarded round in a loop (a
    # turn may go over HTTP, say a first turn whose pool wait ran out on a loaded machine)
    upstream_requests = sum(c.requests for c in emulator.stats.connections.values()) + http_before_direct
    assert upstream_requests == sum(len(c.response_ids) for c in convs)
    for conv, ref in zip(convs, want, strict=True):
        assert summary(conv) == summary(ref)
        assert_fidelity(emulator, conv)
    # before the kill: as good as one replica on the same workload
    before = sum(continued(emulator, Conversation(c.task, response_ids=c.response_ids[:SPLIT])) for c in convs)
    rate = before / (CONVERSATIONS * (SPLIT - 1))
    assert rate >= 0.95 * await _single_replica_rate(emulator, [t + " (single)" for t in tasks])
    # after it: the dead replica's conversations took exactly one full send, on their new owner;
    # the others none
    for conv in convs:
        owned_by_dead = owner_of(conv.task, emulator.base_url, urls) == urls[2]
        assert _full_sends_after_split(emulator, conv) == ([SPLIT] if owned_by_dead else []), conv.task
    for proc in procs[:2]:
        assert await proc.terminate() == 0


async def test_a_fourth_replica_moves_only_its_own_conversations(emulator: Emulator) -> None:
    hosts = [f"127.0.0.{21 + i}" for i in range(4)]
    port = free_ports(1, hosts)[0]
    urls = [f"http://{host}:{port}" for host in hosts]
    members = [urls[:3]]

    async def resolve(host: str, port: int) -> list[str]:
        return members[-1]

    def make(url: str) -> Server:
        settings = Settings(
            upstream=emulator.base_url,
            listen=url.removeprefix("http://"),
            admin_listen=url.removeprefix("http://").rpartition(":")[0] + ":0",
            shutdown=ShutdownSettings(grace_seconds=2.0),
            # Four replicas and 60 agents share this test's one event loop: a forward's
            # 100 Continue can wait longer than the 0.75 s default under a loaded CI machine,
            # which would skip a live owner for 5 s (not what this test is about).
            cluster=ClusterSettings(
                peers_dns=f"upshift-peers:{port}",
                self_url=url,
                dns_refresh_seconds=0.05,
                plain_http_peers=True,
                connect_timeout_seconds=5.0,
            ),
        )
        return Server(settings, resolver=resolve)

    servers: list[Server] = []
    try:
        for url in urls[:3]:
            servers.append(make(url))
            await servers[-1].start()
        tasks = [task_text(STEPS, f"grow-{i}") for i in range(CONVERSATIONS)]
        phases = Phases(CONVERSATIONS)
        targets = list(urls[:3])
        async with aiohttp.ClientSession() as session:
            running = [
                asyncio.ensure_future(tool_loop(session, targets, t, start=i, before_turn=phases))
                for i, t in enumerate(tasks)
            ]
            await phases.all_arrived.wait()
            servers.append(make(urls[3]))
            await servers[3].start()
            members.append(urls)
            while any(len(s.cluster.members) != 4 for s in servers):
                await asyncio.sleep(0.02)
            targets.append(urls[3])
            phases.go.set()
            convs: list[Any] = await asyncio.gather(*running)
        moved = 0
        for conv in convs:
            full = _full_sends_after_split(emulator, conv)
            new_owner = owner_of(conv.task, emulator.base_url, urls) == urls[3]
            assert full == ([SPLIT] if new_owner else []), conv.task
            moved += bool(full)
            assert_fidelity(emulator, conv)
        # Which conversations the fourth takes depends on the ports (random): about a quarter, so
        # the bound is loose (a third failed one run in twenty); the exact set is checked above.
        assert 0 < moved <= CONVERSATIONS / 2
    finally:
        for server in servers:
            await server.stop()
