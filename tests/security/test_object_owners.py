"""Every stored object has an owner behind an injected key, not only responses.

The attack: behind one injected key, Bob reads Alice's conversation
(``GET /v1/conversations/{id}``), continues it (``conversation`` in ``POST /v1/responses``, which
would echo her text), references her items (``item_reference``), and lists and reads every
tenant's files and stored chat completions. Each against a real sidecar process with the
emulator upstream (whose store, keyed by the credential it receives, would serve Bob anything of
Alice's behind the one key: every refusal is the sidecar's), beside Alice's own use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

from tests.reliability.helpers import Reply, assert_openai_error, auth, post, user
from tests.security.support import ALICE, BOB, MODEL, forwarded, injected_env, relay_turn, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

SECRET = "alice conversation secret BRAVO-9"


async def call(
    http: aiohttp.ClientSession, method: str, api: str, path: str, key: str, body: Any = None, **kw: Any
) -> Reply:
    data = orjson.dumps(body) if body is not None else None
    headers = {**auth(key), **({"Content-Type": "application/json"} if data is not None else {})}
    async with http.request(method, api + path, data=data, headers=headers, **kw) as resp:
        return Reply(resp.status, resp.headers, await resp.read())


def assert_not_found(reply: Reply, kind: str, object_id: str) -> None:
    error = assert_openai_error(reply, 404, "object_not_found")
    assert error["message"] == f"No {kind} with id '{object_id}' found.", error
    assert "x-upshift-mode" not in reply.headers and SECRET.encode() not in reply.raw


async def test_another_tenants_conversation_is_neither_read_nor_continued(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    api = proc.api
    created = await call(http, "POST", api, "/v1/conversations", ALICE, {"items": [user(SECRET)]})
    assert created.status == 200, created.raw[:300]
    conv = created.json["id"]
    before = forwarded(emulator)
    # Bob: the route naming it, with and without a query string; a body naming it (both forms);
    # a relay frame naming it.
    for path in (f"/v1/conversations/{conv}", f"/v1/conversations/{conv}?limit=1"):
        assert_not_found(await call(http, "GET", api, path, BOB), "conversation", conv)
    for named in (conv, {"id": conv}):
        body = {"model": MODEL, "conversation": named, "input": [user("what did alice say?")]}
        reply = await post(http, api + "/v1", body, key=BOB)
        error = assert_openai_error(reply, 404, "object_not_found")
        assert error["param"] == "conversation" and SECRET.encode() not in reply.raw, error
    frame = {"type": "response.create", "model": MODEL, "conversation": conv, "input": [user("x")]}
    events = await relay_turn(http, api, BOB, frame)
    assert [e["type"] for e in events] == ["error"] and events[0]["status"] == 404, events
    assert events[0]["error"]["code"] == "object_not_found", events
    assert forwarded(emulator) == before  # nothing of Bob's reached the upstream
    # The control: Alice reads (a query string of a read included) and continues her own.
    for path in (f"/v1/conversations/{conv}", f"/v1/conversations/{conv}?limit=1"):
        assert (await call(http, "GET", api, path, ALICE)).status == 200
    body = {"model": MODEL, "conversation": conv, "input": [user("and then?")]}
    reply = await post(http, api + "/v1", body, key=ALICE)
    assert reply.status == 200 and reply.json["conversation"] == {"id": conv}, reply.raw[:300]
    events = await relay_turn(http, api, ALICE, frame)
    assert events[-1]["type"] == "response.completed", events


async def test_files_lists_and_item_references_are_the_creators_or_refused(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    api = proc.api
    form = aiohttp.FormData()
    form.add_field("purpose", "user_data")
    form.add_field("file", b"alice's file", filename="alice.txt")
    async with http.post(api + "/v1/files", data=form, headers=auth(ALICE)) as resp:
        assert resp.status == 200, await resp.text()
        file_id = (await resp.json())["id"]
    before = forwarded(emulator)
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
        assert_not_found(await call(http, "GET", api, path, BOB), "file", file_id)
    assert_not_found(await call(http, "DELETE", api, f"/v1/files/{file_id}", BOB), "file", file_id)
    # Lists of every tenant's objects: refused for anyone, naming the setting that opens them.
    for path, kind in (
        ("/v1/files", "files"),
        ("/v1/chat/completions", "chat_completions"),
        ("/v1/vector_stores", "vector_stores"),
        ("/v1/conversations", "conversations"),
    ):
        for key in (ALICE, BOB):
            error = assert_openai_error(await call(http, "GET", api, path, key), 403, "not_shared")
            assert f"identity.shared_objects: [{kind}]" in error["message"], error
    # An item_reference to an item the sidecar never saw created for Bob: refused behind the key.
    body = {"model": MODEL, "input": [{"type": "item_reference", "id": "msg_of_alice"}]}
    assert_not_found(await post(http, api + "/v1", body, key=BOB), "item", "msg_of_alice")
    assert forwarded(emulator) == before
    # The control: Alice's own file route is relayed (the emulator has no such route: its 404/405).
    own = await call(http, "GET", api, f"/v1/files/{file_id}", ALICE)
    assert own.headers.get("x-upshift-mode") == "passthrough", (own.status, own.raw[:200])


async def test_an_operator_shares_what_it_lists(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    env = injected_env(UPSHIFT_IDENTITY_SHARED_OBJECTS="chat_completions,items")
    proc = await start_process(spawn, emulator.base_url, env=env)
    listed = await call(http, "GET", proc.api, "/v1/chat/completions", BOB)
    assert listed.headers.get("x-upshift-mode") == "passthrough", (listed.status, listed.raw[:200])
    created = await post(http, proc.api + "/v1", {"model": MODEL, "input": [user("hi")], "store": True}, key=ALICE)
    item = created.json["output"][0]["id"]
    body = {"model": MODEL, "input": [{"type": "item_reference", "id": item}]}
    reply = await post(http, proc.api + "/v1", body, key=BOB)
    assert reply.status == 200, reply.raw[:300]  # shared: the upstream resolves it
    # What is not listed stays walled.
    assert_openai_error(await call(http, "GET", proc.api, "/v1/files", BOB), 403, "not_shared")


async def test_a_file_or_vector_store_named_in_a_body_is_the_creators_or_refused(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    form = aiohttp.FormData()
    form.add_field("purpose", "user_data")
    form.add_field("file", b"alice's file", filename="alice.txt")
    async with http.post(proc.api + "/v1/files", data=form, headers=auth(ALICE)) as resp:
        file_id = (await resp.json())["id"]

    def asking(about: str, tools: list[Any] | None = None) -> dict[str, Any]:
        part = {"type": "input_file", "file_id": about}
        content = [{"type": "input_text", "text": "summarise"}, part]
        return {"model": MODEL, "input": [{"role": "user", "content": content}], **({"tools": tools} if tools else {})}

    before = forwarded(emulator)
    reply = await post(http, proc.api + "/v1", asking(file_id), key=BOB)
    error = assert_openai_error(reply, 404, "object_not_found")
    assert error["param"] == "input" and file_id in error["message"], error
    frame = {"type": "response.create", **asking(file_id)}
    events = await relay_turn(http, proc.api, BOB, frame)
    assert [e["type"] for e in events] == ["error"] and events[0]["error"]["code"] == "object_not_found", events
    # A vector store no tenant created through the sidecar: refused behind the key (fail closed).
    tools = [{"type": "file_search", "vector_store_ids": ["vs_made_elsewhere"]}]
    body = {"model": MODEL, "input": [user("search")], "tools": tools}
    error = assert_openai_error(await post(http, proc.api + "/v1", body, key=ALICE), 404, "object_not_found")
    assert error["param"] == "tools", error
    assert forwarded(emulator) == before
    # The control: Alice's own file is hers to use.
    reply = await post(http, proc.api + "/v1", asking(file_id), key=ALICE)
    assert reply.status == 200, reply.raw[:300]
