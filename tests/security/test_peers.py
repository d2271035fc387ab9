"""Replicas prove who they are: forwards are signed and go over TLS; a process
that got into the peer set without the secret is refused every forward and is sent none."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import pytest
import trustme

from proxy.config import ClusterSettings, Settings, ShutdownSettings
from proxy.errors import ConfigError
from proxy.ingress.peerauth import PeerAuth
from proxy.ingress.peers import MARKER
from proxy.reasons import ForwardOutcome as Outcome
from proxy.server import Server
from tests.ingress.support import (
    HEADERS,
    STEPS,
    assert_fidelity,
    continued,
    first_body,
    free_ports,
    owner_of,
    task_text,
    tool_loop,
)
from upshift_emulator import Emulator

PEER_NAME = "upshift-gateway-peers"
"""The name the shipped gateway manifests give the replicas' certificate (cluster.tls_server_name)."""


@dataclass
class Files:
    cert: str
    key: str
    ca: str
    secret: str


@pytest.fixture
def files(tmp_path: Path) -> Files:
    ca = trustme.CA()
    leaf = ca.issue_cert(PEER_NAME)  # one certificate for every replica, as the manifests mount it
    cert, key, bundle = tmp_path / "peer.crt", tmp_path / "peer.key", tmp_path / "ca.crt"
    leaf.private_key_pem.write_to_path(str(key))
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    ca.cert_pem.write_to_path(str(bundle))
    secret = tmp_path / "secret"
    secret.write_text("the-new-secret\nthe-old-secret\n")
    return Files(str(cert), str(key), str(bundle), str(secret))


def _replica(upstream: str, api: int, peer: int, peers: list[str], files: Files, secret: str) -> Server:
    return Server(
        Settings(
            upstream=upstream,
            listen=f"127.0.0.1:{api}",
            admin_listen="127.0.0.1:0",
            shutdown=ShutdownSettings(grace_seconds=2.0),
            cluster=ClusterSettings(
                peers=",".join(peers),
                self_url=f"https://127.0.0.1:{peer}",
                peer_listen=f"127.0.0.1:{peer}",
                tls_cert_file=files.cert,
                tls_key_file=files.key,
                tls_ca_file=files.ca,
                tls_server_name=PEER_NAME,
                secret_file=secret,
                # Four replicas and 24 agents share the test's one event loop: a proof of the
                # secret over a fresh TLS connection can take longer than the 0.75 s default on
                # a loaded CI machine, which would skip a live owner for 5 s (not this test's case;
                # tests/ingress/test_replicas.py does the same).
                connect_timeout_seconds=5.0,
            ),
        )
    )


@pytest.fixture
async def four(
    emulator: Emulator, files: Files, tmp_path: Path
) -> AsyncIterator[tuple[list[Server], list[str], list[str]]]:
    """Three replicas sharing the secret (one holds it as the second line: mid-rotation) and a
    fourth in the same peer set (TLS certificate and all) without it. Returns servers, API URLs
    and peer URLs."""
    ports = free_ports(8)
    peers = [f"https://127.0.0.1:{p}" for p in ports[4:]]
    rotated = tmp_path / "rotated"
    rotated.write_text("the-old-secret\nthe-new-secret\n")  # swapped: still verifies, still proves
    secrets = [files.secret, files.secret, str(rotated), ""]
    servers = [
        _replica(emulator.base_url, api, peer, peers, files, secret)
        for api, peer, secret in zip(ports[:4], ports[4:], secrets, strict=True)
    ]
    for server in servers:
        await server.start()
    try:
        yield servers, [f"http://127.0.0.1:{p}" for p in ports[:4]], peers
    finally:
        for server in servers:
            await server.stop()


