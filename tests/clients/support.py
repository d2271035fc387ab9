"""Shared helpers for the end-to-end client tests (tests/clients/).

Everything runs on real sockets on 127.0.0.1: the emulator is the upstream, the sidecar sits in
front of it, and apps (the real ``openai`` SDK, ``openai-agents``, or raw HTTP bodies) talk to
the sidecar. The checks are always the same three:

* **content**: the app gets the same answers as the same loop run directly against the emulator
  (ids differ between runs; texts and arguments do not, the scripted model ignores call ids);
* **continuation**: every turn after the first went upstream as ``previous_response_id`` + only
  the new items, hitting the upstream connection cache (emulator oracle records);
* **fidelity**: the emulator's effective context digest for every response equals the digest of
  the exact input the app sent (``upshift_emulator.oracle.context_digest``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx2
from openai import AsyncOpenAI, DefaultAsyncHttpxClient, DefaultHttpxClient, OpenAI

from upshift_emulator import Emulator, context_digest
from upshift_emulator.oracle import normalize_input

JSON = Any

KEY = "sk-test-clients"
MODEL = "gpt-6.1-sol"

READ_FILE: dict[str, JSON] = {
    "type": "function",
    "name": "read_file",
    "description": "Read a file of the repository.",
    "parameters": {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
        "additionalProperties": False,
    },
    "strict": True,
}
"""A function tool; the scripted model fills ``path`` with ``src/step_<n>.txt``."""

WEATHER: dict[str, JSON] = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["São Paulo"]},
            "unit": {"type": "string", "enum": ["celsius"]},
            "day": {"type": "integer"},
        },
        "required": ["city", "unit", "day"],
        "additionalProperties": False,
    },
    "strict": True,
}
"""A function tool whose arguments carry non-ASCII text (``{"city":"São Paulo",...}``)."""

TOOLS = [READ_FILE]


def task_text(steps: int, label: str = "", *, preamble: bool = False) -> str:
    """A user message that makes the scripted model call a tool ``steps`` times, then answer;
    with ``preamble``, the model labels its messages with ``phase`` (a commentary before each
    turn's calls, the answer ``final_answer``), as newer models do."""
    ask = ", with a preamble" if preamble else ""
    return f"Task {label}: inspect the repository, steps={steps}{ask}, then summarise."


def assert_phases_kept(bodies: Sequence[dict[str, JSON]], steps: int) -> None:
    """Every assistant message the app sent back carries its ``phase`` (the model gave one to each)."""
    echoed = [i for i in normalize_input(bodies[-1].get("input")) if i.get("role") == "assistant"]
    assert len(echoed) == steps, len(echoed)
    assert all(i.get("phase") == "commentary" for i in echoed), [i.get("phase") for i in echoed]


def tool_result(name: str, arguments: str) -> str:
    """The app's deterministic tool implementation."""
    args = json.loads(arguments or "{}")
    return f"{name} -> ok: " + ", ".join(f"{k}={args[k]}" for k in sorted(args))


def _plain(item: JSON) -> dict[str, JSON]:
    if isinstance(item, dict):
        return item
    dumped: dict[str, JSON] = item.model_dump(mode="json")
    return dumped


def summarize(item: JSON) -> tuple[JSON, ...]:
    """What an output item *says* (ids, statuses and key order left out), for comparing runs."""
    data = _plain(item)
    kind = data.get("type") or ("message" if "role" in data else None)
    if kind == "function_call":
        return ("function_call", data["name"], json.loads(data["arguments"] or "{}"))
    if kind == "message":
        content = data.get("content")
        if isinstance(content, str):
            return ("message", data.get("role"), content)
        return ("message", data.get("role"), "".join(p.get("text") or p.get("refusal") or "" for p in content))
    if kind == "reasoning":
        return ("reasoning", tuple(s["text"] for s in data.get("summary") or []), data.get("encrypted_content"))
    return (str(kind), json.dumps(data, sort_keys=True))


def is_call(item: JSON) -> bool:
    """Whether an output item (model object or dict) is a function call."""
    return _plain(item).get("type") == "function_call"


def tool_outputs(output: Iterable[JSON]) -> list[dict[str, JSON]]:
    """The ``function_call_output`` items an app appends for the calls in ``output``."""
    out = []
    for item in output:
        data = _plain(item)
        if data.get("type") == "function_call":
            result = tool_result(data["name"], data["arguments"])
            out.append({"type": "function_call_output", "call_id": data["call_id"], "output": result})
    return out


# -- capturing what an SDK client actually sends --------------------------------------------------


@dataclass(slots=True)
class Exchange:
    """One ``POST /v1/responses`` as it went over the wire."""

    body: dict[str, JSON]
    size: int
    mode: str | None = None
    """The sidecar's ``x-upshift-mode`` header (``None`` when talking to the emulator)."""
    status: int | None = None


@dataclass(slots=True)
class Capture:
    """httpx event hooks recording every ``POST /v1/responses`` body and answer headers."""

    exchanges: list[Exchange] = field(default_factory=list)
    _open: dict[int, Exchange] = field(default_factory=dict)

    def _on_request(self, request: httpx2.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/responses"):
            content = request.content
            self.exchanges.append(Exchange(json.loads(content), len(content)))
            self._open[id(request)] = self.exchanges[-1]

    def _on_response(self, response: httpx2.Response) -> None:
        exchange = self._open.pop(id(response.request), None)
        if exchange is not None:
            exchange.mode = response.headers.get("x-upshift-mode")
            exchange.status = response.status_code

    async def _on_request_async(self, request: httpx2.Request) -> None:
        self._on_request(request)

    async def _on_response_async(self, response: httpx2.Response) -> None:
        self._on_response(response)

    def sync_client(self, base_url: str, api_key: str = KEY) -> OpenAI:
        """A blocking SDK client (run it in a thread: the servers live in the test's loop)."""
        hooks = {"request": [self._on_request], "response": [self._on_response]}
        http = DefaultHttpxClient(event_hooks=hooks, trust_env=False, verify=False)  # plain http on 127.0.0.1
        return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)

    def async_client(self, base_url: str, api_key: str = KEY, max_retries: int = 0) -> AsyncOpenAI:
        """An async SDK client (no retries unless asked: faults must reach the sidecar's logic)."""
        hooks = {"request": [self._on_request_async], "response": [self._on_response_async]}
        http = DefaultAsyncHttpxClient(event_hooks=hooks, trust_env=False, verify=False)
        return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=max_retries, http_client=http)

    @property
    def bodies(self) -> list[dict[str, JSON]]:
        return [e.body for e in self.exchanges]

    @property
    def modes(self) -> list[str | None]:
        return [e.mode for e in self.exchanges]

    @property
    def sizes(self) -> list[int]:
        return [e.size for e in self.exchanges]


