"""Object ids named anywhere, and objects created anywhere, are their tenant's behind an injected key.

The attacks: behind one injected key Bob added Alice's file to his own vector store (``file_id``
of ``POST /v1/vector_stores/{id}/files``, ``file_ids`` of a file batch or a new store), handed it
to a code interpreter (``container.file_ids``) or a tool output (``input_file`` in a
``function_call_output``) or a chat completion, and counted the tokens of Alice's conversation
(``conversation`` of ``/v1/responses/input_tokens``): the sidecar read none of those bodies. And
the legitimate side: Alice's own streamed chat completion, the file of her completed upload, the
items she added to her conversation and the output items of her responses were refused to her
(their ids were never recorded, or ``item_reference`` was refused outright), and her own ids were
refused to her when she sent another ``OpenAI-Project``/``OpenAI-Beta`` header than when she
created them (the owner was the whole identity, not the tenant). Each against a real sidecar
process with the emulator upstream (whose store, keyed by the one key it receives, would serve
Bob anything of Alice's: every refusal is the sidecar's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

from tests.reliability.helpers import Reply, assert_openai_error, auth, post, user
from tests.security.support import ALICE, BOB, MODEL, call, forwarded, injected_env, relay_turn, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

SECRET = "alice's secret CHARLIE-7"


def refused(reply: Reply, noun: str, object_id: str, param: str | None) -> None:
    """The sidecar's own 404 for an object not the caller's (nothing forwarded)."""
    error = assert_openai_error(reply, 404, "object_not_found")
    assert error["message"] == f"No {noun} with id '{object_id}' found." and error["param"] == param, error
    assert "x-upshift-mode" not in reply.headers, reply.headers


async def upload_file(http: aiohttp.ClientSession, api: str, key: str) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "user_data")
    form.add_field("file", SECRET.encode(), filename="secret.txt")
    async with http.post(api + "/v1/files", data=form, headers=auth(key)) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["id"])


def asking(*content: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": [{"role": "user", "content": [*content]}], **fields}


async def test_an_object_id_in_the_body_of_another_route_is_the_creators(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    v1 = proc.api + "/v1"
    alice_file, bob_file = await upload_file(http, proc.api, ALICE), await upload_file(http, proc.api, BOB)
    bob_store = (await call(http, "POST", v1 + "/vector_stores", BOB, {"name": "bob's"})).json["id"]
    conv = (await call(http, "POST", v1 + "/conversations", ALICE, {"items": [user(SECRET)]})).json["id"]
    interpreter = {"type": "code_interpreter", "container": {"type": "auto", "file_ids": [alice_file]}}
    tool_output = {
        "type": "function_call_output",
        "call_id": "call_1",
        "output": [{"type": "input_file", "file_id": alice_file}],
    }
    chat_part = {"type": "file", "file": {"file_id": alice_file}}
    before = forwarded(emulator)
    for path, body, noun, object_id, param in (
        (f"/vector_stores/{bob_store}/files", {"file_id": alice_file}, "file", alice_file, "file_id"),
        (
            f"/vector_stores/{bob_store}/file_batches",
            {"file_ids": [bob_file, alice_file]},
            "file",
            alice_file,
            "file_ids",
        ),
        ("/vector_stores", {"name": "copy", "file_ids": [alice_file]}, "file", alice_file, "file_ids"),
        (
            "/responses/input_tokens",
            {"model": MODEL, "conversation": conv, "input": "x"},
            "conversation",
            conv,
            "conversation",
        ),
        ("/responses", {"model": MODEL, "input": "run it", "tools": [interpreter]}, "file", alice_file, "tools"),
        ("/responses", {"model": MODEL, "input": [tool_output]}, "file", alice_file, "input"),
        (
            "/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": [chat_part]}]},
            "file",
            alice_file,
            "messages",
        ),
    ):
        refused(await call(http, "POST", v1 + path, BOB, body), noun, object_id, param)
    # A container no tenant created through the sidecar: refused behind the key (fail closed).
    tools = [{"type": "code_interpreter", "container": "cntr_made_elsewhere"}]
    reply = await call(http, "POST", v1 + "/responses", BOB, {"model": MODEL, "input": "x", "tools": tools})
    refused(reply, "container", "cntr_made_elsewhere", "tools")
    # Any spelling of the key is the key; a repeated key or a body that does not parse is refused.
    escaped = b'{"file\\u005fid": "' + alice_file.encode() + b'"}'
    refused(
        await call(http, "POST", v1 + f"/vector_stores/{bob_store}/files", BOB, escaped), "file", alice_file, "file_id"
    )
    repeated = b'{"file_id": "%s", "file_id": "%s"}' % (alice_file.encode(), bob_file.encode())
    error = assert_openai_error(await call(http, "POST", v1 + f"/vector_stores/{bob_store}/files", BOB, repeated), 400)
    assert "repeats the key 'file_id'" in error["message"], error
    assert_openai_error(
        await call(http, "POST", v1 + f"/vector_stores/{bob_store}/files", BOB, b'{"file_id": NaN}'), 400
    )
    # The type a body declares does not decide: an upstream may parse JSON whatever it says.
    async with http.post(
        v1 + f"/vector_stores/{bob_store}/files",
        data=orjson.dumps({"file_id": alice_file}),
        headers={**auth(BOB), "Content-Type": "application/octet-stream"},
    ) as resp:
        refused(Reply(resp.status, resp.headers, await resp.read()), "file", alice_file, "file_id")
    # Over the relay too.
    frame = {"type": "response.create", "model": MODEL, "input": "run it", "tools": [interpreter]}
    events = await relay_turn(http, proc.api, BOB, frame)
    assert [e["type"] for e in events] == ["error"] and events[0]["error"]["code"] == "object_not_found", events
    assert forwarded(emulator) == before  # nothing of Bob's reached the upstream
    # The control: each with its own objects.
    reply = await call(http, "POST", v1 + f"/vector_stores/{bob_store}/files", BOB, {"file_id": bob_file})
    assert reply.status == 200 and reply.json["id"] == bob_file, reply.raw[:300]
    reply = await call(http, "POST", v1 + "/vector_stores", ALICE, {"name": "alice's", "file_ids": [alice_file]})
    assert reply.status == 200, reply.raw[:300]
    alice_store = reply.json["id"]
    for path, body in (
        (f"/vector_stores/{alice_store}/files", {"file_id": alice_file}),
        (f"/vector_stores/{alice_store}/file_batches", {"file_ids": [alice_file]}),
        ("/responses/input_tokens", {"model": MODEL, "conversation": conv, "input": "x"}),
        ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [chat_part]}]}),
    ):
        reply = await call(http, "POST", v1 + path, ALICE, body)
        assert reply.status == 200 and reply.headers.get("x-upshift-mode") == "passthrough", (path, reply.raw[:300])
    reply = await call(http, "POST", v1 + "/responses", ALICE, {"model": MODEL, "input": [tool_output]})
    assert "x-upshift-mode" in reply.headers, reply.raw[:300]  # forwarded: the upstream judges it


async def test_objects_created_under_an_owned_object_are_the_creators(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    v1 = proc.api + "/v1"
    start = {"filename": "notes.txt", "bytes": 3, "purpose": "user_data", "mime_type": "text/plain"}
    upload = (await call(http, "POST", v1 + "/uploads", ALICE, start)).json["id"]
    refused(await call(http, "POST", v1 + f"/uploads/{upload}/complete", BOB, {"part_ids": []}), "upload", upload, None)
    done = await call(http, "POST", v1 + f"/uploads/{upload}/complete", ALICE, {"part_ids": []})
    assert done.status == 200, done.raw[:300]
    file_id = done.json["file"]["id"]
    part = {"type": "input_file", "file_id": file_id}
    refused(await post(http, v1, asking(part), key=BOB), "file", file_id, "input")
    reply = await post(http, v1, asking({"type": "input_text", "text": "read it"}, part), key=ALICE)
    assert reply.status == 200, reply.raw[:300]  # the file of her upload is hers
    # Items added to a conversation are its owner's (item_reference).
    conv = (await call(http, "POST", v1 + "/conversations", ALICE, {})).json["id"]
    added = await call(http, "POST", v1 + f"/conversations/{conv}/items", ALICE, {"items": [user(SECRET)]})
    assert added.status == 200, added.raw[:300]
    item = added.json["data"][0]["id"]
    body = {"model": MODEL, "input": [{"type": "item_reference", "id": item}, user("repeat it")]}
    refused(await post(http, v1, body, key=BOB), "item", item, "input")
    refused(
        await call(http, "POST", v1 + f"/conversations/{conv}/items", BOB, {"items": [user("x")]}),
        "conversation",
        conv,
        None,
    )
    reply = await post(http, v1, body, key=ALICE)
    assert reply.status == 200, reply.raw[:300]  # the upstream resolved it for her


async def test_a_streamed_chat_completion_is_its_creators(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    v1 = proc.api + "/v1"
    ids = []
    for stream in (True, False):
        body = {"model": MODEL, "messages": [user(SECRET)], "store": True, "stream": stream}
        reply = await call(http, "POST", v1 + "/chat/completions", ALICE, body)
        assert reply.status == 200, reply.raw[:300]
        if stream:
            first = reply.raw.split(b"\n\n")[0].removeprefix(b"data: ")
            ids.append(orjson.loads(first)["id"])
        else:
            ids.append(reply.json["id"])
    for completion in ids:
        refused(
            await call(http, "GET", v1 + f"/chat/completions/{completion}", BOB), "chat completion", completion, None
        )
        own = await call(http, "GET", v1 + f"/chat/completions/{completion}", ALICE)
        assert own.status == 200 and own.json["id"] == completion, own.raw[:300]


async def test_output_items_of_the_callers_responses_are_its_to_reference(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    v1 = proc.api + "/v1"
    created = await post(http, v1, {"model": MODEL, "input": [user(SECRET)], "store": True}, key=ALICE)
    assert created.status == 200, created.raw[:300]
    item = created.json["output"][0]["id"]
    frame = {"type": "response.create", "model": MODEL, "input": [user("over the relay")], "store": True}
    events = await relay_turn(http, proc.api, ALICE, frame)
    relayed = next(e["item"]["id"] for e in events if e["type"] == "response.output_item.added")
    # A response in a conversation is relayed over plain HTTP: its streamed output items too.
    conv = (await call(http, "POST", v1 + "/conversations", ALICE, {})).json["id"]
    body = {"model": MODEL, "conversation": conv, "input": [user("in a conversation")], "stream": True}
    streamed = await post(http, v1, body, key=ALICE)
    assert streamed.status == 200 and streamed.headers.get("x-upshift-mode") == "passthrough", streamed.raw[:300]
    added = [b for b in streamed.raw.split(b"\n\n") if b"response.output_item.added" in b]
    in_conversation = orjson.loads(added[0].split(b"data: ", 1)[1])["item"]["id"]
    before = forwarded(emulator)
    for named in (item, relayed, in_conversation):
        body = {"model": MODEL, "input": [{"type": "item_reference", "id": named}, user("again")]}
        refused(await post(http, v1, body, key=BOB), "item", named, "input")
        events = await relay_turn(http, proc.api, BOB, {"type": "response.create", **body})
        assert [e["type"] for e in events] == ["error"] and events[0]["error"]["code"] == "object_not_found", events
    assert forwarded(emulator) == before
    for named in (item, relayed, in_conversation):  # the control: Alice's own, over HTTP and the relay
        body = {"model": MODEL, "input": [{"type": "item_reference", "id": named}, user("again")]}
        reply = await post(http, v1, body, key=ALICE)
        assert reply.status == 200, reply.raw[:300]
        events = await relay_turn(http, proc.api, ALICE, {"type": "response.create", **body})
        assert events[-1]["type"] == "response.completed", events


async def test_the_owner_of_an_object_is_its_tenant_whatever_its_optional_headers(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], http: aiohttp.ClientSession
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=injected_env())
    v1 = proc.api + "/v1"
    first = {"OpenAI-Project": "proj_one", "OpenAI-Beta": "responses=v1"}
    body = {"model": MODEL, "input": [user(SECRET)], "store": True}
    created = await post(http, v1, body, key=ALICE, headers=first)
    assert created.status == 200, created.raw[:300]
    rid = created.json["id"]
    conv = (await call(http, "POST", v1 + "/conversations?x=1", ALICE, {}, first)).json["id"]
    for headers in ({"OpenAI-Project": "proj_two"}, {"OpenAI-Beta": "something=else"}, {}):
        # Another project header, beta header or none: the same tenant, its own ids.
        own = await call(
            http, "GET", v1 + f"/responses/{rid}?include[]=message.output_text.logprobs", ALICE, None, headers
        )
        assert own.status == 200 and own.json["id"] == rid, own.raw[:300]
        reply = await post(
            http, v1, {"model": MODEL, "previous_response_id": rid, "input": [user("on")]}, key=ALICE, headers=headers
        )
        assert reply.status == 200, reply.raw[:300]
        own = await call(http, "GET", v1 + f"/conversations/{conv}", ALICE, None, headers)
        assert own.status == 200, own.raw[:300]
    # Another tenant, with the very headers and query string of the creator: never its owner.
    assert_openai_error(await call(http, "GET", v1 + f"/responses/{rid}", BOB, None, first), 404)
    refused(await call(http, "GET", v1 + f"/conversations/{conv}?x=1", BOB, None, first), "conversation", conv, None)
