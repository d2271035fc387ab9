"""Helpers for the cluster tests: replicas on loopback, a light tool-loop app, owner steering."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from bench.ports import free_ports
from proxy.config import ClusterSettings, Settings, ShutdownSettings
from proxy.core.affinity import owner_key, rank, root_digest
from proxy.intake.identity import identify
from proxy.server import Server
from tests.clients.support import MODEL, TOOLS, task_text, tool_outputs
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator, context_digest
from upshift_emulator.oracle import normalize_input

KEY = "sk-test-cluster"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
STEPS = 5
"""Tool calls per conversation: 6 turns each."""


def identity_digest(upstream: str) -> str:
    """The identity every test app has (its own key passed through)."""
    return identify(CIMultiDict(HEADERS), upstream=upstream, authorization=HEADERS["Authorization"]).digest


def first_body(task: str) -> bytes:
    return orjson.dumps({"model": MODEL, "input": [{"role": "user", "content": task}], "tools": TOOLS})


def owner_of(task: str, upstream: str, peers: Sequence[str]) -> str:
    """The replica owning a conversation that starts with ``task``."""
    root = root_digest(first_body(task))
    assert root is not None
    return rank(owner_key(identity_digest(upstream), root), peers)[0]


def task_owned_by(target: str, upstream: str, peers: Sequence[str], label: str) -> str:
    """A task text whose conversation ``target`` owns."""
    for n in range(10_000):
        task = task_text(STEPS, f"{label}-{n}")
        if owner_of(task, upstream, peers) == target:
            return task
    raise AssertionError("no task found")


def replica_settings(upstream: str, url: str, peers: Sequence[str], **cluster: Any) -> Settings:
    host_port = url.removeprefix("http://")
    return Settings(
        upstream=upstream,
        listen=host_port,
        admin_listen=host_port.rpartition(":")[0] + ":0",
        shutdown=ShutdownSettings(grace_seconds=2.0),
        cluster=ClusterSettings(peers=",".join(peers), self_url=url, **{"plain_http_peers": True, **cluster}),
    )


async def start_replicas(upstream: str, count: int, **cluster: Any) -> tuple[list[Server], list[str]]:
    """``count`` in-process replicas on 127.0.0.1 with static peers."""
    urls = [f"http://127.0.0.1:{p}" for p in free_ports(count)]
    servers = [Server(replica_settings(upstream, url, urls, **cluster)) for url in urls]
    for server in servers:
        await server.start()
    return servers, urls


@dataclass(slots=True)
class Conversation:
    """One app's tool loop, as it went over the wire."""

    task: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    response_ids: list[str] = field(default_factory=list)
    outputs: list[list[Any]] = field(default_factory=list)
    modes: list[str | None] = field(default_factory=list)
    owners: list[str | None] = field(default_factory=list)

    @property
    def final_text(self) -> str:
        last = self.outputs[-1][-1]
        assert last["type"] == "message", last
        return str(last["content"][0]["text"])


async def tool_loop(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    task: str,
    *,
    start: int = 0,
    max_turns: int = 12,
    before_turn: Any = None,
) -> Conversation:
    """An app's tool loop over plain HTTP, turn ``i`` sent to ``urls[(start + i) % len(urls)]``
    (a client spreading requests round-robin over replicas)."""
    conv = Conversation(task)
    history: list[Any] = [{"role": "user", "content": task}]
    for turn in range(max_turns):
        if before_turn is not None:
            await before_turn(turn)
        body = {"model": MODEL, "input": history, "tools": TOOLS}
        url = urls[(start + turn) % len(urls)].rstrip("/") + "/v1/responses"
        async with session.post(url, data=orjson.dumps(body), headers=HEADERS) as resp:
            data = await resp.read()
            assert resp.status == 200, (resp.status, data[:500])
            conv.modes.append(resp.headers.get("x-upshift-mode"))
            conv.owners.append(resp.headers.get("x-upshift-owner"))
        response = orjson.loads(data)
        conv.bodies.append(body)
        conv.response_ids.append(response["id"])
        output = response["output"]
        conv.outputs.append(output)
        history = [*history, *output]
        if not any(o.get("type") == "function_call" for o in output):
            return conv
        history += tool_outputs(output)
    raise AssertionError(f"no final answer after {max_turns} turns")


def summary(conv: Conversation) -> list[list[tuple[Any, ...]]]:
    """What each turn's output says (ids left out)."""
    out = []
    for output in conv.outputs:
        turn = []
        for item in output:
            if item["type"] == "function_call":
                turn.append(("call", item["name"], orjson.loads(item["arguments"])))
            elif item["type"] == "message":
                turn.append(("message", "".join(p.get("text", "") for p in item["content"])))
            else:
                turn.append((item["type"],))
        out.append(turn)
    return out


def continued(emu: Emulator, conv: Conversation) -> int:
    """Turns 2..N that went upstream as a cache-hitting continuation of the previous turn."""
    hits = 0
    for prev, rid in zip(conv.response_ids, conv.response_ids[1:], strict=False):
        rec = emu.record(rid)
        assert rec is not None
        if rec["continuation"] and rec["cache_hit"] and rec["previous_response_id"] == prev:
            hits += 1
    return hits


def assert_fidelity(emu: Emulator, conv: Conversation) -> None:
    """The model saw exactly the app's input, every turn."""
    for index, (body, rid) in enumerate(zip(conv.bodies, conv.response_ids, strict=True)):
        rec = emu.record(rid)
        assert rec is not None
        items = normalize_input(body["input"])
        assert rec["context_digest"] == context_digest(items), f"turn {index}: effective context differs"


async def direct(emu: Emulator, session: aiohttp.ClientSession, tasks: Sequence[str]) -> list[Conversation]:
    """The same loops straight against the emulator: the answers every app must get."""
    return list(await asyncio.gather(*(tool_loop(session, [emu.url], t) for t in tasks)))


__all__ = [
    "HEADERS",
    "KEY",
    "STEPS",
    "Conversation",
    "assert_fidelity",
    "continued",
    "direct",
    "free_ports",
    "identity_digest",
    "owner_of",
    "replica_settings",
    "start_replicas",
    "summary",
    "task_owned_by",
    "tool_loop",
]


async def wait_ready(proc: SidecarProcess, session: aiohttp.ClientSession, timeout: float = 30.0) -> None:
    """Poll a sidecar process's ``/readyz`` (its admin URL known) until 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, proc.logs()
        try:
            async with session.get(proc.admin + "/readyz") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"not ready:\n{proc.logs()}")
