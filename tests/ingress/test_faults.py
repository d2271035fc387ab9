"""Forwarding faults: a peer that never answers, answers 5xx, hangs up, cuts its answer, or is
flooded; markers; membership from DNS. One real replica in front of a misbehaving peer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.config import ClusterSettings, Settings, ShutdownSettings
from proxy.ingress.peers import MARKER
from proxy.observe.metrics import FORWARDS, FORWARDS_RECEIVED
from proxy.server import Server
from tests.clients.support import MODEL, TOOLS
from upshift_emulator import Emulator

from .fakes import FakePeer
from .support import HEADERS, free_ports, owner_of, task_owned_by, tool_loop

Started = tuple[Server, str]


def _count(metric: Any, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


async def _replica(upstream: str, peers: list[str], url: str, **cluster: Any) -> Server:
    server = Server(
        Settings(
            upstream=upstream,
            listen=url.removeprefix("http://"),
            admin_listen="127.0.0.1:0",
            shutdown=ShutdownSettings(grace_seconds=2.0),
            cluster=ClusterSettings(peers=",".join(peers), self_url=url, plain_http_peers=True, **cluster),
        )
    )
    await server.start()
    return server


@pytest.fixture
async def front(emulator: Emulator, request: pytest.FixtureRequest) -> AsyncIterator[tuple[Server, str, FakePeer]]:
    """A real replica whose only peer is a fake one behaving as the test's parameter says."""
    behaviour, extra = request.param if isinstance(request.param, tuple) else (request.param, {})
    async with FakePeer(behaviour) as fake:
        url = f"http://127.0.0.1:{free_ports(1)[0]}"
        server = await _replica(emulator.base_url, [url, fake.url], url, connect_timeout_seconds=0.3, **extra)
        try:
            yield server, url, fake
        finally:
            await server.stop()


async def _post(
    session: aiohttp.ClientSession, url: str, task: str, headers: dict[str, str] | None = None, **fields: Any
) -> tuple[int, bytes, Any]:
    body = {"model": MODEL, "input": [{"role": "user", "content": task}], "tools": TOOLS, **fields}
    headers = {**HEADERS, **(headers or {})}
    async with session.post(url + "/v1/responses", data=orjson.dumps(body), headers=headers) as resp:
        return resp.status, await resp.read(), resp.headers


@pytest.mark.parametrize("front", ["silent", "error_500", "hang_up"], indirect=True)
async def test_an_owner_that_cannot_answer_is_skipped(emulator: Emulator, front: tuple[Server, str, FakePeer]) -> None:
    """Accepts but never answers (no 100 Continue within the connect timeout), answers a 5xx no
    upshift wrote, or hangs up after the body: the request is served locally, the owner is
    marked down and not asked again during the back-off."""
    server, url, fake = front
    task = task_owned_by(fake.url, emulator.base_url, [url, fake.url], fake.behaviour)
    async with aiohttp.ClientSession() as session:
        conv = await tool_loop(session, [url], task)
    assert conv.modes[0] == "full" and all(m == "continuation" for m in conv.modes[1:]), conv.modes
    assert fake.requests == 1  # skipped for cluster.down_seconds after the failure


@pytest.mark.parametrize("front", ["cut_sse"], indirect=True)
async def test_a_cut_stream_ends_with_one_error_event(emulator: Emulator, front: tuple[Server, str, FakePeer]) -> None:
    server, url, fake = front
    task = task_owned_by(fake.url, emulator.base_url, [url, fake.url], "sse")
    async with aiohttp.ClientSession() as session:
        status, data, headers = await _post(session, url, task, stream=True)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in data.decode().split("\n\n") if e]
    names = [e.splitlines()[0] for e in events]
    assert names == ["event: response.created", "event: response.in_progress", "event: error"], events
    error = orjson.loads(events[-1].splitlines()[1].removeprefix("data: "))
    assert error["sequence_number"] == 2  # numbered after the last relayed event
    assert error["error"]["code"] == "upstream_closed" and error["error"]["type"] == "server_error"


@pytest.mark.parametrize("front", ["cut_json"], indirect=True)
async def test_a_cut_json_answer_becomes_a_502(emulator: Emulator, front: tuple[Server, str, FakePeer]) -> None:
    server, url, fake = front
    task = task_owned_by(fake.url, emulator.base_url, [url, fake.url], "json")
    async with aiohttp.ClientSession() as session:
        status, data, _ = await _post(session, url, task)
    assert status == 502
    assert orjson.loads(data)["error"]["code"] == "upstream_closed"


