"""Helpers for the tenant-wall tests: sidecar processes behind one injected key, and two tenants
(Alice, Bob) told apart by their placeholder ``Authorization``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from tests.ingress.support import free_ports, wait_ready
from tests.reliability.helpers import MODEL, Reply, auth, post, user
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

__all__ = [
    "ALICE",
    "BOB",
    "INJECTED",
    "MODEL",
    "Tenant",
    "injected_env",
    "relay_turn",
    "start_process",
    "start_replicas",
]

ALICE, BOB = "sk-placeholder-alice-0123456789", "sk-placeholder-bob-9876543210"
INJECTED = "sk-injected-real-key-0123456789abcdef"


def injected_env(**extra: str) -> dict[str, str]:
    """The environment of a sidecar that injects one real key for every app."""
    return {
        "UPSHIFT_API_KEY_SOURCE": "env",
        "UPSHIFT_API_KEY_ENV": "TENANTS_REAL_KEY",
        "TENANTS_REAL_KEY": INJECTED,
        **extra,
    }


async def start_process(
    spawn: Callable[..., SidecarProcess], upstream: str, *args: str, env: dict[str, str] | None = None
) -> SidecarProcess:
    """One ``python -m proxy`` (``args`` such as ``--workers 3``) on fixed free ports, ready."""
    api, admin = free_ports(2)
    listen = ("--listen", f"127.0.0.1:{api}", "--admin-listen", f"127.0.0.1:{admin}")
    proc = spawn(upstream, *args, *listen, env=env)
    proc.api, proc.admin = f"http://127.0.0.1:{api}", f"http://127.0.0.1:{admin}"
    async with aiohttp.ClientSession() as session:
        await wait_ready(proc, session)
    return proc


async def start_replicas(
    spawn: Callable[..., SidecarProcess], upstream: str, count: int, env: dict[str, str]
) -> list[SidecarProcess]:
    """``count`` replicas that know each other (``cluster.peers``, plain HTTP on loopback), ready."""
    ports = free_ports(2 * count)
    urls = [f"http://127.0.0.1:{p}" for p in ports[:count]]
    procs = []
    for url, admin in zip(urls, ports[count:], strict=True):
        proc = spawn(
            upstream,
            "--listen",
            url.removeprefix("http://"),
            "--admin-listen",
            f"127.0.0.1:{admin}",
            env={
                "UPSHIFT_CLUSTER_PLAIN_HTTP_PEERS": "true",
                **env,
                "UPSHIFT_CLUSTER_PEERS": ",".join(urls),
                "UPSHIFT_CLUSTER_SELF_URL": url,
            },
        )
        proc.api, proc.admin = url, f"http://127.0.0.1:{admin}"
        procs.append(proc)
    async with aiohttp.ClientSession() as session:
        for proc in procs:
            await wait_ready(proc, session)
    return procs


@dataclass
class Tenant:
    """One app: its placeholder key, talking to a sidecar's ``api`` URL over fresh connections
    (so ``--workers`` spreads its requests over every worker)."""

    key: str
    http: aiohttp.ClientSession

    async def create(self, api: str, text: str, **fields: Any) -> dict[str, Any]:
        body = {"model": MODEL, "input": [user(text)], **fields}
        reply = await post(self.http, api + "/v1", body, key=self.key)
        assert reply.status == 200, (reply.status, reply.raw[:300])
        if fields.get("stream"):
            created = next(e for e in _events(reply.raw) if e.get("type") == "response.created")
            return dict(created["response"])
        return dict(reply.json)

    async def chain(self, api: str, previous: str, text: str = "go on") -> Reply:
        body = {"model": MODEL, "previous_response_id": previous, "input": [user(text)]}
        return await post(self.http, api + "/v1", body, key=self.key)

    async def call(self, method: str, api: str, path: str) -> Reply:
        async with self.http.request(method, api + path, headers=auth(self.key)) as resp:
            return Reply(resp.status, resp.headers, await resp.read())

    async def get(self, api: str, rid: str) -> Reply:
        return await self.call("GET", api, f"/v1/responses/{rid}")

    async def input_items(self, api: str, rid: str) -> Reply:
        return await self.call("GET", api, f"/v1/responses/{rid}/input_items")

    async def delete(self, api: str, rid: str) -> Reply:
        return await self.call("DELETE", api, f"/v1/responses/{rid}")

    async def cancel(self, api: str, rid: str) -> Reply:
        return await self.call("POST", api, f"/v1/responses/{rid}/cancel")


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.split(b"\n\n"):
        data = b"".join(line[5:].strip() for line in block.splitlines() if line.startswith(b"data:"))
        if data:
            out.append(orjson.loads(data))
    return out


async def relay_turn(
    http: aiohttp.ClientSession, api: str, key: str, frame: dict[str, Any], *, timeout: float = 15.0
) -> list[dict[str, Any]]:
    """One WebSocket relay session: send ``frame``, return its events up to the terminal one."""
    url = api.replace("http://", "ws://") + "/v1/responses"
    events: list[dict[str, Any]] = []
    async with http.ws_connect(url, headers=auth(key), timeout=aiohttp.ClientWSTimeout(ws_close=timeout)) as ws:
        await ws.send_str(orjson.dumps(frame).decode())
        while True:
            msg = await ws.receive(timeout=timeout)
            assert msg.type is aiohttp.WSMsgType.TEXT, msg
            event = orjson.loads(msg.data)
            events.append(event)
            if event.get("type") in ("response.completed", "response.failed", "response.incomplete", "error"):
                return events


def forwarded(emulator: Emulator) -> int:
    """Requests, frames and other-route calls the upstream received."""
    stats = emulator.stats
    frames = int(stats.snapshot()["ws_frames_received"])
    return sum(stats.requests.values()) + frames + sum(stats.other_requests.values())


async def call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    key: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    """``method url`` as the holder of ``key``: ``body`` as JSON (bytes as they are), ``headers``
    added."""
    data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    sent = {**auth(key), **({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
    async with http.request(method, url, data=data, headers=sent) as resp:
        return Reply(resp.status, resp.headers, await resp.read())
