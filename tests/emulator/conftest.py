"""Fixtures and helpers for the emulator's own tests (real sockets, real openai SDK)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from upshift_emulator import Emulator, ThreadedEmulator

TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
KEY = "sk-test"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
        "strict": True,
    }
]

EmulatorFactory = Callable[..., Awaitable[Emulator]]


@pytest.fixture
async def make_emulator() -> AsyncIterator[EmulatorFactory]:
    """Start emulators with custom settings (``EmulatorConfig`` fields as keywords)."""
    started: list[Emulator] = []

    async def make(**overrides: Any) -> Emulator:
        emu = Emulator(**overrides)
        await emu.start()
        started.append(emu)
        return emu

    yield make
    for emu in started:
        await emu.stop()


ClientFactory = Callable[..., AsyncOpenAI]


@pytest.fixture
async def sdk() -> AsyncIterator[ClientFactory]:
    """Make async SDK clients for any emulator (no retries, so faults surface); closed afterwards."""
    made: list[AsyncOpenAI] = []

    def make(emu: Emulator, api_key: str = KEY) -> AsyncOpenAI:
        made.append(AsyncOpenAI(base_url=emu.base_url, api_key=api_key, max_retries=0))
        return made[-1]

    yield make
    for client in made:
        await client.close()


@pytest.fixture
def client(emulator: Emulator, sdk: ClientFactory) -> AsyncOpenAI:
    """Async SDK client pointed at :func:`emulator`."""
    return sdk(emulator)


@pytest.fixture
def threaded() -> Iterator[Emulator]:
    """An emulator in a background thread, for the blocking sync SDK."""
    with ThreadedEmulator() as emu:
        yield emu


@pytest.fixture
def sync_client(threaded: Emulator) -> OpenAI:
    """Sync SDK client for :func:`threaded`."""
    return OpenAI(base_url=threaded.base_url, api_key=KEY, max_retries=0)


async def recv_json(conn: Any, timeout: float = 5.0) -> dict[str, Any]:
    """Next server event of an SDK WebSocket connection, as the raw JSON object."""
    data: dict[str, Any] = json.loads(await asyncio.wait_for(conn.recv_bytes(), timeout))
    return data


async def read_turn(conn: Any, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Raw events up to and including the next terminal event."""
    events: list[dict[str, Any]] = []
    while True:
        event = await recv_json(conn, timeout)
        events.append(event)
        if event["type"] in TERMINAL:
            return events


def final_response(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``response`` of the terminal event (fails on an ``error``)."""
    last = events[-1]
    assert last["type"] != "error", last
    response: dict[str, Any] = last["response"]
    return response
