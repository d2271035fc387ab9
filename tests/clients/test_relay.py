"""WebSocket-native apps (``client.responses.connect()``) pointed at the sidecar.

The sidecar relays their frames to an upstream socket of their own (never a pooled one): a
3-turn ``store=False`` chain completes with upstream cache hits and the same answers as the same
app talking to the emulator directly.
"""

from __future__ import annotations

import asyncio
from typing import Any

from openai import AsyncOpenAI, OpenAI

from tests.sidecar import Sidecar
from upshift_emulator import Emulator, context_digest
from upshift_emulator.state import identity_of

from .support import KEY, MODEL, TOOLS, delta, metrics, record, summarize, tool_outputs

TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")


async def read_turn(conn: Any) -> list[Any]:
    events = []
    while True:
        event = await asyncio.wait_for(conn.recv(), 5.0)
        events.append(event)
        if event.type in TERMINAL:
            return events


async def ws_chain(base_url: str, task: str) -> tuple[list[str], list[list[Any]], list[list[dict[str, Any]]]]:
    """A WS-native app: create, then chain with ``previous_response_id`` and only new items."""
    ids: list[str] = []
    outputs: list[list[Any]] = []
    sent: list[list[dict[str, Any]]] = []
    async with AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0) as client:
        async with client.responses.connect() as conn:
            new_items: list[dict[str, Any]] = [{"role": "user", "content": task}]
            for _ in range(3):
                prev = {"previous_response_id": ids[-1]} if ids else {}
                await conn.response.create(model=MODEL, input=new_items, store=False, tools=TOOLS, **prev)
                events = await read_turn(conn)
                assert events[0].type == "response.created"
                final = events[-1]
                assert final.type == "response.completed", final
                ids.append(final.response.id)
                outputs.append(list(final.response.output))
                sent.append(new_items)
                new_items = tool_outputs(final.response.output)
                if not new_items:
                    break
    return ids, outputs, sent


async def test_three_turn_store_false_chain_is_relayed(emulator: Emulator, sidecar: Sidecar) -> None:
    before = await metrics(sidecar.admin_url)
    ids, outputs, sent = await ws_chain(sidecar.base_url, "Relay me: steps=2.")
    await asyncio.sleep(0.05)  # the relay's access record is written when the session ends
    after = await metrics(sidecar.admin_url)
    direct_ids, direct_outputs, _ = await ws_chain(emulator.base_url, "Relay me: steps=2.")

    assert len(ids) == 3
    assert [[summarize(o) for o in out] for out in outputs] == [[summarize(o) for o in out] for out in direct_outputs]
    assert summarize(outputs[-1][-1])[2].endswith("Last output: read_file -> ok: path=src/step_2.txt")
    # the app's frames went upstream unchanged: turns 2 and 3 are cache-hitting continuations
    records = [record(emulator, i) for i in ids]
    assert [r["continuation"] for r in records] == [False, True, True]
    assert [r["cache_hit"] for r in records] == [False, True, True]
    assert [r["previous_response_id"] for r in records] == [None, ids[0], ids[1]]
    assert [r["input_items"] for r in records] == [len(s) for s in sent] == [1, 1, 1]
    # one upstream connection of the app's own identity carried the whole chain
    connections = {r["connection_id"] for r in records}
    assert len(connections) == 1
    conn_stats = emulator.stats.connections[connections.pop()]
    assert conn_stats.identity == identity_of(f"Bearer {KEY}")
    assert (conn_stats.requests, conn_stats.cache_hits, conn_stats.misses) == (3, 2, 0)
    # the relay's socket is its own, never a pooled one
    assert sidecar.pool.count() == 0
    assert delta(before, after, "upshift_requests_total", route="responses_ws", mode="relay", outcome="ok") == 1
    # fidelity: the chain's context is the whole conversation the app built
    history: list[Any] = []
    for index, response_id in enumerate(ids):
        history += sent[index]
        assert record(emulator, response_id)["context_digest"] == context_digest(
            [o if isinstance(o, dict) else o.model_dump(mode="json") for o in history]
        )
        history += [o.model_dump(mode="json") for o in outputs[index]]
    assert len(direct_ids) == 3


async def test_relay_passes_upstream_errors_through_and_stays_open(emulator: Emulator, sidecar: Sidecar) -> None:
    async with AsyncOpenAI(base_url=sidecar.base_url, api_key=KEY, max_retries=0) as client:
        async with client.responses.connect() as conn:
            await conn.response.create(model=MODEL, input="hi", store=False, previous_response_id="resp_unknown")
            events = await read_turn(conn)
            assert [e.type for e in events] == ["error"]
            assert events[0].error.code == "previous_response_not_found"
            assert events[0].error.message == "Previous response with id 'resp_unknown' not found."
            await conn.response.create(model=MODEL, input="hi", store=False)
            events = await read_turn(conn)
            assert events[-1].type == "response.completed"
            assert "Echo: 'hi'" in events[-1].response.output[0].content[0].text
    assert emulator.stats.misses["ws"] == 1


async def test_sync_client_connect_through_sidecar(emulator: Emulator, sidecar: Sidecar) -> None:
    def chain() -> list[str]:
        texts = []
        with OpenAI(base_url=sidecar.base_url, api_key=KEY, max_retries=0) as client:
            with client.responses.connect() as conn:
                prev: dict[str, str] = {}
                for text in ("one", "two", "three"):
                    conn.response.create(model=MODEL, input=text, store=False, **prev)
                    for event in conn:
                        if event.type == "response.completed":
                            prev = {"previous_response_id": event.response.id}
                            texts.append(event.response.output[0].content[0].text)
                            break
                        assert event.type not in TERMINAL, event
        return texts

    texts = await asyncio.to_thread(chain)
    assert len(texts) == 3 and "Echo: 'three'" in texts[2]
    assert emulator.stats.cache_hits == 2
