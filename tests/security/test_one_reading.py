"""One reading of every request: behind one injected key, the owner checks read a body or frame
as the upstream parses it, never as bytes.

The attack: ``{"previous\\u005fresponse_id": "<alice's id>"}`` is ``previous_response_id`` to every
JSON parser, the upstream's included, but not to a byte search; Bob continued Alice's stored
response over the WebSocket relay and read her text back, and ``POST /v1/responses/compact`` and
``/input_tokens`` forwarded it. Bodies that do not parse (NaN, a lone surrogate) were forwarded
unchecked, and a repeated key was read as orjson reads it (the last one), which another parser
need not. Each attack against a real sidecar process with the emulator upstream, beside the
control: Alice, the owner, goes on with her own response by any spelling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

from tests.reliability.helpers import Reply, assert_openai_error, auth, post, user
from tests.security.support import ALICE, BOB, MODEL, Tenant, injected_env, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

SECRET = "ALICE-SECRET-PLAN-escaped-9b2"
ESCAPED = '"previous\\u005fresponse_id"'
"""``previous_response_id`` with its ``_`` written as a JSON escape."""


def forwarded(emulator: Emulator) -> int:
    """Requests and frames the upstream received (a relay session's socket opening is not counted:
    the session opens it before the app sends anything)."""
    stats = emulator.stats
    return sum(stats.requests.values()) + int(stats.snapshot()["ws_frames_received"])


def raw_object(*members: tuple[str, Any]) -> str:
    """A JSON object written member by member: each key as spelled (quotes and escapes included,
    repeats kept), each value as JSON."""
    return "{" + ",".join(f"{key}:{orjson.dumps(value).decode()}" for key, value in members) + "}"


def create_frame(key: str, rid: str, **extra: str) -> str:
    """A relay ``response.create`` naming ``rid`` under the key spelled ``key``."""
    fields = [("type", "response.create"), ("model", MODEL), ("input", [user("go on")]), *extra.items()]
    return raw_object(*((f'"{k}"', v) for k, v in fields), (key, rid))


async def relay(http: aiohttp.ClientSession, api: str, key: str, frames: list[str]) -> list[dict[str, Any]]:
    """One relay session: send each frame, and collect events up to each frame's terminal event."""
    url = api.replace("http://", "ws://") + "/v1/responses"
    events: list[dict[str, Any]] = []
    async with http.ws_connect(url, headers=auth(key)) as ws:
        for frame in frames:
            await ws.send_str(frame)
            while True:
                msg = await ws.receive(timeout=15)
                assert msg.type is aiohttp.WSMsgType.TEXT, msg
                event = orjson.loads(msg.data)
                events.append(event)
                if event.get("type") in ("response.completed", "response.failed", "response.incomplete", "error"):
                    break
    return events


async def post_route(http: aiohttp.ClientSession, api: str, route: str, key: str, body: bytes) -> Reply:
    headers = {**auth(key), "Content-Type": "application/json"}
    async with http.post(f"{api}/v1/responses/{route}", data=body, headers=headers) as resp:
        return Reply(resp.status, resp.headers, await resp.read())


def assert_foreign_chain(reply: Reply, rid: str) -> None:
    error = assert_openai_error(reply, 400, "previous_response_not_found")
    assert error["message"] == f"Previous response with id '{rid}' not found."
    assert "x-upshift-mode" not in reply.headers, reply.headers  # answered here, not forwarded
    assert SECRET.encode() not in reply.raw


@pytest.fixture
async def sidecar(emulator: Emulator, spawn: Callable[..., SidecarProcess]) -> SidecarProcess:
    return await start_process(spawn, emulator.base_url, env=injected_env())


async def test_an_escaped_key_does_not_continue_another_tenants_response_over_the_relay(
    emulator: Emulator, sidecar: SidecarProcess, http: aiohttp.ClientSession
) -> None:
    alice = Tenant(ALICE, http)
    rid = (await alice.create(sidecar.api, SECRET, store=True))["id"]
    before = forwarded(emulator)
    for key in ('"previous_response_id"', ESCAPED):
        events = await relay(http, sidecar.api, BOB, [create_frame(key, rid, stream_id="lane-1")])
        assert [e["type"] for e in events] == ["error"], events
        error = events[0]
        assert error["status"] == 400 and error["stream_id"] == "lane-1", error
        assert error["error"]["code"] == "previous_response_not_found", error
        assert error["error"]["message"] == f"Previous response with id '{rid}' not found."
        assert SECRET not in orjson.dumps(events).decode()
    assert forwarded(emulator) == before  # no frame of Bob's reached the upstream
    # The control: Alice continues her own response by either spelling, and the model sees it.
    spellings = (ESCAPED, '"previous_response_id"')
    events = await relay(http, sidecar.api, ALICE, [create_frame(key, rid) for key in spellings])
    done = [e for e in events if e["type"] == "response.completed"]
    assert len(done) == 2, events
    assert all(e["response"]["previous_response_id"] == rid for e in done), done


