"""Shared fixtures for the whole test suite."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from upshift_emulator import Emulator


@pytest.fixture(autouse=True)
async def _close_sdk_clients(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """Every openai SDK client a test makes is closed when the test ends, in its loop (pytest
    turns the leaked connections of an unclosed client into failures)."""
    made: list[Any] = []
    for cls in (openai.OpenAI, openai.AsyncOpenAI):
        original = cls.__init__

        def init(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            __original(self, *args, **kwargs)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", init)
    yield
    for client in reversed(made):
        if isinstance(client, openai.AsyncOpenAI):
            await client.close()
        else:
            client.close()


@pytest.fixture
async def emulator() -> AsyncIterator[Emulator]:
    """A started emulated upstream on 127.0.0.1 (free port, zero latency)."""
    async with Emulator() as emu:
        yield emu


# -- the sidecar (tests/sidecar.py) -------------------------------------------------------

from collections.abc import Awaitable, Callable  # noqa: E402

from tests.sidecar import Sidecar  # noqa: E402

SidecarFactory = Callable[..., Awaitable[Sidecar]]


@pytest.fixture
async def make_sidecar(emulator: Emulator) -> AsyncIterator[SidecarFactory]:
    """Start sidecars in front of ``emulator`` with settings overrides (see tests/sidecar.py)."""
    started: list[Sidecar] = []

    async def make(**changes: Any) -> Sidecar:
        sidecar = Sidecar(emulator.base_url, **changes)
        await sidecar.start()
        started.append(sidecar)
        return sidecar

    yield make
    for sidecar in started:
        await sidecar.stop()


@pytest.fixture
async def sidecar(make_sidecar: SidecarFactory) -> Sidecar:
    """A started sidecar with default settings in front of ``emulator``."""
    return await make_sidecar()


@pytest.fixture
async def stack(emulator: Emulator, sidecar: Sidecar) -> tuple[Emulator, Sidecar]:
    """``(emulator, sidecar)``: an app points at ``sidecar.base_url``."""
    return emulator, sidecar


# -- the sidecar as a process (tests/sidecar.py SidecarProcess) -------------------------------------

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

from tests.sidecar import SidecarProcess  # noqa: E402


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., SidecarProcess]]:
    """Start ``python -m proxy`` subprocesses; every one is killed at teardown if still running."""
    started: list[SidecarProcess] = []

    def make(upstream: str, *args: str, env: dict[str, str] | None = None) -> SidecarProcess:
        tmp = tmp_path / f"sidecar{len(started)}"
        tmp.mkdir()
        proc = SidecarProcess(upstream, tmp, *args, env=env)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.kill()
