"""Two identities (API keys) with the same histories never continue each other's responses."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.sidecar import Sidecar
from upshift_emulator import Emulator
from upshift_emulator.state import identity_of

from .support import (
    MODEL,
    TOOLS,
    Capture,
    assert_continuations,
    assert_fidelity,
    post,
    record,
    summarize,
    tool_outputs,
)

KEY_A = "sk-tenant-a"
KEY_B = "sk-tenant-b"
TASK = "Shared task: steps=2."


class Conversation:
    """One app's tool loop, advanced one turn at a time (so two can be interleaved)."""

    def __init__(self, base_url: str, key: str, **params: Any) -> None:
        self.capture = Capture()
        self.client = self.capture.async_client(base_url, key)
        self.history: list[Any] = [{"role": "user", "content": TASK}]
        self.params = params
        self.ids: list[str] = []
        self.outputs: list[list[Any]] = []
        self.done = False

    async def step(self) -> None:
        response = await self.client.responses.create(model=MODEL, input=self.history, tools=TOOLS, **self.params)
        self.ids.append(response.id)
        self.outputs.append(list(response.output))
        self.history += response.output
        added = tool_outputs(response.output)
        self.history += added
        self.done = not added

    @property
    def contents(self) -> list[list[Any]]:
        return [[summarize(o) for o in out] for out in self.outputs]


def owner_of(emu: Emulator, response_id: str) -> str:
    """The identity of the upstream connection that produced a response."""
    rec = record(emu, response_id)
    return emu.stats.connections[rec["connection_id"]].identity


@pytest.mark.parametrize("store", [True, False])
async def test_interleaved_identical_conversations_stay_apart(
    emulator: Emulator, sidecar: Sidecar, store: bool
) -> None:
    a = Conversation(sidecar.base_url, KEY_A, store=store)
    b = Conversation(sidecar.base_url, KEY_B, store=store)
    while not (a.done and b.done):
        await a.step()
        await b.step()
    assert len(a.ids) == len(b.ids) == 3
    # identical histories, identical answers...
    assert a.contents == b.contents
    # ...each chain continued by its own identity only
    for conv, key in ((a, KEY_A), (b, KEY_B)):
        assert_continuations(
            emulator, conv.capture.bodies, conv.ids, [len(o) for o in conv.outputs], conv.capture.modes
        )
        assert_fidelity(emulator, conv.capture.bodies, conv.ids)
        for index, response_id in enumerate(conv.ids):
            assert owner_of(emulator, response_id) == identity_of(f"Bearer {key}")
            prev = record(emulator, response_id)["previous_response_id"]
            assert prev == (conv.ids[index - 1] if index else None)
    b_connections = {record(emulator, i)["connection_id"] for i in b.ids}
    a_connections = {record(emulator, i)["connection_id"] for i in a.ids}
    assert not a_connections & b_connections
    await a.client.close()
    await b.client.close()


async def test_b_replaying_a_transcript_gets_no_continuation_of_a(emulator: Emulator, sidecar: Sidecar) -> None:
    """B sends byte-identical bodies to A's (A's call ids and item ids included): the sidecar
    must never match them against A's heads; B's turns go in full on B's own sockets."""
    a = Conversation(sidecar.base_url, KEY_A)
    copies = []
    async with aiohttp.ClientSession() as session:
        while not a.done:
            await a.step()
            copies.append(await post(session, sidecar.base_url, a.capture.bodies[-1], api_key=KEY_B))
    for index, reply in enumerate(copies):
        assert reply.status == 200, reply.body
        rec = record(emulator, reply.body["id"])
        assert rec["previous_response_id"] is None or rec["previous_response_id"] in {c.body["id"] for c in copies}
        assert rec["previous_response_id"] not in a.ids
        assert owner_of(emulator, reply.body["id"]) == identity_of(f"Bearer {KEY_B}")
        assert [summarize(o) for o in reply.output] == a.contents[index]
    await a.client.close()


@pytest.mark.parametrize("store", [True, False])
async def test_app_supplied_anchor_of_a_never_goes_on_as_socket(
    emulator: Emulator, sidecar: Sidecar, store: bool
) -> None:
    a = Conversation(sidecar.base_url, KEY_A, store=store)
    await a.step()
    await a.step()
    a_conns = {record(emulator, i)["connection_id"] for i in a.ids}
    assert len(a_conns) == 1
    a_conn = emulator.stats.connections[next(iter(a_conns))]
    frames_before = a_conn.frames_received
    # B chains itself on A's latest response, sending only the delta, as a chaining client does
    delta_input = tool_outputs(a.outputs[-1])
    body = {"model": MODEL, "input": delta_input, "tools": TOOLS, "previous_response_id": a.ids[-1], "store": store}
    async with aiohttp.ClientSession() as session:
        reply = await post(session, sidecar.base_url, body, api_key=KEY_B)
        again = await post(session, sidecar.base_url, body, api_key=KEY_B)
        frames_after_b = a_conn.frames_received
        # A itself may chain on its own response, on its own socket (the cache hits)
        own = await post(session, sidecar.base_url, body, api_key=KEY_A)
    assert reply.status == 400, reply.body
    assert reply.body["error"]["code"] == "previous_response_not_found"
    assert again.status == 400
    # the frame never reached A's socket, nor any socket: the sidecar knows the id is A's and
    # answers B as the upstream answers an unknown id, forwarding nothing
    assert frames_after_b == frames_before
    b_conns = [c for c in emulator.stats.connections.values() if c.identity == identity_of(f"Bearer {KEY_B}")]
    assert sum(c.frames_received for c in b_conns) == 0
    assert own.status == 200, own.body
    own_rec = record(emulator, own.body["id"])
    assert own_rec["cache_hit"] is True and own_rec["connection_id"] in a_conns
    await a.client.close()
