"""Tenant walls: behind one injected key, tenant B can never read, continue, delete or
cancel tenant A's responses, on any route, whichever process or replica B's request lands on;
A's own access keeps working (the control of every attack).

Every sidecar here is a real ``python -m proxy`` process on loopback with the emulator as the
upstream, started with the defaults a user has plus the injected key the issue is about. The
emulator's store is keyed by the credential it receives, so behind the injected key it would
serve B anything of A's: every refusal below is the sidecar's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from tests.reliability.helpers import Reply, assert_openai_error, user
from tests.security.support import (
    ALICE,
    BOB,
    MODEL,
    Tenant,
    injected_env,
    relay_turn,
    start_process,
    start_replicas,
)
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

SECRET = "ALICE-SECRET-PLAN-7c1e"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # A fresh connection per request: with --workers, SO_REUSEPORT spreads them over the workers.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


def assert_not_found(reply: Reply, rid: str) -> None:
    """The upstream's own 404 for an unknown id: nothing says the id exists."""
    error = assert_openai_error(reply, 404)
    assert error == {
        "message": f"Response with id '{rid}' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert SECRET.encode() not in reply.raw


def assert_foreign_chain(reply: Reply, rid: str) -> None:
    error = assert_openai_error(reply, 400, "previous_response_not_found")
    assert error["message"] == f"Previous response with id '{rid}' not found."
    assert error["param"] == "previous_response_id"


async def assert_walls(api_a: str, apis_b: list[str], alice: Tenant, bob: Tenant, rid: str) -> None:
    """Bob is refused on every route naming ``rid`` at each of ``apis_b``; Alice's response is
    intact afterwards and her own access works at each of them."""
    for api in apis_b:
        assert_not_found(await bob.get(api, rid), rid)
        assert_not_found(await bob.input_items(api, rid), rid)
        assert_not_found(await bob.cancel(api, rid), rid)
        assert_not_found(await bob.delete(api, rid), rid)
        assert_foreign_chain(await bob.chain(api, rid), rid)
    for api in [api_a, *apis_b]:
        own = await alice.get(api, rid)
        assert own.status == 200, (api, own.status, own.raw[:300])
        assert own.json["id"] == rid
        items = await alice.input_items(api, rid)
        assert items.status == 200 and SECRET in items.raw.decode(), (api, items.raw[:300])
        assert (await alice.chain(api, rid)).status == 200


async def test_every_route_refuses_another_tenants_id_created_on_a_pooled_lane(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    alice, bob = Tenant(ALICE, http), Tenant(BOB, http)
    response = await alice.create(proc.api, SECRET)
    assert response["id"], response
    await assert_walls(proc.api, [proc.api], alice, bob, response["id"])
    # The relay's response.create is refused the same way; Alice's own goes through.
    frame = {"type": "response.create", "model": MODEL, "previous_response_id": response["id"], "input": [user("x")]}
    events = await relay_turn(http, proc.api, BOB, frame)
    assert [e["type"] for e in events] == ["error"], events
    assert events[0]["status"] == 400 and events[0]["error"]["code"] == "previous_response_not_found", events
    assert events[0]["error"]["message"] == f"Previous response with id '{response['id']}' not found."
    events = await relay_turn(http, proc.api, ALICE, frame)
    assert events[-1]["type"] == "response.completed", events
    # An id no tenant created through this sidecar: refused (fail closed), not forwarded.
    assert_not_found(await alice.get(proc.api, "resp_never_made_here"), "resp_never_made_here")
    assert_foreign_chain(await alice.chain(proc.api, "resp_never_made_here"), "resp_never_made_here")
    # Finally Alice deletes her own response: only she could.
    assert (await alice.delete(proc.api, response["id"])).status == 200
    assert (await alice.get(proc.api, response["id"])).status == 404


@pytest.mark.parametrize(
    "fields",
    [{"background": True}, {"background": True, "stream": True}],
    ids=["http-json", "http-sse"],
)
async def test_ids_created_over_http_passthrough_have_an_owner(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession, fields: dict[str, bool]
) -> None:
    # background: true always goes over plain HTTP; its id is sniffed from the JSON body or the
    # first SSE event on the way to the app.
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    alice, bob = Tenant(ALICE, http), Tenant(BOB, http)
    created = await alice.create(proc.api, SECRET, **fields)
    rid = created["id"]
    for _ in range(100):  # the background response finishes on its own
        if (await alice.get(proc.api, rid)).json.get("status") == "completed":
            break
    await assert_walls(proc.api, [proc.api], alice, bob, rid)


async def test_ids_created_over_the_websocket_relay_have_an_owner(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    alice, bob = Tenant(ALICE, http), Tenant(BOB, http)
    frame = {"type": "response.create", "model": MODEL, "store": True, "input": [user(SECRET)]}
    events = await relay_turn(http, proc.api, ALICE, frame)
    assert events[-1]["type"] == "response.completed", events
    rid = events[-1]["response"]["id"]
    await assert_walls(proc.api, [proc.api], alice, bob, rid)
    chained = dict(frame, previous_response_id=rid, input=[user("more")])
    refused = await relay_turn(http, proc.api, BOB, chained)
    assert refused[-1]["type"] == "error" and refused[-1]["error"]["code"] == "previous_response_not_found"


async def test_three_workers_refuse_bob_wherever_his_request_lands(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    # Fresh connections land on any of the three workers; two in three of them did not create
    # the id. Fail closed, Alice's own access succeeding on every landing shows that the worker
    # that did not create the id learned its owner from the one that did; Bob's is refused on all.
    proc = await start_process(spawn, emulator.base_url, "--workers", "3", env=injected_env())
    alice, bob = Tenant(ALICE, http), Tenant(BOB, http)
    rid = (await alice.create(proc.api, SECRET))["id"]
    await assert_walls(proc.api, [proc.api] * 4, alice, bob, rid)
    for _ in range(6):
        assert (await alice.get(proc.api, rid)).status == 200
        assert_not_found(await bob.get(proc.api, rid), rid)


@pytest.mark.parametrize("secret", [False, True], ids=["unsigned", "signed"])
async def test_three_replicas_refuse_bob_on_the_replicas_that_did_not_create_the_id(
    emulator: Emulator,
    spawn: Callable[..., SidecarProcess],
    http: aiohttp.ClientSession,
    tmp_path: Path,
    secret: bool,
) -> None:
    # Signed: the replicas share cluster.secret_file, so their owner queries are signed and
    # verified as forwards are (Alice's access on the replicas that did not create the id
    # shows the signed query was accepted; Bob's refusal that its verdict was used).
    env = injected_env()
    if secret:
        (tmp_path / "secret").write_text("tenants-cluster-secret-0123456789\n")
        env["UPSHIFT_CLUSTER_SECRET_FILE"] = str(tmp_path / "secret")
    procs = await start_replicas(spawn, emulator.base_url, 3, env)
    alice, bob = Tenant(ALICE, http), Tenant(BOB, http)
    # Self-chained and background requests are served where they land: replica 0 creates it.
    rid = (await alice.create(procs[0].api, SECRET, background=True))["id"]
    for _ in range(100):
        if (await alice.get(procs[0].api, rid)).json.get("status") == "completed":
            break
    others = [p.api for p in procs[1:]]
    await assert_walls(procs[0].api, others, alice, bob, rid)
    # The relay on a replica that did not create the id asks the one that did.
    frame = {"type": "response.create", "model": MODEL, "previous_response_id": rid, "input": [user("x")]}
    refused = await relay_turn(http, others[0], BOB, frame)
    assert refused[-1]["type"] == "error" and refused[-1]["error"]["code"] == "previous_response_not_found"
    allowed = await relay_turn(http, others[1], ALICE, frame)
    assert allowed[-1]["type"] == "response.completed", allowed


async def test_an_owner_query_not_signed_with_the_cluster_secret_is_refused(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # The attack: a process that is not a replica (no secret) asks a replica whose an id is,
    # with a bare marker, a marker signed with another secret, and a replayed genuine-looking
    # one. Each gets the 404 of an unknown route, never a verdict.
    from proxy.ingress.creator_queries import QUERY_PATH
    from proxy.ingress.peerauth import PeerAuth

    (tmp_path / "secret").write_text("tenants-cluster-secret-0123456789\n")
    env = injected_env(UPSHIFT_CLUSTER_SECRET_FILE=str(tmp_path / "secret"))
    procs = await start_replicas(spawn, emulator.base_url, 2, env)
    alice = Tenant(ALICE, http)
    rid = (await alice.create(procs[0].api, SECRET, background=True))["id"]
    query = f"{QUERY_PATH}?id={rid}&identity=x"
    wrong = PeerAuth((b"not-the-cluster-secret",)).marker("GET", query, b"", "owner-forged")
    for marker in (None, "replica;owner-forged;;;", wrong):
        headers = {"x-upshift-forwarded": marker} if marker is not None else {}
        async with http.get(procs[0].api + query, headers=headers) as resp:
            assert resp.status == 404, (marker, resp.status, await resp.text())
            assert "verdict" not in await resp.text()
    # The control: signed with the cluster's secret, the same query is answered (once).
    right = PeerAuth((b"tenants-cluster-secret-0123456789",)).marker("GET", query, b"", "owner-real")
    async with http.get(procs[0].api + query, headers={"x-upshift-forwarded": right}) as resp:
        assert resp.status == 200 and (await resp.json())["verdict"] in ("foreign", "unknown")
    async with http.get(procs[0].api + query, headers={"x-upshift-forwarded": right}) as resp:
        assert resp.status == 404  # a replay of a genuine query
