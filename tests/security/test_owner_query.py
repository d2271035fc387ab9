"""The owner query (``GET /_upshift/owner``) answers only the processes it exists for: its own
workers on their private sockets, replicas signing with the cluster secret, and without a secret
replicas at a peer set member's address. Any other caller, marker or not, gets the 404 of an
unknown route, the same for an id that exists and one that does not: no id-existence oracle."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from proxy.ingress.creator_queries import QUERY_PATH
from tests.security.support import ALICE, BOB, Tenant, injected_env, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # A fresh connection per request: with --workers, SO_REUSEPORT spreads them over the workers.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


async def _ask(http: aiohttp.ClientSession, api: str, rid: str, marker: str | None) -> tuple[int, str]:
    headers = {"x-upshift-forwarded": marker} if marker is not None else {}
    async with http.get(f"{api}{QUERY_PATH}?id={rid}&identity=x", headers=headers) as resp:
        return resp.status, await resp.text()


@pytest.mark.parametrize("injected", [True, False], ids=["injected-key", "own-keys"])
async def test_a_single_sidecar_answers_no_client_whether_an_id_exists(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession, injected: bool
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env() if injected else {})
    rid = (await Tenant(ALICE, http).create(proc.api, "alice's text", store=True))["id"]
    # The attack: any client asks with a made-up marker; "foreign" told it the id exists.
    for marker in ("replica;x;;;", "replica;owner-1;1;2;3", None):
        known = await _ask(http, proc.api, rid, marker)
        unknown = await _ask(http, proc.api, "resp_" + "0" * 48, marker)
        assert known[0] == 404 and "verdict" not in known[1], (marker, known)
        assert known == unknown, (known, unknown)


async def test_workers_still_learn_owners_from_each_other(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    # The control: with --workers the query goes over the private sockets, so a worker that did
    # not create the id still answers Alice and refuses Bob (behind the injected key, an id whose
    # owner stays unknown is refused: Alice's 200 on every landing shows the answer came).
    proc = await start_process(spawn, emulator.base_url, "--workers", "2", env=injected_env())
    alice, bob = Tenant(ALICE, http), Tenant(BOB, http)
    rid = (await alice.create(proc.api, "alice's text", store=True))["id"]
    for _ in range(6):
        assert (await alice.get(proc.api, rid)).status == 200
        assert (await bob.get(proc.api, rid)).status == 404
    status, text = await _ask(http, proc.api, rid, "replica;x;;;")
    assert status == 404 and "verdict" not in text
