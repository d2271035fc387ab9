"""Shared helpers of the reliability suite: raw HTTP calls, SSE parsing, the oracle check,
metric reads, pool/head/task leak checks and a sidecar subprocess.

Everything talks to 127.0.0.1 only. Apps are simulated with a raw ``aiohttp`` client (exact
bytes, exact headers) and, where the SDK's own reaction matters, with the real ``openai`` SDK.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDictProxy

from proxy.observe.metrics import REGISTRY
from proxy.upstream.pool import SocketUse
from proxy.upstream.ws import live_sockets
from tests.sidecar import Sidecar
from upshift_emulator import Emulator
from upshift_emulator.model import ModelRequest, plan
from upshift_emulator.oracle import Segment, context_digest

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-reliability-0123456789abcdef"
MODEL = "gpt-6.1-sol"
TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")
ERROR_KEYS = {"message", "type", "param", "code"}


def auth(key: str = KEY) -> dict[str, str]:
    """The app's ``Authorization`` header."""
    return {"Authorization": f"Bearer {key}"}


def user(text: str) -> dict[str, Any]:
    """A user message in the plain ``{role, content}`` form apps send."""
    return {"role": "user", "content": text}


# -- raw HTTP --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    """What the app got for one ``POST /v1/responses``."""

    status: int
    headers: CIMultiDictProxy[str]
    raw: bytes

    @property
    def is_sse(self) -> bool:
        return self.headers.get("Content-Type", "").startswith("text/event-stream")

    @property
    def json(self) -> Any:
        return orjson.loads(self.raw)

    @property
    def events(self) -> list[dict[str, Any]]:
        """The SSE events (``data`` objects), in order."""
        return [data for _, data in parse_sse(self.raw)]

    @property
    def types(self) -> list[str]:
        return [event["type"] for event in self.events]

    @property
    def response(self) -> dict[str, Any]:
        """The final response object (JSON body, or the terminal SSE event's ``response``)."""
        if not self.is_sse:
            body: dict[str, Any] = self.json
            return body
        last = self.events[-1]
        assert last["type"] in ("response.completed", "response.incomplete"), last
        response: dict[str, Any] = last["response"]
        return response

    @property
    def mode(self) -> str | None:
        return self.headers.get("x-upshift-mode")


def parse_sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data object)`` per SSE block; asserts the framing (event + data lines)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        name, data = "", b""
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                data += line[6:]
        event = orjson.loads(data)
        assert event["type"] == name, (name, event)
        out.append((name, event))
    return out


async def post(
    http: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, Any] | bytes,
    *,
    key: str | None = KEY,
    headers: dict[str, str] | None = None,
    timeout: float = 15.0,
) -> Reply:
    """``POST {base_url}/responses`` and read the whole answer."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", **(auth(key) if key else {}), **(headers or {})}
    async with http.post(
        base_url + "/responses", data=data, headers=hdrs, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        raw = await resp.read()
        return Reply(resp.status, resp.headers, raw)


def assert_openai_error(reply: Reply, status: int, code: str | None = None) -> dict[str, Any]:
    """``reply`` is a JSON ``{"error": {message, type, param, code}}`` with ``status``."""
    assert reply.status == status, (reply.status, reply.raw[:300])
    assert reply.headers.get("Content-Type", "").startswith("application/json"), reply.headers
    body = reply.json
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    if code is not None:
        assert body["error"]["code"] == code, body
    assert reply.headers.get("x-request-id", "").startswith("req_"), reply.headers
    error: dict[str, Any] = body["error"]
    return error


# -- the oracle ------------------------------------------------------------------------------------


def project(output: Iterable[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Output items without their random ids: what "the same answer" means."""
    out: list[tuple[Any, ...]] = []
    for item in output:
        kind = item.get("type")
        if kind == "message":
            out.append(("message", item.get("role"), tuple(p.get("text") for p in item.get("content", []))))
        elif kind == "function_call":
            out.append(("function_call", item.get("name"), orjson.loads(item.get("arguments") or "{}")))
        elif kind == "reasoning":
            summary = tuple(p.get("text") for p in item.get("summary", []))
            out.append(("reasoning", summary, item.get("encrypted_content")))
        else:
            out.append((kind,))
    return out


def expected_answer(items: list[dict[str, Any]], *, reply_bytes: int = 120) -> list[tuple[Any, ...]]:
    """The emulator model's answer to a plain (tool-less, reasoning-less) context."""
    result = plan(ModelRequest(context=Segment.root().extend(items), reply_bytes=reply_bytes))
    return [("message", "assistant", (p.text,)) for p in result.items]


