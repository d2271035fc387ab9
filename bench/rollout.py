"""Run coding-agent rollouts for one setup (A, B or C) at one concurrency, and collect per-turn records."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx2 as httpx
from openai import AsyncOpenAI

from .clients import (
    API_KEY,
    READ_TIMEOUT,
    Agent,
    RawHttpAgent,
    RawWsAgent,
    SdkHttpAgent,
    SdkWsAgent,
    TurnRecord,
    note_request_sent,
)
from .workload import Rollout, RolloutSpec, body_fields, make_rollout

__all__ = ["ConversationResult", "SetupResult", "Urls", "run_conversation", "run_setup"]

JSON = Any
SETUPS = ("A", "B", "C")


@dataclass(frozen=True, slots=True)
class Urls:
    """Where each setup points."""

    emulator: str
    """Emulator base URL (``http://127.0.0.1:P/v1``)."""
    sidecar: str | None
    """Sidecar base URL, or None when it is not running."""

    @property
    def emulator_ws(self) -> str:
        """The emulator's WebSocket URL."""
        return self.emulator.replace("http://", "ws://", 1).rstrip("/") + "/responses"


@dataclass(slots=True)
class ConversationResult:
    """One rollout."""

    index: int
    turns: list[TurnRecord] = field(default_factory=list)
    error: str | None = None

    @property
    def wall(self) -> float:
        """Rollout time: first request sent to last terminal event."""
        if not self.turns:
            return 0.0
        last = self.turns[-1]
        return last.start + last.total - self.turns[0].start


@dataclass(slots=True)
class SetupResult:
    """All rollouts of one setup at one concurrency."""

    setup: str
    concurrency: int
    client: str
    conversations: list[ConversationResult]
    wall: float
    """Seconds from the first start to the last finish."""
    extra: dict[str, JSON] = field(default_factory=dict)


async def run_conversation(agent: Agent, rollout: Rollout, max_turns: int, tool_seconds: float) -> ConversationResult:
    """Drive one rollout: task, then one tool output per function call, until the model answers."""
    result = ConversationResult(rollout.index)
    new = list(rollout.first_input)
    step = 0
    try:
        for _ in range(max_turns + 2):
            rec, output = await agent.turn(new)
            result.turns.append(rec)
            if rec.status != "response.completed":
                raise RuntimeError(f"turn {len(result.turns)} ended with {rec.status}")
            calls = [item for item in output if item.get("type") == "function_call"]
            if not calls:
                break
            if tool_seconds > 0:
                await asyncio.sleep(tool_seconds)
            new = []
            for call in calls:
                new.append(
                    {"type": "function_call_output", "call_id": call["call_id"], "output": rollout.output_for(step)}
                )
                step += 1
    except Exception as exc:  # noqa: BLE001 - a failed rollout is reported, not fatal
        result.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(agent.close(), 10.0)
    return result


def _sdk_client(base_url: str, concurrency: int) -> AsyncOpenAI:
    limits = httpx.Limits(
        max_connections=max(100, concurrency * 2), max_keepalive_connections=max(100, concurrency * 2)
    )
    http = httpx.AsyncClient(
        limits=limits,
        timeout=httpx.Timeout(READ_TIMEOUT, connect=30.0),
        event_hooks={"request": [note_request_sent]},  # the SDK's own time per turn (client_s)
    )
    return AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, http_client=http)


async def run_setup(
    setup: str,
    urls: Urls,
    spec: RolloutSpec,
    concurrency: int,
    *,
    client: str = "sdk",
    tool_seconds: float = 0.0,
    start_spread: float = 1.0,
    first_index: int = 0,
    on_progress: Callable[[str], Awaitable[None] | None] | None = None,
) -> SetupResult:
    """Run ``concurrency`` rollouts of ``setup`` at once, starting within ``start_spread`` seconds.

    ``first_index`` selects which rollouts (the same indices give the same content in every setup).
    """
    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}")
    base = urls.sidecar if setup == "B" else urls.emulator
    if base is None:
        raise RuntimeError("setup B needs the sidecar")
    fields = body_fields(stream=True)
    rng = random.Random(concurrency)
    rollouts = [make_rollout(spec, first_index + i) for i in range(concurrency)]
    offsets = [rng.uniform(0.0, start_spread) if concurrency > 1 else 0.0 for _ in rollouts]
    sdk: AsyncOpenAI | None = None
    session: aiohttp.ClientSession | None = None
    if client == "sdk":
        sdk = _sdk_client(base, concurrency)
    else:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=READ_TIMEOUT)
        session = aiohttp.ClientSession(connector=connector, timeout=timeout)

    def make_agent() -> Agent:
        if setup == "C":
            return SdkWsAgent(sdk, fields) if sdk is not None else RawWsAgent(urls.emulator_ws, fields)
        if sdk is not None:
            return SdkHttpAgent(sdk, fields)
        assert session is not None
        return RawHttpAgent(session, base, fields)

    async def one(rollout: Rollout, offset: float) -> ConversationResult:
        await asyncio.sleep(offset)
        return await run_conversation(make_agent(), rollout, spec.turns, tool_seconds)

    started = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(r, o) for r, o in zip(rollouts, offsets, strict=True)))
    finally:
        if sdk is not None:
            await sdk.close()
        if session is not None:
            await session.close()
    wall = time.perf_counter() - started
    if on_progress is not None:
        done = on_progress(f"{setup} x{concurrency} ({client}): {wall:.1f} s")
        if done is not None:
            await done
    return SetupResult(setup, concurrency, client, list(results), wall)
