"""Fixtures of the reliability suite (the root conftest gives ``emulator``, ``make_sidecar``, ``sidecar``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import proxy.upstream.ws
from tests.sidecar import Sidecar
from upshift_emulator import Emulator, ThreadedEmulator

EmulatorFactory = Callable[..., Awaitable[Emulator]]
SidecarFor = Callable[..., Awaitable[Sidecar]]
ThreadedEmulatorFactory = Callable[..., Emulator]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """The app's HTTP client (no proxies from the environment)."""
    async with aiohttp.ClientSession(trust_env=False) as session:
        yield session


@pytest.fixture
async def make_emulator() -> AsyncIterator[EmulatorFactory]:
    """Emulators with custom settings; ``seen=list`` records every request the upstream receives
    as ``(method, raw_path, headers)`` (an extra middleware, added before the app starts)."""
    started: list[Emulator] = []

    async def make(*, seen: list[tuple[str, str, dict[str, str]]] | None = None, **overrides: Any) -> Emulator:
        emu = Emulator(**overrides)
        if seen is not None:

            @web.middleware
            async def record(request: web.Request, handler: Any) -> web.StreamResponse:
                seen.append((request.method, request.raw_path, dict(request.headers)))
                response: web.StreamResponse = await handler(request)
                return response

            emu.app.middlewares.append(record)
        await emu.start()
        started.append(emu)
        return emu

    yield make
    for emu in started:
        await emu.stop()


@pytest.fixture
def threaded_emulator() -> Iterator[Callable[..., Emulator]]:
    """Emulators on a loop of their own (a thread): the test loop then holds only the sidecar's and
    the app's tasks, so task leaks can be counted exactly. ``faults``, ``stats`` and ``record()``
    are safe to use from the test."""
    started: list[ThreadedEmulator] = []

    def make(**overrides: Any) -> Emulator:
        runner = ThreadedEmulator(**overrides)
        emu = runner.__enter__()
        started.append(runner)
        return emu

    yield make
    for runner in started:
        runner.__exit__(None, None, None)


@pytest.fixture
async def sidecar_for() -> AsyncIterator[Callable[..., Awaitable[Sidecar]]]:
    """In-process sidecars in front of any upstream URL (``make_sidecar`` is tied to ``emulator``)."""
    started: list[Sidecar] = []

    async def make(upstream: str, **changes: Any) -> Sidecar:
        sidecar = Sidecar(upstream, **changes)
        await sidecar.start()
        started.append(sidecar)
        return sidecar

    yield make
    for sidecar in started:
        await sidecar.stop()


@pytest.fixture
def frames(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every ``response.create`` frame the in-process sidecars send upstream, in order."""
    sent: list[bytes] = []
    original = proxy.upstream.ws.UpstreamSocket.send

    async def send(self: proxy.upstream.ws.UpstreamSocket, frame: bytes, lane: str | None) -> None:
        sent.append(bytes(frame))
        await original(self, frame, lane)

    monkeypatch.setattr(proxy.upstream.ws.UpstreamSocket, "send", send)
    return sent
