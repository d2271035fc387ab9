"""Where HTTP responses' events go: SSE (with the real API's delta obfuscation) or nowhere (JSON)."""

from __future__ import annotations

import secrets
import string
from typing import Any

import orjson
from aiohttp import web

__all__ = ["NullSink", "SseSink", "obfuscation", "wants_obfuscation"]

JSON = Any
_OBFUSCATION_CHARS = string.ascii_letters + string.digits


def obfuscation(delta: str) -> str:
    """Random padding so that ``delta`` + padding have a length that hides the delta's (1-16 chars)."""
    length = 16 - (len(delta.encode()) % 16) or 16
    return "".join(secrets.choice(_OBFUSCATION_CHARS) for _ in range(length))


def wants_obfuscation(body: JSON, config_default: bool) -> bool:
    """``stream_options.include_obfuscation`` (default true, as on the real API)."""
    options = body.get("stream_options") if isinstance(body, dict) else None
    if isinstance(options, dict) and options.get("include_obfuscation") is False:
        return False
    return config_default


class SseSink:
    """Events as SSE (``event: <type>`` / ``data: <json>`` / blank line), with obfuscation on deltas."""

    def __init__(self, request: web.Request, response: web.StreamResponse, obfuscate: bool) -> None:
        self.request, self.response, self.obfuscate = request, response, obfuscate

    async def send(self, payload: dict[str, JSON]) -> None:
        if self.obfuscate and str(payload["type"]).endswith(".delta") and isinstance(payload.get("delta"), str):
            payload = {**payload, "obfuscation": obfuscation(payload["delta"])}
        data = orjson.dumps(payload)
        await self.response.write(b"event: " + str(payload["type"]).encode() + b"\ndata: " + data + b"\n\n")

    async def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()

    async def close(self, code: int) -> None:
        await self.abort()


class NullSink:
    """Collects nothing: non-streamed HTTP responses and background runs."""

    def __init__(self, request: web.Request | None) -> None:
        self.request = request

    async def send(self, payload: dict[str, JSON]) -> None:
        return None

    async def abort(self) -> None:
        if self.request is not None and self.request.transport is not None:
            self.request.transport.abort()

    async def close(self, code: int) -> None:
        await self.abort()