@pytest.mark.parametrize("front", [("slow_ok", {"max_forwards_per_peer": 4})], indirect=True)
async def test_a_flood_of_forwards_to_one_owner_is_bounded(
    emulator: Emulator, front: tuple[Server, str, FakePeer]
) -> None:
    """60 requests at once for a slow owner: at most 4 are in flight there, the rest wait a
    connect timeout for a slot and are then served locally; idle connections stay bounded."""
    server, url, fake = front
    peers = [url, fake.url]
    tasks = [task_owned_by(fake.url, emulator.base_url, peers, f"flood-{i}") for i in range(60)]
    busy_before = _count(FORWARDS, "replica", "busy")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        answers = await asyncio.gather(*(_post(session, url, t) for t in tasks))
    assert all(status == 200 for status, _, _ in answers)
    by_owner = sum(1 for _, _, h in answers if h.get("x-upshift-owner") == "fake")
    assert by_owner >= 4 and fake.max_concurrent <= 4
    assert _count(FORWARDS, "replica", "busy") - busy_before == 60 - by_owner
    assert fake.open_connections <= 4  # idle keep-alive connections kept: bounded by the same limit


@pytest.mark.parametrize("front", ["slow_ok"], indirect=True)
async def test_a_marked_request_is_never_forwarded_again(
    emulator: Emulator, front: tuple[Server, str, FakePeer]
) -> None:
    """Whatever this replica thinks of ownership, a request another replica forwarded (or an
    app marked) is served here: no loops, and a forged marker gains nothing."""
    server, url, fake = front
    task = task_owned_by(fake.url, emulator.base_url, [url, fake.url], "marked")
    before = _count(FORWARDS_RECEIVED, "replica", "unsigned")
    async with aiohttp.ClientSession() as session:
        status, _, headers = await _post(session, url, task, headers={MARKER: "replica;req_x;"})
    assert status == 200 and headers["x-upshift-mode"] == "full"
    assert fake.requests == 0
    assert _count(FORWARDS_RECEIVED, "replica", "unsigned") == before + 1


async def test_signed_markers(emulator: Emulator, tmp_path: Path) -> None:
    """With cluster.secret_file, forwards carry a signature owners check; a forged marker is
    counted as unverified and refused (403, an OpenAI-style body), nothing served."""
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    a, b = (f"http://127.0.0.1:{p}" for p in free_ports(2))
    servers = [await _replica(emulator.base_url, [a, b], u, secret_file=str(secret)) for u in (a, b)]
    try:
        task = task_owned_by(b, emulator.base_url, [a, b], "signed")
        good = _count(FORWARDS_RECEIVED, "replica", "true")
        forged = _count(FORWARDS_RECEIVED, "replica", "false")
        async with aiohttp.ClientSession() as session:
            status, _, headers = await _post(session, a, task)
            assert status == 200 and headers["x-upshift-owner"] == "1"  # its URL only in debug
            assert _count(FORWARDS_RECEIVED, "replica", "true") == good + 1
            status, data, headers = await _post(session, b, task + " 2", headers={MARKER: "replica;req_y;0123"})
            assert status == 403, data
            assert orjson.loads(data)["error"]["code"] == "forward_unauthenticated"
        assert _count(FORWARDS_RECEIVED, "replica", "false") == forged + 1
    finally:
        for server in servers:
            await server.stop()


async def test_peers_from_dns_follow_membership(emulator: Emulator) -> None:
    """cluster.peers_dns: resolved at start (a real name: localhost) and re-resolved; only the
    conversations whose owner changed move (an injected resolver grows the set)."""
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    settings = Settings(
        upstream=emulator.base_url,
        listen=f"127.0.0.1:{port}",
        admin_listen="127.0.0.1:0",
        shutdown=ShutdownSettings(grace_seconds=2.0),
        cluster=ClusterSettings(
            peers_dns=f"localhost:{port}", self_url=url, dns_refresh_seconds=0.05, plain_http_peers=True
        ),
    )
    server = Server(settings)
    await server.start()
    try:
        assert url in server.cluster.members
    finally:
        await server.stop()

    answers = [["http://127.0.0.11:8080", "http://127.0.0.12:8080", url]]

    async def resolve(host: str, port: int) -> list[str]:
        assert host == "peers.example"
        return answers[-1]

    server = Server(
        Settings(
            upstream=emulator.base_url,
            listen=f"127.0.0.1:{port}",
            admin_listen="127.0.0.1:0",
            cluster=ClusterSettings(
                peers_dns="peers.example:8080", self_url=url, dns_refresh_seconds=0.05, plain_http_peers=True
            ),
        ),
        resolver=resolve,
    )
    await server.start()
    try:
        assert server.cluster.members == tuple(sorted(answers[0]))
        tasks = [f"task {i}" for i in range(600)]
        before = {t: owner_of(t, emulator.base_url, answers[0]) for t in tasks}
        answers.append([*answers[0], "http://127.0.0.13:8080"])
        while len(server.cluster.members) != 4:
            await asyncio.sleep(0.02)
        after = {t: owner_of(t, emulator.base_url, server.cluster.members) for t in tasks}
        moved = [t for t in tasks if after[t] != before[t]]
        assert all(after[t] == "http://127.0.0.13:8080" for t in moved)
        assert len(moved) < len(tasks) / 3
    finally:
        await server.stop()