# -- an app's tool loop with the openai SDK ------------------------------------------------------------


@dataclass(slots=True)
class Turn:
    response_id: str
    output: list[tuple[JSON, ...]]
    """``summarize``d output items."""


@dataclass(slots=True)
class Run:
    turns: list[Turn] = field(default_factory=list)

    @property
    def response_ids(self) -> list[str]:
        return [t.response_id for t in self.turns]

    @property
    def contents(self) -> list[list[tuple[JSON, ...]]]:
        return [t.output for t in self.turns]

    @property
    def output_counts(self) -> list[int]:
        return [len(t.output) for t in self.turns]

    @property
    def final_text(self) -> str:
        last = self.turns[-1].output[-1]
        assert last[0] == "message", last
        return str(last[2])

    @property
    def tool_calls(self) -> int:
        return sum(1 for t in self.turns for o in t.output if o[0] == "function_call")


COLLECT = ("create", "stream_items", "stream_completed", "stream_helper")
"""How the app gets a turn's output: ``response.output`` of a non-streamed create; the items of
``response.output_item.done`` events; ``response.completed.response.output``; or the
``responses.stream(...)`` helper's ``get_final_response().output``."""

ECHO = ("objects", "model_dump", "model_dump_json", "exclude_none", "to_dict")
"""How the app appends the output to its history: ``input += response.output`` (model objects),
``item.model_dump()``, ``json.loads(item.model_dump_json())``, ``model_dump(exclude_none=True)``,
``item.to_dict()``."""


def echo(items: Sequence[JSON], how: str) -> list[JSON]:
    """The items an app appends to its history for ``items`` (SDK model objects)."""
    if how == "objects":
        return list(items)
    if how == "model_dump":
        return [i.model_dump() for i in items]
    if how == "model_dump_json":
        return [json.loads(i.model_dump_json()) for i in items]
    if how == "exclude_none":
        return [i.model_dump(exclude_none=True) for i in items]
    if how == "to_dict":
        return [i.to_dict() for i in items]
    raise ValueError(how)


