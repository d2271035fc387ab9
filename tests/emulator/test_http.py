"""HTTP side through the real openai SDK (sync and async) and raw aiohttp for wire details."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from upshift_emulator import Emulator

from .conftest import KEY, TOOLS, ClientFactory

pytestmark = pytest.mark.timeout(30)

AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT_SEQUENCE = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def _collapse(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


async def test_create_non_stream_full_object(emulator: Emulator, client: AsyncOpenAI) -> None:
    raw = await client.responses.with_raw_response.create(model="gpt-6.1-sol", input="hello", instructions="be brief")
    assert re.fullmatch(r"req_[0-9a-f]{32}", raw.headers["x-request-id"])
    assert int(raw.headers["openai-processing-ms"]) >= 0
    response = raw.parse()
    assert response.status == "completed" and response.id.startswith("resp_")
    assert "Echo: 'hello'" in response.output_text
    body = json.loads(raw.http_response.text)
    for key in ("object", "created_at", "background", "error", "incomplete_details", "instructions", "model",
                "parallel_tool_calls", "previous_response_id", "reasoning", "service_tier", "store", "text",
                "tool_choice", "tools", "top_p", "truncation", "usage", "metadata"):  # fmt: skip
        assert key in body, key
    assert body["store"] is True and body["instructions"] == "be brief"
    usage = body["usage"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_stream_event_sequence(emulator: Emulator, client: AsyncOpenAI) -> None:
    stream = await client.responses.create(model="gpt-6.1-sol", input="stream me", stream=True)
    events = [event async for event in stream]
    assert _collapse([e.type for e in events]) == TEXT_SEQUENCE
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, completed = events[0], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []  # type: ignore[union-attr]
    assert created.response.usage is None  # type: ignore[union-attr]
    done_item = next(e for e in events if e.type == "response.output_item.done").item  # type: ignore[union-attr]
    assert completed.response.output == [done_item]  # type: ignore[union-attr]
    added = next(e for e in events if e.type == "response.output_item.added").item  # type: ignore[union-attr]
    assert added.status == "in_progress" and added.content == []  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == completed.response.output_text  # type: ignore[union-attr]


async def test_sse_wire_format(emulator: Emulator) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "gpt-6.1-sol", "input": "wire", "stream": True}
        async with session.post(emulator.base_url + "/responses", json=body, headers=AUTH) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            raw = (await resp.read()).decode()
    assert "[DONE]" not in raw and raw.endswith("\n\n")
    blocks = raw.split("\n\n")[:-1]
    for index, block in enumerate(blocks):
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        assert data["sequence_number"] == index
        assert ": " not in data_line.removeprefix("data: ")[:20]  # compact JSON


async def test_stream_helper_with_reasoning_and_tools(emulator: Emulator, client: AsyncOpenAI) -> None:
    async with client.responses.stream(
        model="gpt-6.1-sol",
        input="please steps=1",
        tools=TOOLS,  # type: ignore[arg-type]
        reasoning={"effort": "low", "summary": "auto"},
        include=["reasoning.encrypted_content"],
    ) as stream:
        types = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    reasoning = final.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.encrypted_content  # type: ignore[union-attr]
    assert reasoning.summary[0].type == "summary_text"  # type: ignore[union-attr]
    assert "response.reasoning_summary_text.delta" in types
    assert "response.function_call_arguments.done" in types
    call = final.output[1]
    assert call.call_id.startswith("call_") and call.name == "read_file"  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens > 0


async def test_reasoning_without_include_has_no_encrypted_content(client: AsyncOpenAI) -> None:
    response = await client.responses.create(model="gpt-6.1-sol", input="think", reasoning={"effort": "low"})
    assert response.output[0].type == "reasoning"
    assert response.output[0].encrypted_content is None


async def test_tool_loop_full_history(emulator: Emulator, client: AsyncOpenAI) -> None:
    history: list[Any] = [{"role": "user", "content": "do 3 tool calls please"}]
    calls = 0
    while True:
        response = await client.responses.create(model="gpt-6.1-sol", input=history, tools=TOOLS, store=False)  # type: ignore[arg-type]
        history += [item.model_dump(exclude_none=True) for item in response.output]
        if response.output[-1].type != "function_call":
            break
        calls += 1
        call = response.output[-1]
        history.append({"type": "function_call_output", "call_id": call.call_id, "output": f"result #{calls}"})
    assert calls == 3
    assert "Done after 3 tool call(s). Last output: result #3" in response.output_text
    assert emulator.stats.requests["http"] == 4


async def test_parallel_calls_and_named_tool(client: AsyncOpenAI) -> None:
    tools = TOOLS + [{"type": "function", "name": "grep", "parameters": {"type": "object", "properties": {}}}]
    response = await client.responses.create(
        model="gpt-6.1-sol",
        input="steps=3 parallel=2 tool=grep",
        tools=tools,  # type: ignore[arg-type]
    )
    assert [o.type for o in response.output] == ["function_call", "function_call"]
    assert {o.name for o in response.output} == {"grep"}  # type: ignore[union-attr]
    assert len({o.call_id for o in response.output}) == 2  # type: ignore[union-attr]


async def test_max_output_tokens_incomplete(client: AsyncOpenAI) -> None:
    stream = await client.responses.create(
        model="gpt-6.1-sol", input="reply_bytes=800 long", max_output_tokens=16, stream=True
    )
    events = [event async for event in stream]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="gpt-6.1-sol", input="x", max_output_tokens=5)
    assert info.value.code == "integer_below_min_value"


async def test_store_retrieve_delete_and_http_continuation(emulator: Emulator, client: AsyncOpenAI) -> None:
    first = await client.responses.create(model="gpt-6.1-sol", input="remember")
    assert (await client.responses.retrieve(first.id)).output_text == first.output_text
    second = await client.responses.create(model="gpt-6.1-sol", input="and then", previous_response_id=first.id)
    record = emulator.record(second.id)
    assert record is not None and record["context_items"] == 3 and record["hydrated"]
    assert emulator.stats.hydrations["http"] == 1
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="gpt-6.1-sol", input="x", previous_response_id=first.id)
    assert info.value.code == "previous_response_not_found" and info.value.param == "previous_response_id"
    assert info.value.message == f"Error code: 400 - Previous response with id '{first.id}' not found."


async def test_store_false_not_stored(client: AsyncOpenAI) -> None:
    first = await client.responses.create(model="gpt-6.1-sol", input="forget", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="gpt-6.1-sol", input="x", previous_response_id=first.id)


async def test_keys_isolate_stored_responses(emulator: Emulator, client: AsyncOpenAI, sdk: ClientFactory) -> None:
    first = await client.responses.create(model="gpt-6.1-sol", input="mine")
    other = sdk(emulator, "sk-other")
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(first.id)


@pytest.mark.parametrize("key", ["sk-bad-123456789", None])
async def test_bad_or_missing_key(emulator: Emulator, key: str | None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            emulator.base_url + "/responses", json={"model": "gpt-6.1-sol"}, headers=headers
        ) as resp:
            assert resp.status == 401
            body = await resp.json()
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] is None
    if key:
        assert body["error"]["message"] == (
            "Incorrect API key provided: sk-bad******6789. "
            "You can find your API key at https://platform.openai.com/account/api-keys."
        )


async def test_validation_errors(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="gpt-6.1-sol", input="x", extra_body={"generate": False})
    assert info.value.code == "unknown_parameter" and info.value.param == "generate"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="gpt-6.1-sol", input="x", extra_body={"stream_id": "a"})
    assert info.value.param == "stream_id"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(
            model="gpt-6.1-sol", input=[{"type": "item_reference", "id": "msg_nope"}], store=False
        )
    assert "Items are not persisted when `store` is set to false" in info.value.message
    dangling = [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="gpt-6.1-sol", input=dangling)  # type: ignore[arg-type]
    assert info.value.message.endswith("No tool output found for function call c1.")


async def test_item_reference_resolves_stored_item(emulator: Emulator, client: AsyncOpenAI) -> None:
    first = await client.responses.create(model="gpt-6.1-sol", input="hi")
    echoed = await client.responses.create(
        model="gpt-6.1-sol",
        input=[{"role": "user", "content": "hi"}, first.output[0].model_dump(), {"role": "user", "content": "ok"}],  # type: ignore[list-item]
    )
    referenced = await client.responses.create(
        model="gpt-6.1-sol",
        input=[
            {"role": "user", "content": "hi"},
            {"type": "item_reference", "id": first.output[0].id},
            {"role": "user", "content": "ok"},
        ],  # type: ignore[list-item]
    )
    a, b = emulator.record(echoed.id), emulator.record(referenced.id)
    assert a is not None and b is not None and a["context_digest"] == b["context_digest"]
    assert echoed.output_text == referenced.output_text


async def test_background_queued_then_completed(client: AsyncOpenAI) -> None:
    queued = await client.responses.create(model="gpt-6.1-sol", input="later", background=True)
    assert queued.status == "queued" and queued.background is True
    for _ in range(100):
        current = await client.responses.retrieve(queued.id)
        if current.status == "completed":
            break
        await asyncio.sleep(0.02)
    assert current.status == "completed" and "Echo: 'later'" in current.output_text


async def test_conversation_items_prepended(emulator: Emulator, client: AsyncOpenAI) -> None:
    first = await client.responses.create(model="gpt-6.1-sol", input="one", conversation="conv_test")
    second = await client.responses.create(model="gpt-6.1-sol", input="two", conversation={"id": "conv_test"})
    assert second.conversation is not None and second.conversation.id == "conv_test"
    record = emulator.record(second.id)
    assert record is not None and record["context_items"] == 3 and first.id != second.id


async def test_passthrough_endpoints(emulator: Emulator, client: AsyncOpenAI) -> None:
    models = await client.models.list()
    assert "gpt-6.1-sol" in [m.id for m in models.data]
    chat = await client.chat.completions.create(model="gpt-6.1-sol", messages=[{"role": "user", "content": "yo"}])
    assert "Chat echo: yo" in (chat.choices[0].message.content or "")
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="gpt-6.1-sol", messages=[{"role": "user", "content": "s"}], stream=True
        )
    ]
    assert chunks[-1].choices[0].finish_reason == "stop"
    emb = await client.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 8
    again = await client.embeddings.create(model="text-embedding-3-small", input="a", encoding_format="float")
    assert again.data[0].embedding == pytest.approx(emb.data[0].embedding, rel=1e-5)
    uploaded = await client.files.create(file=("notes.txt", b"hello world"), purpose="user_data")
    assert uploaded.filename == "notes.txt" and uploaded.bytes == 11
    assert emulator.stats.other_requests["files"] == 1


async def test_plain_get_and_unknown_url(emulator: Emulator) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as session:
        async with session.get(emulator.base_url + "/responses") as resp:
            assert resp.status == 405
            assert (await resp.json())["error"]["message"] == "Invalid method for URL (GET /v1/responses)"
        async with session.post(emulator.base_url + "/nope") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["message"] == "Invalid URL (POST /v1/nope)"
        async with session.post(emulator.base_url + "/responses", data=b"{oops") as resp:
            assert resp.status == 400


def test_sync_client_create_and_stream(threaded: Emulator, sync_client: OpenAI) -> None:
    response = sync_client.responses.create(model="gpt-6.1-sol", input="sync")
    assert response.status == "completed"
    with sync_client.responses.stream(model="gpt-6.1-sol", input="sync stream") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert "Echo: 'sync stream'" in final.output_text
    assert threaded.stats.requests["http"] == 2
