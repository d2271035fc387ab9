"""The peer proof is no signing oracle and cannot be passed on: a replica proves it holds the
cluster secret only to a question signed with the secret (in time, once) that names it as the
prover, and its answer is bound to both names and the asker's fresh nonce. A process that got
into the peer set without the secret can neither get a proof for itself nor relay a replica's
question to an honest replica (or back to the asker): it is never sent an app's request."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from proxy.ingress.peerauth import PROOF_HEADER, PROOF_PATH, PeerAuth
from proxy.ingress.peers import MARKER
from proxy.server import Server
from tests.ingress.support import HEADERS, first_body, free_ports, replica_settings, task_owned_by
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

SECRET = b"peer-proof-cluster-secret-0123456789"


class Rogue:
    """A process in the peer set without the secret: it passes every proof question on to
    ``target`` and returns the answer, and records every other request it is sent."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.target = ""
        self.received: list[dict[str, str]] = []
        self.relayed = 0
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == PROOF_PATH:
            self.relayed += 1
            headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
            async with aiohttp.ClientSession() as http:
                async with http.get(URL(self.target + request.raw_path, encoded=True), headers=headers) as resp:
                    proof = resp.headers.get(PROOF_HEADER)
                    return web.Response(status=resp.status, headers={PROOF_HEADER: proof} if proof else {})
        self.received.append(dict(request.headers))
        await request.read()
        return web.Response(status=503)

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()


@pytest.fixture
async def cluster(emulator: Emulator, tmp_path: Path) -> AsyncIterator[tuple[list[Server], list[str], Rogue]]:
    """Two replicas with the secret and a rogue in their peer set (plain HTTP on loopback)."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    ports = free_ports(3)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rogue = Rogue(ports[2])
    servers = [
        Server(replica_settings(emulator.base_url, url, urls, secret_file=str(secret), connect_timeout_seconds=5.0))
        for url in urls[:2]
    ]
    begun: list[Server] = []
    try:  # what began is stopped, also when a start fails half-way
        await rogue.start()
        for server in servers:
            begun.append(server)
            await server.start()
        yield servers, urls, rogue
    finally:
        for server in begun:
            await server.stop()
        await rogue.runner.cleanup()


@pytest.mark.parametrize("relay_to", ["honest", "asker"])
async def test_a_rogue_cannot_pass_a_question_on_and_is_sent_nothing(
    emulator: Emulator, cluster: tuple[list[Server], list[str], Rogue], relay_to: str
) -> None:
    (asker, honest), urls, rogue = cluster
    rogue.target = urls[1] if relay_to == "honest" else urls[0]
    # The attack: conversations the rogue owns, posted to a replica with the secret, which asks
    # the rogue for its proof; the rogue passes the question on and returns the answer.
    async with aiohttp.ClientSession() as http:
        for n in range(3):
            task = task_owned_by(rogue.url, emulator.base_url, urls, f"rogue-{relay_to}-{n}")
            async with http.post(urls[0] + "/v1/responses", data=first_body(task), headers=HEADERS) as resp:
                assert resp.status == 200, await resp.text()  # served here, never by the rogue
        assert rogue.relayed >= 1  # it was asked, and tried
        assert rogue.received == [], rogue.received  # never a byte of an app's request, nor its key
        # The control: the honest replica proves itself and is forwarded its conversations.
        before = honest.cluster.received["true"]
        task = task_owned_by(urls[1], emulator.base_url, urls, f"honest-{relay_to}")
        async with http.post(urls[0] + "/v1/responses", data=first_body(task), headers=HEADERS) as resp:
            assert resp.status == 200, await resp.text()
        assert honest.cluster.received["true"] == before + 1


async def test_the_proof_answers_only_a_signed_question_naming_the_prover(
    cluster: tuple[list[Server], list[str], Rogue],
) -> None:
    _, urls, _ = cluster
    auth, other = PeerAuth((SECRET,)), PeerAuth((b"another-secret",))
    challenge = os.urandom(16).hex()

    def question(prover: str, signer: PeerAuth = auth) -> tuple[str, dict[str, str]]:
        raw = str(URL(PROOF_PATH).with_query({"asker": urls[1], "prover": prover, "challenge": challenge}))
        return raw, {MARKER: signer.marker("GET", raw, b"", "proof-test")}

    async with aiohttp.ClientSession() as http:

        async def ask(raw: str, headers: dict[str, str]) -> tuple[int, str | None]:
            async with http.get(URL(urls[0] + raw, encoded=True), headers=headers) as resp:
                return resp.status, resp.headers.get(PROOF_HEADER)

        # The attack: anyone asked for an HMAC of any challenge and got it.
        assert await ask(PROOF_PATH, {"x-upshift-challenge": challenge}) == (404, None)
        raw, _ = question(urls[0])
        assert await ask(raw, {}) == (404, None)
        assert await ask(raw, {MARKER: "replica;proof-test;;;"}) == (404, None)
        assert await ask(*question(urls[0], other)) == (404, None)
        assert await ask(*question(urls[2])) == (404, None)  # a question for another prover
        # The control: a signed question naming this replica gets a proof the asker can check,
        # once (the same question again is a replay).
        raw, headers = question(urls[0])
        status, proof = await ask(raw, headers)
        assert status == 204 and proof is not None
        assert auth.check_proof(urls[1], urls[0], challenge, proof)
        assert not auth.check_proof(urls[1], urls[2], challenge, proof)  # bound to the prover
        assert await ask(raw, headers) == (404, None)
