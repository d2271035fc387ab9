"""Helpers of the ingress attacks (slow bodies, browsers, leaks): a real sidecar process on
loopback in front of the in-process emulator, raw sockets for what no client library sends
(a head without its body, a trickle, a foreign ``Host``), and the sidecar's metrics."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from tests.exposition import scrape
from tests.sidecar import SidecarProcess

MODEL = "gpt-6.1-sol"
ALICE = "sk-alice-security-0123456789"
MALLORY = "sk-mallory-security-9876543210"

Spawn = Callable[..., SidecarProcess]


def body(text: str = "hello", **fields: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "input": [{"role": "user", "content": text}], "store": False, **fields})


async def started(spawn: Spawn, upstream: str, *args: str, **env: str) -> SidecarProcess:
    """A ready sidecar process (``env``: ``UPSHIFT_*`` settings)."""
    side = spawn(upstream, *args, env=env)
    async with aiohttp.ClientSession() as session:
        await side.wait_ready(session)
    return side


def hostport(side: SidecarProcess) -> tuple[str, int]:
    host, port = side.api.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def raw_request(
    name: str,
    port: int,
    host: str,
    *,
    method: str = "POST",
    path: str = "/v1/responses",
    key: str = MALLORY,
    length: int = 0,
    first: bytes = b"",
    extra: str = "",
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw HTTP/1.1 request that declares ``length`` body bytes and sends ``first``."""
    reader, writer = await asyncio.open_connection(name, port)
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\n{extra}Content-Length: {length}\r\n\r\n"
    )
    writer.write(head.encode() + first)
    await writer.drain()
    return reader, writer


async def raw_head(
    side: SidecarProcess,
    length: int,
    *,
    key: str = MALLORY,
    first: bytes = b"",
    host: str | None = None,
    extra: str = "",
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw ``POST /v1/responses`` that declares ``length`` body bytes and sends ``first``."""
    name, port = hostport(side)
    return await raw_request(name, port, host or f"{name}:{port}", key=key, length=length, first=first, extra=extra)


async def answer(reader: asyncio.StreamReader, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer (Content-Length framed) from a raw connection."""
    async with asyncio.timeout(timeout):
        status_line = await reader.readline()
        assert status_line, "closed without an answer"
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        data = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, data


def openai_error(data: bytes, code: str) -> dict[str, Any]:
    """``data`` is an OpenAI-style error body with ``code``."""
    parsed = orjson.loads(data)
    assert set(parsed) == {"error"} and set(parsed["error"]) == {"message", "type", "param", "code"}, parsed
    assert parsed["error"]["code"] == code and parsed["error"]["message"], parsed
    error: dict[str, Any] = parsed["error"]
    return error


async def metrics(side: SidecarProcess) -> str:
    return await scrape(side.admin)


def body_limit(side_logs_413: bytes) -> int:
    """The body limit a 413's message names."""
    found = re.search(rb"limit of (\d+) bytes", side_logs_413)
    assert found, side_logs_413
    return int(found.group(1))