def _stream_collect(events: Iterable[JSON], collect: str) -> tuple[str, list[JSON]]:
    """The response id and output items of one streamed response; checks that the stream is
    exactly one response (one ``response.created``, ``sequence_number`` 0, 1, 2, ...)."""
    done: list[JSON] = []
    completed = None
    events = list(events)
    assert [e.type for e in events].count("response.created") == 1, [e.type for e in events]
    assert events[0].type == "response.created"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for event in events:
        if event.type == "response.output_item.done":
            done.append(event.item)
        elif event.type == "response.completed":
            completed = event.response
        elif event.type in ("response.failed", "response.incomplete", "error"):
            raise AssertionError(f"turn ended with {event.type}: {event}")
    assert completed is not None, "no response.completed event"
    return completed.id, (done if collect == "stream_items" else list(completed.output))


def _create_sync(client: OpenAI, history: list[JSON], collect: str, params: dict[str, JSON]) -> tuple[str, list[JSON]]:
    if collect == "create":
        response = client.responses.create(model=MODEL, input=history, **params)
        return response.id, list(response.output)
    if collect in ("stream_items", "stream_completed"):
        with client.responses.create(model=MODEL, input=history, stream=True, **params) as stream:
            return _stream_collect(stream, collect)
    if collect == "stream_helper":
        with client.responses.stream(model=MODEL, input=history, **params) as helper:
            final = helper.get_final_response()
        return final.id, list(final.output)
    raise ValueError(collect)


async def _create_async(
    client: AsyncOpenAI, history: list[JSON], collect: str, params: dict[str, JSON]
) -> tuple[str, list[JSON]]:
    if collect == "create":
        response = await client.responses.create(model=MODEL, input=history, **params)
        return response.id, list(response.output)
    if collect in ("stream_items", "stream_completed"):
        stream = await client.responses.create(model=MODEL, input=history, stream=True, **params)
        async with stream:
            events = [event async for event in stream]
        return _stream_collect(events, collect)
    if collect == "stream_helper":
        async with client.responses.stream(model=MODEL, input=history, **params) as helper:
            final = await helper.get_final_response()
        return final.id, list(final.output)
    raise ValueError(collect)


def run_loop_sync(
    client: OpenAI,
    task: str,
    *,
    collect: str = "create",
    echo_as: str = "objects",
    max_turns: int = 12,
    **params: JSON,
) -> Run:
    """An app's tool loop with the blocking client: call, echo the output, answer every call."""
    params.setdefault("tools", TOOLS)
    history: list[JSON] = [{"role": "user", "content": task}]
    run = Run()
    for _ in range(max_turns):
        response_id, output = _create_sync(client, history, collect, params)
        run.turns.append(Turn(response_id, [summarize(o) for o in output]))
        history += echo(output, echo_as)
        if not any(is_call(o) for o in output):
            return run
        history += tool_outputs(output)
    raise AssertionError(f"no final answer after {max_turns} turns")


async def run_loop_async(
    client: AsyncOpenAI,
    task: str,
    *,
    collect: str = "create",
    echo_as: str = "objects",
    max_turns: int = 12,
    before_turn: Any = None,
    **params: JSON,
) -> Run:
    """The same loop with ``AsyncOpenAI``. ``before_turn(index)`` (optional, may be async) runs
    before each call (tests arm faults or sleep there)."""
    params.setdefault("tools", TOOLS)
    history: list[JSON] = [{"role": "user", "content": task}]
    run = Run()
    for index in range(max_turns):
        if before_turn is not None:
            maybe = before_turn(index)
            if hasattr(maybe, "__await__"):
                await maybe
        response_id, output = await _create_async(client, history, collect, params)
        run.turns.append(Turn(response_id, [summarize(o) for o in output]))
        history += echo(output, echo_as)
        if not any(is_call(o) for o in output):
            return run
        history += tool_outputs(output)
    raise AssertionError(f"no final answer after {max_turns} turns")


# -- the emulator's oracle ------------------------------------------------------------------------------


def record(emu: Emulator, response_id: str) -> dict[str, JSON]:
    """The emulator's oracle record of ``response_id`` (fails if there is none)."""
    found = emu.record(response_id)
    assert found is not None, f"the emulator has no record of {response_id}"
    return found


def app_items(body: dict[str, JSON]) -> list[JSON]:
    """The input items of an app's request body (a string input is one user message)."""
    return normalize_input(body.get("input"))


def assert_fidelity(emu: Emulator, bodies: Sequence[dict[str, JSON]], response_ids: Sequence[str]) -> None:
    """The model saw exactly the app's input, for every response."""
    assert len(bodies) == len(response_ids), (len(bodies), len(response_ids))
    for index, (body, response_id) in enumerate(zip(bodies, response_ids, strict=True)):
        rec = record(emu, response_id)
        items = app_items(body)
        assert rec["context_digest"] == context_digest(items), f"turn {index}: effective context differs"
        assert rec["context_items"] == len(items), f"turn {index}"


