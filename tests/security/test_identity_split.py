"""Every limit shared between callers is keyed by what a caller cannot vary for free: its
credential. The query string (and ``OpenAI-Beta``/``OpenAI-Project``/``OpenAI-Organization``)
stays part of the upstream identity; were the limits keyed by that identity, each query string
would mint a new share of every per-identity limit: one key could hold every relay slot through
8 query strings (no idle timeout), so another tenant's relay would close 1013 and its turns lose
the pool, and 40 one-conversation identities would make another tenant "the heaviest", whose
next turns would all go full.
Real sidecar processes on loopback with small limits, the emulator upstream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict

from proxy.core.budget import FairShares
from proxy.intake.identity import Identity, identify
from proxy.serve.relay import RELAY_REFUSED_CODE
from tests.reliability.helpers import user
from tests.security.support import MODEL, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(150)

ATTACKER, VICTIM = "sk-tenant-mallory-0123456789", "sk-tenant-victim-9876543210"
SMALL = {
    "UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY": "4",
    "UPSHIFT_POOL_MAX_SOCKETS_TOTAL": "12",
    "UPSHIFT_MATCHING_MAX_HEADS": "16",
}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _relay_turn(ws: aiohttp.ClientWebSocketResponse, text: str) -> dict[str, Any]:
    await ws.send_str(orjson.dumps({"type": "response.create", "model": MODEL, "input": [user(text)]}).decode())
    while True:
        msg = await ws.receive(timeout=15)
        assert msg.type is aiohttp.WSMsgType.TEXT, (msg, ws.close_code)
        event: dict[str, Any] = orjson.loads(msg.data)
        assert event["type"] != "error", event
        if event["type"] == "response.completed":
            return event


async def _open_or_refused(http: aiohttp.ClientSession, url: str, key: str) -> aiohttp.ClientWebSocketResponse | str:
    """A relay session that works, or the reason of its 1013."""
    ws = await http.ws_connect(url, headers=_auth(key))
    try:
        await _relay_turn(ws, "hello")
    except AssertionError:
        assert ws.close_code == RELAY_REFUSED_CODE, ws.close_code
        return "refused"
    return ws


async def _first_turn(http: aiohttp.ClientSession, api: str, key: str, text: str, query: str = "") -> list[Any]:
    body = {"model": MODEL, "input": [user(text)], "store": False}
    async with http.post(f"{api}/v1/responses{query}", headers=_auth(key), json=body) as resp:
        assert resp.status == 200, await resp.text()
        out = (await resp.json())["output"]
    history: list[Any] = [user(text)]
    return [*history, *({k: v for k, v in o.items() if k != "status"} for o in out)]


async def test_one_key_split_into_40_identities_leaves_another_tenants_relay_and_conversations_alone(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=SMALL)
    ws_url = proc.api.replace("http://", "ws://") + "/v1/responses"
    # The victim's four hot conversations (first turns over the pool).
    convs = [await _first_turn(http, proc.api, VICTIM, f"victim conversation {i}") for i in range(4)]

    # (a) Relay slots: one key through 8 query strings. Its quota (4) is its credential's.
    held = [await _open_or_refused(http, f"{ws_url}?slot={i}", ATTACKER) for i in range(8)]
    sessions = [ws for ws in held if not isinstance(ws, str)]
    assert len(sessions) <= 4, len(sessions)
    # Another tenant's relay opens and works.
    victim_ws = await _open_or_refused(http, ws_url, VICTIM)
    assert not isinstance(victim_ws, str), "the victim's relay was refused"

    # (b) Heads: 40 one-conversation identities of the same key (max_heads 16).
    for i in range(40):
        await _first_turn(http, proc.api, ATTACKER, f"attacker {i}", f"?split={i}")

    # The victim's next turns still continue, and its relay still works.
    modes = []
    for history in convs:
        body = {"model": MODEL, "input": [*history, user("next")], "store": False}
        async with http.post(proc.api + "/v1/responses", headers=_auth(VICTIM), json=body) as resp:
            assert resp.status == 200, await resp.text()
            modes.append(resp.headers["x-upshift-mode"])
    await _relay_turn(victim_ws, "still here")
    for ws in [*sessions, victim_ws]:
        await ws.close()
    assert modes == ["continuation"] * 4, modes


async def test_40_identities_of_one_key_make_no_other_tenant_the_heaviest(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    # The heads alone (no relay): at matching.max_heads and pool.max_sockets_total the heaviest
    # tenant gives up its heads and sockets first; 40 query strings of one key are one tenant.
    proc = await start_process(spawn, emulator.base_url, env=SMALL)
    convs = [await _first_turn(http, proc.api, VICTIM, f"victim conversation {i}") for i in range(4)]
    attacker = [await _first_turn(http, proc.api, ATTACKER, f"attacker {i}", f"?split={i}") for i in range(40)]
    modes = []
    for history in convs:
        body = {"model": MODEL, "input": [*history, user("next")], "store": False}
        async with http.post(proc.api + "/v1/responses", headers=_auth(VICTIM), json=body) as resp:
            assert resp.status == 200, await resp.text()
            modes.append(resp.headers["x-upshift-mode"])
    assert modes == ["continuation"] * 4, modes
    # The control: the attacker's most recent conversation (its own identity) still continues.
    body = {"model": MODEL, "input": [*attacker[-1], user("next")], "store": False}
    async with http.post(proc.api + "/v1/responses?split=39", headers=_auth(ATTACKER), json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-upshift-mode"] == "continuation"


async def test_one_key_alone_still_gets_its_full_quota_and_an_idle_relay_is_closed(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    # The control: the legitimate path. A key's own sessions up to its quota work, whatever
    # query strings they carry; a session idle for pool.idle_close_seconds is closed and its
    # slot is free again, while a session in use stays open.
    env = {**SMALL, "UPSHIFT_POOL_IDLE_CLOSE_SECONDS": "2"}
    proc = await start_process(spawn, emulator.base_url, env=env)
    ws_url = proc.api.replace("http://", "ws://") + "/v1/responses"
    sessions = [await _open_or_refused(http, f"{ws_url}?api-version={i}", VICTIM) for i in range(4)]
    assert all(not isinstance(ws, str) for ws in sessions), sessions
    assert await _open_or_refused(http, ws_url, VICTIM) == "refused"  # its fifth: over its quota
    busy = sessions[0]
    assert not isinstance(busy, str)
    began = time.monotonic()
    while time.monotonic() - began < 3.5:  # the busy one keeps talking; the others go idle
        await _relay_turn(busy, "busy")
        await asyncio.sleep(0.5)
    for ws in sessions[1:]:
        assert not isinstance(ws, str)
        msg = await ws.receive(timeout=5)
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1001, (msg, ws.close_code)
        assert "idle" in str(msg.extra), msg
    assert not busy.closed
    again = await _open_or_refused(http, ws_url, VICTIM)  # the freed slots are usable
    assert not isinstance(again, str)
    for ws in (busy, again):
        await ws.close()


def test_the_tenant_is_the_credential_alone_and_the_identity_still_partitions() -> None:
    upstream = "http://127.0.0.1:9/v1"

    def ident(headers: dict[str, str], query: str = "") -> Identity:
        key = headers.get("Authorization")
        return identify(CIMultiDict(headers), upstream=upstream, authorization=key, query=query)

    base = ident(_auth(ATTACKER))
    variants = [
        ident(_auth(ATTACKER), "split=1"),
        ident({**_auth(ATTACKER), "OpenAI-Project": "proj_2"}),
        ident({**_auth(ATTACKER), "OpenAI-Beta": "responses=v9", "OpenAI-Organization": "org_3"}),
    ]
    # Partitions apart (sockets and heads never shared), one tenant (one quota, one share).
    assert len({base.digest, *(v.digest for v in variants)}) == 4
    assert {v.tenant for v in variants} == {base.tenant} and not base.keyless
    assert ident(_auth(VICTIM)).tenant != base.tenant
    assert ident({"api-key": ATTACKER}).tenant != base.tenant  # another header, another credential
    # No credential at all: one keyless tenant, whatever else is sent.
    keyless = [ident({}), ident({}, "x=1"), ident({"OpenAI-Project": "p"})]
    assert all(k.keyless for k in keyless) and len({k.tenant for k in keyless}) == 1
    # Fair shares group by tenant: 40 split identities are one group, the heaviest.
    fair = FairShares()
    for n in range(4):
        fair.add(ident(_auth(VICTIM)).digest, f"victim-{n}")
    for n in range(40):
        fair.add(ident(_auth(ATTACKER), f"split={n}").digest, f"attacker-{n}")
    assert fair.victim() == "attacker-0"
    assert fair.total(base.digest) == 40