async def test_a_nested_create_envelope_is_read_as_the_upstream_reads_it(
    emulator: Emulator, sidecar: SidecarProcess, http: aiohttp.ClientSession
) -> None:
    """``{"type": "response.create", "response": {...}}``: an upstream that takes the nested
    envelope reads the ids inside it, so the owner check reads them too."""
    alice = Tenant(ALICE, http)
    rid = (await alice.create(sidecar.api, SECRET, store=True))["id"]

    def nested(**outer: str) -> str:
        inner = {"model": MODEL, "input": [user("go on")], "previous_response_id": rid}
        return orjson.dumps({"type": "response.create", "response": inner, **outer}).decode()

    before = forwarded(emulator)
    events = await relay(http, sidecar.api, BOB, [nested(stream_id="lane-1")])
    assert [e["type"] for e in events] == ["error"], events
    assert events[0]["error"]["code"] == "previous_response_not_found", events
    # Two levels naming two different responses: refused for anyone, whichever level is read.
    events = await relay(http, sidecar.api, ALICE, [nested(previous_response_id="resp_other")])
    assert [e["type"] for e in events] == ["error"], events
    assert events[0]["error"]["code"] == "invalid_request_error", events
    assert forwarded(emulator) == before
    # The control: Alice's own nested frame goes upstream and continues her response.
    events = await relay(http, sidecar.api, ALICE, [nested()])
    done = [e for e in events if e["type"] == "response.completed"]
    assert len(done) == 1 and done[0]["response"]["previous_response_id"] == rid, events


@pytest.mark.parametrize("route", ["compact", "input_tokens"])
async def test_an_escaped_key_is_read_on_the_other_post_routes(
    sidecar: SidecarProcess, http: aiohttp.ClientSession, route: str
) -> None:
    alice = Tenant(ALICE, http)
    rid = (await alice.create(sidecar.api, SECRET, store=True))["id"]
    escaped = raw_object(('"model"', MODEL), (ESCAPED, rid), ('"input"', [])).encode()
    # A number no 64-bit parser holds: read all the same (as the upstream reads it), still Bob's.
    big = escaped.replace(b"{", b'{"n":123456789012345678901234567890,', 1)
    for body in (escaped, big):
        assert_foreign_chain(await post_route(http, sidecar.api, route, BOB, body), rid)
    # The control: Alice's own is relayed (the emulator has no such route: its own 405).
    own = await post_route(http, sidecar.api, route, ALICE, escaped)
    assert own.headers.get("x-upshift-mode") == "passthrough", (own.status, own.raw[:200])


UNREADABLE = {
    "nan": b'{"model":"m","temperature":NaN,"previous_response_id":"resp_x"}',
    "lone-surrogate": b'{"model":"m","instructions":"\\ud800","previous_response_id":"resp_x"}',
    "not-json": b'{"model":"m","previous_response_id":"resp_x"',
    "not-an-object": b'["previous_response_id","resp_x"]',
}


@pytest.mark.parametrize("name", list(UNREADABLE))
async def test_what_does_not_parse_is_refused_and_never_forwarded(
    emulator: Emulator, sidecar: SidecarProcess, http: aiohttp.ClientSession, name: str
) -> None:
    body = UNREADABLE[name]
    before = forwarded(emulator)
    for route in ("compact", "input_tokens"):
        reply = await post_route(http, sidecar.api, route, ALICE, body)
        error = assert_openai_error(reply, 400, "invalid_request_error")
        assert "x-upshift-mode" not in reply.headers, reply.headers
        assert error["type"] == "invalid_request_error", error
    events = await relay(http, sidecar.api, ALICE, [body.decode("utf-8")])
    assert [e["type"] for e in events] == ["error"], events
    assert events[0]["status"] == 400 and events[0]["error"]["code"] == "invalid_request_error", events
    assert forwarded(emulator) == before
    # The same session still relays what reads: the refusal took nothing down.
    frame = orjson.dumps({"type": "response.create", "model": MODEL, "input": [user("hi")]}).decode()
    events = await relay(http, sidecar.api, ALICE, [body.decode("utf-8"), frame])
    assert [e["type"] for e in events][0] == "error" and events[-1]["type"] == "response.completed", events


async def test_a_repeated_id_key_is_refused_on_every_route(
    emulator: Emulator, sidecar: SidecarProcess, http: aiohttp.ClientSession
) -> None:
    alice, bob = Tenant(ALICE, http), Tenant(BOB, http)
    rid = (await alice.create(sidecar.api, SECRET, store=True))["id"]
    own = (await bob.create(sidecar.api, "bob's own", store=True))["id"]
    before = forwarded(emulator)
    # orjson keeps the last of two keys, another parser the first: Bob's own id last, Alice's first.
    for first, second in (('"previous_response_id"', '"previous_response_id"'), (ESCAPED, '"previous_response_id"')):
        raw = raw_object(('"model"', MODEL), (first, rid), ('"input"', [user("x")]), (second, own))
        reply = await post(http, sidecar.api + "/v1", raw.encode(), key=BOB)
        error = assert_openai_error(reply, 400, "invalid_request_error")
        assert error["param"] == "previous_response_id", error
        for route in ("compact", "input_tokens"):
            assert_openai_error(await post_route(http, sidecar.api, route, BOB, raw.encode()), 400)
        frame = '{"type":"response.create",' + raw[1:]
        events = await relay(http, sidecar.api, BOB, [frame])
        assert [e["type"] for e in events] == ["error"], events
        assert events[0]["error"]["param"] == "previous_response_id", events
    # An item_reference whose type or id is repeated: the upstream would read an id unchecked.
    for item in ('{"type":"item_reference","id":"msg_a","id":"msg_b"}', '{"type":"item_reference","type":"message"}'):
        raw = '{"model":"' + MODEL + '","input":[' + item + "]}"
        assert_openai_error(await post(http, sidecar.api + "/v1", raw.encode(), key=BOB), 400, "invalid_request_error")
    assert forwarded(emulator) == before
    # The control: Bob continues his own response over HTTP and the relay.
    assert (await bob.chain(sidecar.api, own)).status == 200
    events = await relay(http, sidecar.api, BOB, [create_frame('"previous_response_id"', own)])
    assert events[-1]["type"] == "response.completed", events