def assert_continuations(
    emu: Emulator,
    bodies: Sequence[dict[str, JSON]],
    response_ids: Sequence[str],
    output_counts: Sequence[int],
    modes: Sequence[str | None] | None = None,
) -> None:
    """The first turn went upstream in full; every later one as a cache-hitting continuation of
    the previous response carrying only the items the app added since."""
    for index, response_id in enumerate(response_ids):
        rec = record(emu, response_id)
        items = app_items(bodies[index])
        assert rec["transport"] == "ws", f"turn {index}: {rec['transport']}"
        if index == 0:
            assert rec["continuation"] is False, f"turn 0: {rec}"
            assert rec["input_items"] == len(items)
            if modes is not None:
                assert modes[0] == "full"
            continue
        previous = app_items(bodies[index - 1])
        new = len(items) - len(previous) - output_counts[index - 1]
        assert new >= 1
        assert rec["continuation"] is True, f"turn {index} went upstream in full: {rec}"
        assert rec["cache_hit"] is True and rec["hydrated"] is False, f"turn {index}: {rec}"
        assert rec["previous_response_id"] == response_ids[index - 1], f"turn {index}"
        assert rec["input_items"] == new, f"turn {index}: sent {rec['input_items']} items, {new} are new"
        if modes is not None:
            assert modes[index] == "continuation", f"turn {index}: x-upshift-mode {modes[index]}"


def assert_small_frames(emu: Emulator, sizes: Sequence[int], response_ids: Sequence[str]) -> None:
    """WS bytes per continuation stay flat while the app's HTTP bodies grow with the history."""
    frames = [record(emu, r)["input_bytes"] for r in response_ids[1:]]
    assert len(frames) >= 2
    assert max(frames) - min(frames) < 256, f"continuation frames grow: {frames}"
    assert all(b > a for a, b in zip(sizes, sizes[1:], strict=False)), f"HTTP bodies do not grow: {sizes}"
    assert sizes[-1] - sizes[1] > 2 * (max(frames) - min(frames)) + 400, (sizes, frames)
    for frame, size in zip(frames[1:], sizes[2:], strict=False):
        assert frame < size, (frames, sizes)


# -- sidecar metrics ------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


async def metrics(admin_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every ``upshift_*`` sample of the sidecar's ``/metrics``."""
    async with aiohttp.ClientSession() as session, session.get(admin_url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match.group(1).startswith("upshift_"):
            continue
        labels = frozenset(_LABEL.findall(match.group(3) or ""))
        out[(match.group(1), labels)] = float(match.group(4))
    return out


def sample(snapshot: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return snapshot.get((name, frozenset(labels.items())), 0.0)


def delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    """How much a counter moved (the metrics registry is shared by every sidecar in the process)."""
    return sample(after, name, **labels) - sample(before, name, **labels)


# -- raw HTTP ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    """An answer to a raw ``POST /v1/responses``."""

    status: int
    headers: dict[str, str]
    body: JSON
    """The JSON body; for SSE, the ``response`` of the terminal event (or the error)."""
    events: list[dict[str, JSON]] = field(default_factory=list)

    @property
    def mode(self) -> str | None:
        return self.headers.get("x-upshift-mode")

    @property
    def output(self) -> list[JSON]:
        assert self.status == 200, (self.status, self.body)
        out: list[JSON] = self.body["output"]
        return out


def parse_sse(data: bytes) -> list[dict[str, JSON]]:
    """The JSON events of an SSE body; checks that ``event:`` names the JSON ``type``."""
    events = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        name, payload = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                payload.append(line[5:].lstrip())
        if not payload:
            continue
        event = json.loads("\n".join(payload))
        if name is not None:
            assert name == event.get("type"), (name, event.get("type"))
        events.append(event)
    return events


async def post(
    session: aiohttp.ClientSession, base_url: str, body: dict[str, JSON] | bytes, *, api_key: str = KEY
) -> Reply:
    """``POST {base_url}/responses`` with raw JSON bytes (as given, or compact)."""
    data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    async with session.post(base_url + "/responses", data=data, headers=headers) as response:
        raw = await response.read()
        head = {k.lower(): v for k, v in response.headers.items()}
        if response.content_type == "text/event-stream":
            events = parse_sse(raw)
            terminal = events[-1]
            if terminal["type"] in ("response.completed", "response.incomplete", "response.failed"):
                return Reply(response.status, head, terminal["response"], events)
            return Reply(response.status, head, terminal, events)
        return Reply(response.status, head, json.loads(raw))