async def test_three_replicas_with_the_secret_continue_and_the_fourth_gets_nothing(
    emulator: Emulator, four: tuple[list[Server], list[str], list[str]]
) -> None:
    servers, apis, peers = four
    honest, rogue = servers[:3], servers[3]
    # Conversations whose first owner is the rogue are among them: they go to the next owner.
    tasks = [task_text(STEPS, f"tls-{i}") for i in range(24)]
    assert any(owner_of(t, emulator.base_url, peers) == peers[3] for t in tasks)
    async with aiohttp.ClientSession() as session:
        convs = await asyncio.gather(*(tool_loop(session, apis[:3], t, start=i) for i, t in enumerate(tasks)))
        turns = sum(len(c.response_ids) - 1 for c in convs)
        assert sum(continued(emulator, c) for c in convs) == turns  # every later turn continued
        for conv in convs:
            assert_fidelity(emulator, conv)
        assert sum(1 for c in convs for o in c.owners if o is not None) > turns // 3  # forwards happened
        assert all(s.cluster.received["false"] == 0 for s in honest)
        assert sum(s.cluster.received["true"] for s in honest) > 0
        assert sum(rogue.cluster.received.values()) == 0  # never sent a forward
        assert sum(s.cluster.sent[Outcome.UNPROVEN] for s in honest) >= 1  # asked, could not prove

        # The rogue's own forwards: every one refused, and its apps still answered (locally).
        before = sum(s.cluster.received["false"] for s in honest)
        rogue_tasks = [
            t for n in range(200) if owner_of(t := task_text(1, f"r-{n}"), emulator.base_url, peers) != peers[3]
        ]
        for task in rogue_tasks[:6]:
            async with session.post(apis[3] + "/v1/responses", data=first_body(task), headers=HEADERS) as resp:
                assert resp.status == 200 and resp.headers["x-upshift-mode"] == "full"
        refused = rogue.cluster.sent[Outcome.REFUSED]
        assert refused >= 1 and rogue.cluster.sent[Outcome.OK] == 0
        assert sum(s.cluster.received["false"] for s in honest) - before == refused


async def test_an_unsigned_or_replayed_forward_is_refused(
    emulator: Emulator, four: tuple[list[Server], list[str], list[str]], files: Files
) -> None:
    """An app (or a Pod) posting to the peer listener with a forged, stale or replayed marker
    gets 403 and an OpenAI-style body; nothing is served."""
    servers, apis, peers = four
    body = first_body(task_text(1, "forged"))
    auth = PeerAuth.load(files.secret)
    genuine = auth.marker("POST", "/v1/responses", body, "req_1")
    ssl_ctx = ssl.create_default_context(cafile=files.ca)
    async with aiohttp.ClientSession() as session:

        async def post(marker: str, data: bytes = body) -> tuple[int, bytes]:
            headers = {**HEADERS, MARKER: marker}
            async with session.post(
                peers[0] + "/v1/responses", data=data, headers=headers, ssl=ssl_ctx, server_hostname=PEER_NAME
            ) as resp:
                return resp.status, await resp.read()

        for marker in (
            "replica;req_x;;;",
            "replica;req_x;0;0;0",
            PeerAuth((b"other",)).marker("POST", "/v1/responses", body, "h"),
        ):
            status, data = await post(marker)
            assert status == 403 and orjson.loads(data)["error"]["code"] == "forward_unauthenticated"
        stale = auth.marker("POST", "/v1/responses", body, "req_2", now=1_000_000.0)
        assert (await post(stale))[0] == 403
        tampered = auth.marker("POST", "/v1/responses", body, "req_3")
        assert (await post(tampered, body.replace(b"forged", b"forgeD")))[0] == 403  # body digest
        # control: a genuine forward is served, once; the same bytes again are a replay
        status, data = await post(genuine)
        assert status == 200, data
        assert (await post(genuine))[0] == 403


async def test_plain_http_between_replicas_needs_the_explicit_opt_in(emulator: Emulator) -> None:
    api = free_ports(2)
    urls = [f"http://127.0.0.1:{p}" for p in api]
    settings = Settings(
        upstream=emulator.base_url,
        listen=f"127.0.0.1:{api[0]}",
        admin_listen="127.0.0.1:0",
        cluster=ClusterSettings(peers=",".join(urls), self_url=urls[0]),
    )
    server = Server(settings)
    with pytest.raises(ConfigError, match="plain_http_peers"):
        await server.start()
    await server.stop()