def check_answer(emu: Emulator, response: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
    """The response completed, the upstream saw exactly ``items`` (oracle digest) and the answer
    is the model's answer for that context. Returns the oracle record."""
    assert response["status"] == "completed", response
    record = emu.record(response["id"])
    assert record is not None, f"no oracle record for {response['id']}"
    assert record["status"] == "completed", record
    assert record["context_digest"] == context_digest(items), "the upstream saw a different context"
    assert project(response["output"]) == expected_answer(items), "not the model's answer for this context"
    assert response.get("previous_response_id") is None, "the sidecar's anchor leaked to the app"
    return record


class Conversation:
    """A full-history app conversation through the sidecar (plain messages, ``store: false``)."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        emu: Emulator,
        *,
        key: str = KEY,
        name: str = "c",
        **fields: Any,
    ) -> None:
        self.http, self.base_url, self.emu, self.key, self.name = http, base_url, emu, key, name
        self.fields: dict[str, Any] = {"model": MODEL, "store": False, **fields}
        self.items: list[dict[str, Any]] = []
        self.turns = 0

    def body(self, *, stream: bool = False) -> dict[str, Any]:
        return {**self.fields, "input": self.items, **({"stream": True} if stream else {})}

    async def send(self, text: str | None = None, *, stream: bool = False, timeout: float = 15.0) -> Reply:
        """Append a user message (unless ``text`` is None: a retry) and post the history."""
        if text is not None:
            self.items.append(user(text))
        return await post(self.http, self.base_url, self.body(stream=stream), key=self.key, timeout=timeout)

    def accept(self, reply: Reply) -> dict[str, Any]:
        """Check the answer with the oracle and echo its output into the history."""
        assert reply.status == 200, (reply.status, reply.raw[:300])
        if reply.is_sse:
            assert reply.types.count(reply.types[-1]) == 1 and reply.types[-1] == "response.completed", reply.types
            assert "error" not in reply.types, reply.types
        response = reply.response
        record = check_answer(self.emu, response, self.items)
        self.items.extend(response["output"])
        self.turns += 1
        return record

    async def turn(self, text: str | None = None, *, stream: bool = False) -> dict[str, Any]:
        """One successful turn; returns the oracle record."""
        if text is None:
            text = f"{self.name} turn {self.turns}"
        return self.accept(await self.send(text, stream=stream))


# -- metrics ---------------------------------------------------------------------------------------


def metric(name: str, **labels: str) -> float:
    """A sample of the sidecar's registry (shared by every in-process sidecar: compare deltas)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def replays(cause: str) -> float:
    return metric("upshift_replays_total", cause=cause)


# -- leaks -----------------------------------------------------------------------------------------


def assert_pool_quiet(sc: Sidecar) -> None:
    """No socket is busy or connecting, and no lane is busy or draining."""
    pool = sc.pool
    assert pool.count(SocketUse.BUSY) == 0, repr(pool)
    assert pool.count(SocketUse.CONNECTING) == 0, repr(pool)
    assert "Lanes: 0 busy" in repr(pool) and "0 draining" in repr(pool), repr(pool)


def head_response_ids(sc: Sidecar) -> list[str]:
    """Response ids the head table would continue from (white-box: ``HeadTable._heads``)."""
    return [head.response_id for head in sc.heads._heads.values()]


def assert_heads_completed(sc: Sidecar, emu: Emulator) -> None:
    """Every head points at a response the upstream completed (pitfall 1)."""
    for response_id in head_response_ids(sc):
        record = emu.record(response_id)
        assert record is not None and record["status"] == "completed", (response_id, record)


_SOCKET_TASKS = ("keepalive", "ClientConnection", "Connection.")
"""Coroutines of websockets' own connections (an upstream socket has no task of its own)."""


def _name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", repr(coro))


async def leaked_tasks(
    baseline: set[asyncio.Task[Any]], *, open_sockets: int | None = None, settle: float = 2.0
) -> list[str]:
    """Tasks started since ``baseline`` still pending after up to ``settle`` seconds.

    Tasks of websockets' own connections are expected; with ``open_sockets`` given, exactly that
    many upstream connections must be live (:func:`proxy.upstream.ws.live_sockets`), else the
    mismatch is reported as a leak too.
    """
    deadline = time.monotonic() + settle
    while True:
        current = asyncio.current_task()
        extra = [t for t in asyncio.all_tasks() if t not in baseline and t is not current and not t.done()]
        leaked = sorted(_name(t) for t in extra if not _name(t).startswith(_SOCKET_TASKS))
        if open_sockets is not None:
            live = live_sockets()
            if live != open_sockets:
                leaked.append(f"{live} live upstream connections for {open_sockets} open sockets")
        if not leaked or time.monotonic() > deadline:
            return leaked
        await asyncio.sleep(0.05)


async def wait_for(predicate: Any, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``predicate()`` until true or ``timeout``; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = bool(predicate())
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(interval)


# -- a sidecar subprocess --------------------------------------------------------------------------
