"""Today's protocol (protocol.md §7) through the sidecar with the real openai SDK, whose types carry
every field used here (``reasoning.context``, ``prompt_cache_breakpoint``, ``compaction_trigger``,
``responses.compact``, ``service_tier="ultrafast"``, ``program`` items and ``caller``).

For each scenario: the model's context equals the app's on every request (the emulator's oracle,
which applies the model's own reading rules: a compaction item stands for everything before it,
``current_turn`` does not read earlier user turns' reasoning), the answers are right, and where
the fidelity decision of docs/fidelity.md makes chaining safe, at least 75% of those later turns
are continued (measured and asserted; the figures are in docs/fidelity.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import openai
import pytest
import websockets
from openai import AsyncOpenAI

from proxy.observe.log import ACCESS_LOGGER
from proxy.ops.explain_cmd import _describe as describe
from proxy.ops.explain_cmd import explain_files
from proxy.reasons import MissReason
from tests.sidecar import Sidecar
from upshift_emulator import Emulator
from upshift_emulator.oracle import context_digest

from .support import KEY, MODEL, TOOLS, Capture, app_items, delta, metrics, post, record

pytestmark = pytest.mark.timeout(90)
JSON = Any
CONVERSATIONS = 3
TURNS = 5


def dump(items: Sequence[Any]) -> list[JSON]:
    """Echo output items the way most apps do (``model_dump(exclude_none=True)``)."""
    return [i.model_dump(exclude_none=True, warnings=False) for i in items]


def user(text: str, **part: Any) -> dict[str, JSON]:
    return {"role": "user", "content": [{"type": "input_text", "text": text, **part}]}


def outputs(items: Sequence[JSON], result: str = "ok") -> list[JSON]:
    return [
        {"type": "function_call_output", "call_id": i["call_id"], "output": result}
        for i in items
        if i.get("type") == "function_call"
    ]


def assert_read(emu: Emulator, capture: Capture, ids: Sequence[str], rule: str = "all_turns") -> None:
    """The oracle: on every request the model read exactly what the app's own history gives."""
    assert len(capture.bodies) == len(ids)
    for index, (body, rid) in enumerate(zip(capture.bodies, ids, strict=True)):
        rec = record(emu, rid)
        assert rec["context_digest"] == context_digest(app_items(body), rule), f"request {index}"


def continued(emu: Emulator, ids: Sequence[str]) -> list[bool]:
    return [bool(record(emu, rid)["continuation"]) for rid in ids]


def share(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


# -- a rolling cache breakpoint ------------------------------------------------------------------


def roll_breakpoint(history: list[JSON]) -> list[JSON]:
    """What an app with the Anthropic habit does each turn: one breakpoint, on the newest message."""
    out = []
    for item in history:
        content = item.get("content")
        if item.get("role") == "user" and isinstance(content, list):
            parts = [{k: v for k, v in p.items() if k != "prompt_cache_breakpoint"} for p in content]
            item = {**item, "content": parts}
        out.append(item)
    last = out[-1]
    last["content"][-1]["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return out


async def test_rolling_cache_breakpoint(emulator: Emulator, sidecar: Sidecar) -> None:
    recording = emulator.state.start_recording()
    capture = Capture()
    client = capture.async_client(sidecar.base_url)
    direct = AsyncOpenAI(base_url=emulator.base_url, api_key=KEY, max_retries=0)
    ids: list[str] = []
    later: list[str] = []
    for conv in range(CONVERSATIONS):
        history: list[JSON] = []
        for turn in range(TURNS):
            history = roll_breakpoint([*history, user(f"conversation {conv} question {turn}")])
            options: Any = {"mode": "explicit"}
            reply = await client.responses.create(model=MODEL, input=history, prompt_cache_options=options)
            alone = await direct.responses.create(model=MODEL, input=history, prompt_cache_options=options)
            assert reply.output_text == alone.output_text  # the right answer
            ids.append(reply.id)
            later += [reply.id] if turn else []
            history += dump(reply.output)
    assert_read(emulator, capture, ids)
    assert share(continued(emulator, later)) >= 0.75, continued(emulator, later)
    # The continuation's own new item carries the app's breakpoint unchanged.
    frames = [r["body"] for r in recording if r["transport"] == "ws" and r["body"].get("previous_response_id")]
    assert frames and all(
        f["input"][-1]["content"][-1]["prompt_cache_breakpoint"] == {"mode": "explicit"} for f in frames
    )


# -- reasoning.context with an app that drops reasoning ------------------------------------------


async def dropping_app(client: AsyncOpenAI, reasoning: dict[str, str], label: str) -> tuple[list[str], list[bool]]:
    """Three user turns, each a one-call tool loop; the app's history never keeps reasoning items
    (Cline, llama-index). Returns the response ids and, per request, whether it starts a user
    turn (its dropped reasoning belongs to earlier user turns) rather than continuing a tool loop."""
    history: list[JSON] = []
    ids: list[str] = []
    starts: list[bool] = []
    for turn in range(3):
        history.append(user(f"{label} turn {turn}: steps=1"))
        for step in range(2):
            params: Any = {"reasoning": reasoning}
            reply = await client.responses.create(model=MODEL, input=history, tools=TOOLS, **params)
            ids.append(reply.id)
            starts.append(step == 0)
            out = dump(reply.output)
            assert out[0]["type"] == "reasoning"
            kept = [i for i in out if i["type"] != "reasoning"]
            history += kept + outputs(kept, "read_file -> ok")
        assert reply.output_text.endswith("Last output: read_file -> ok"), reply.output_text
    return ids, starts


@pytest.mark.parametrize("context", ["current_turn", "all_turns", None])
async def test_reasoning_context_with_dropped_reasoning(
    emulator: Emulator, sidecar: Sidecar, context: str | None
) -> None:
    capture = Capture()
    client = capture.async_client(sidecar.base_url)
    reasoning = {"effort": "low"} | ({"context": context} if context else {})
    ids: list[str] = []
    starts: list[bool] = []
    for conv in range(CONVERSATIONS):
        got, begun = await dropping_app(client, reasoning, f"c{conv}")
        ids += got
        starts += begun
    rule = context or "all_turns"  # gpt-6.1-sol's auto
    assert_read(emulator, capture, ids, rule)
    flags = continued(emulator, ids)
    new_user_turns = [f for f, s, i in zip(flags, starts, range(len(ids)), strict=True) if s and i % 6]
    # Reasoning of the current tool loop is read: a request never continues the response whose
    # reasoning it left out (it may continue an older one, whose left-out reasoning is unread).
    for index, start in enumerate(starts):
        if not start:
            assert record(emulator, ids[index])["previous_response_id"] != ids[index - 1], index
    if context == "current_turn":
        assert share(new_user_turns) >= 0.75, flags  # earlier user turns' reasoning is not read
    else:
        assert not any(flags)  # all_turns (and auto): every dropped reasoning item is read


# -- compaction v2 and a history pruned at its latest compaction item ---------------------------


async def test_compaction_then_pruned_history(emulator: Emulator, sidecar: Sidecar) -> None:
    capture = Capture()
    client = capture.async_client(sidecar.base_url)
    direct = AsyncOpenAI(base_url=emulator.base_url, api_key=KEY, max_retries=0)
    ids: list[str] = []
    later: list[str] = []
    for conv in range(CONVERSATIONS):
        history: list[JSON] = []
        for turn in range(TURNS):
            history.append(user(f"c{conv} question {turn}"))
            if turn == 2:
                history.append({"type": "compaction_trigger"})
            reply = await client.responses.create(model=MODEL, input=history, store=False)
            alone = await direct.responses.create(model=MODEL, input=history, store=False)
            assert reply.output_text == alone.output_text
            out = dump(reply.output)
            if turn == 2:
                assert [i["type"] for i in out] == ["compaction", "message"]
                history = out  # Codex-style: drop everything before the latest compaction item
            else:
                history += out
            ids.append(reply.id)
            later += [reply.id] if turn else []
    assert_read(emulator, capture, ids)
    flags = continued(emulator, later)
    assert all(flags), flags  # the turn after the prune continues the chain that compacted
    # A pruned history whose echo after the compaction item differs: a full send, same context.
    edited = [history[0], {**history[1], "content": [{"type": "output_text", "text": "edited"}]}, user("again")]
    reply = await client.responses.create(model=MODEL, input=edited, store=False)
    assert capture.modes[-1] == "full" and record(emulator, reply.id)["continuation"] is False
    assert record(emulator, reply.id)["context_digest"] == context_digest(edited)


# -- a standalone /compact, then the next turns --------------------------------------------------


async def test_standalone_compact_then_new_chain(
    emulator: Emulator, sidecar: Sidecar, access_lines: list[dict[str, Any]]
) -> None:
    capture = Capture()
    client = capture.async_client(sidecar.base_url)
    history: list[JSON] = [user("plan the migration")]
    first = await client.responses.create(model=MODEL, input=history)
    history += dump(first.output)
    history.append(user("and the rollback"))
    second = await client.responses.create(model=MODEL, input=history)
    history += dump(second.output)
    window = await client.responses.compact(model=MODEL, input=history)
    assert window.output[-1].type == "compaction" and len(window.output) == 3  # two user messages, one compaction
    base = dump(window.output)  # a new chain: the window as its base input, never pruned
    chain: list[JSON] = list(base)
    ids: list[str] = []
    for turn in range(TURNS):
        chain.append(user(f"next step {turn}"))
        reply = await client.responses.create(model=MODEL, input=chain)
        ids.append(reply.id)
        chain += dump(reply.output)
    bodies = capture.bodies
    capture.exchanges[:] = [e for e in capture.exchanges if e.body.get("input") and e.body["input"][0] == base[0]]
    assert_read(emulator, capture, ids)
    flags = continued(emulator, ids)
    assert flags[0] is False and share(flags[1:]) >= 0.75, flags  # a new chain, then continued
    assert emulator.stats.other_requests["compact"] == 1 and len(bodies) == 2 + TURNS
    compact_line = next(line for line in access_lines if line.get("route") == "other")
    sent = json.dumps({"model": MODEL, "input": history}, separators=(",", ":")).encode()  # the SDK's bytes
    assert compact_line["bytes_in"] == len(sent)


# -- Ultrafast with tier fallback ----------------------------------------------------------------


async def test_ultrafast_with_fallback(make_emulator_today: Any, access_lines: list[dict[str, Any]]) -> None:
    emulator, sidecar = await make_emulator_today(ultrafast_fallback_every=4)
    before = await metrics(sidecar.admin_url)
    capture = Capture()
    client = capture.async_client(sidecar.base_url)
    ids: list[str] = []
    served: list[str | None] = []
    for conv in range(CONVERSATIONS):
        history: list[JSON] = []
        for turn in range(TURNS):
            history.append(user(f"c{conv} fast question {turn}"))
            reply = await client.responses.create(model=MODEL, input=history, service_tier="ultrafast")
            ids.append(reply.id)
            served.append(reply.service_tier)
            history += dump(reply.output)
    assert_read(emulator, capture, ids)
    tiers = emulator.stats.tiers
    assert served.count("default") == tiers["ultrafast->default"] >= 3  # the served tier, exactly
    assert served.count("ultrafast") == tiers["ultrafast->ultrafast"]
    later = [rid for index, rid in enumerate(ids) if index % TURNS]
    assert share(continued(emulator, later)) >= 0.75
    after = await metrics(sidecar.admin_url)  # the requested and the served tier, as bounded labels
    fallbacks = delta(before, after, "upshift_service_tiers_total", requested="ultrafast", served="default")
    assert fallbacks == tiers["ultrafast->default"]
    served_fast = delta(before, after, "upshift_service_tiers_total", requested="ultrafast", served="ultrafast")
    assert served_fast == tiers["ultrafast->ultrafast"]
    logged = [(line["tier_requested"], line["tier_served"]) for line in access_lines if "tier_served" in line]
    assert logged == [("ultrafast", tier) for tier in served]


async def test_ultrafast_429_is_its_own_limit(make_emulator_today: Any) -> None:
    """An Ultrafast 429 reaches the app as the upstream sent it; it teaches nothing about the
    identity's sockets (the learned caps come from refused upgrades, which carry no tier), so the
    Standard tier's next turn continues on the same socket."""
    emulator, sidecar = await make_emulator_today(ultrafast_rate_limit=2)
    capture = Capture()
    client = capture.async_client(sidecar.base_url)
    history: list[JSON] = [user("fast one")]
    for _ in range(2):
        reply = await client.responses.create(model=MODEL, input=history, service_tier="ultrafast")
        history += [*dump(reply.output), user("fast again")]
    with pytest.raises(openai.RateLimitError) as info:
        await client.responses.create(model=MODEL, input=history, service_tier="ultrafast")
    assert "ultrafast" in info.value.message and info.value.response.headers["retry-after"] == "60"
    standard = await client.responses.create(model=MODEL, input=history)  # another tier: not limited
    assert standard.service_tier == "default"
    assert not sidecar.pool.planner.caps
    assert emulator.stats.ws_connections["opened"] == 1  # no socket given up, none held off


# -- a safeguard pause mid-stream ----------------------------------------------------------------


async def test_eight_second_safeguard_pause(make_emulator_today: Any) -> None:
    emulator, sidecar = await make_emulator_today(safeguard_pause_s=8.0)
    capture = Capture()
    client = capture.async_client(sidecar.base_url)
    history: list[JSON] = [user("hello")]
    first = await client.responses.create(model=MODEL, input=history)
    history += [*dump(first.output), user("safeguard: review this answer")]
    started = time.monotonic()
    async with client.responses.stream(model=MODEL, input=history) as stream:
        kinds = [event.type async for event in stream]
        paused = await stream.get_final_response()
    assert time.monotonic() - started >= 8.0
    assert kinds[-1] == "response.completed" and "error" not in kinds
    assert emulator.stats.requests["ws"] == 2 and emulator.stats.requests["http"] == 0  # no replay
    assert capture.modes == ["full", "continuation"]
    assert_read(emulator, capture, [first.id, paused.id])


# -- stream_options.include_obfuscation: false ---------------------------------------------------


@pytest.mark.parametrize("include", [False, None])
async def test_no_obfuscation_when_asked(emulator: Emulator, sidecar: Sidecar, include: bool | None) -> None:
    """The app reads the SSE bytes itself (the SDK's event models keep no ``obfuscation``)."""
    deltas = obfuscated = 0
    ids: list[str] = []
    bodies: list[dict[str, JSON]] = []
    modes: list[str | None] = []
    history: list[JSON] = []
    async with aiohttp.ClientSession() as session:
        for turn in range(TURNS):
            history.append(user(f"tell me more {turn}"))
            body: dict[str, JSON] = {"model": MODEL, "input": history, "stream": True}
            if include is not None:
                body["stream_options"] = {"include_obfuscation": include}
            reply = await post(session, sidecar.base_url, body)
            for event in reply.events:
                if event["type"].endswith(".delta"):
                    deltas += 1
                    obfuscated += "obfuscation" in event
            ids.append(reply.body["id"])
            bodies.append(body)
            modes.append(reply.mode)
            history = [*history, *reply.output]
    assert deltas >= 25
    assert obfuscated == (0 if include is False else deltas)
    for index, (body, rid) in enumerate(zip(bodies, ids, strict=True)):
        assert record(emulator, rid)["context_digest"] == context_digest(app_items(body)), index
    assert modes[1:] == ["continuation"] * (TURNS - 1)
    assert share(continued(emulator, ids[1:])) >= 0.75


# -- programmatic tool calls ---------------------------------------------------------------------


PROGRAM_TOOLS = [{**TOOLS[0], "allowed_callers": ["direct", "programmatic"]}]


@pytest.mark.parametrize("echo", ["exact", "caller_dropped"])
async def test_programmatic_tool_calls(emulator: Emulator, sidecar: Sidecar, echo: str) -> None:
    capture = Capture()
    client = capture.async_client(sidecar.base_url)
    ids: list[str] = []
    for conv in range(CONVERSATIONS):
        history: list[JSON] = []
        for turn in range(2):
            history.append(user(f"c{conv} task {turn}: run it as a program, steps=1"))
            for _ in range(2):
                reply = await client.responses.create(model=MODEL, input=history, tools=PROGRAM_TOOLS)  # type: ignore[arg-type]
                ids.append(reply.id)
                out = dump(reply.output)
                if echo == "caller_dropped":
                    out = [{k: v for k, v in i.items() if k != "caller"} for i in out]
                history += out + outputs(out, "42")
            assert [i["type"] for i in dump(reply.output)] == ["program_output", "message"]
            assert reply.output_text.endswith("Last output: 42")
    assert_read(emulator, capture, ids)
    flags = continued(emulator, [rid for index, rid in enumerate(ids) if index % 4])
    if echo == "exact":
        assert share(flags) >= 0.75, flags
    else:
        assert not any(flags[::3]), flags  # the echo of a call without its caller is another context


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(dict(vars(record)))  # the line's fields are the record's extras


@pytest.fixture
def access_lines() -> Any:
    """The sidecar's access lines as dicts (the logger's own records)."""
    handler = _Lines()
    logger = logging.getLogger(ACCESS_LOGGER)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
async def make_emulator_today() -> Any:
    """An emulator with settings of its own and a default sidecar in front of it."""
    made: list[Any] = []

    async def make(**settings: Any) -> tuple[Emulator, Sidecar]:
        emu = Emulator(**settings)
        await emu.start()
        sidecar = Sidecar(emu.base_url)
        await sidecar.start()
        made.append((emu, sidecar))
        return emu, sidecar

    yield make
    for emu, sidecar in reversed(made):
        await sidecar.stop()
        await emu.stop()
    await asyncio.sleep(0)


# -- both response.create envelopes through the downstream WebSocket relay -------------------------


async def test_both_create_envelopes_relayed_unchanged(emulator: Emulator, sidecar: Sidecar) -> None:
    recording = emulator.state.start_recording()
    body = {"model": MODEL, "input": "relay me", "store": False}
    frames = [
        json.dumps({"type": "response.create", "response": body}, separators=(",", ":")),
        json.dumps({"type": "response.create", **body}, separators=(",", ":")),
    ]
    ws_url = sidecar.base_url.replace("http://", "ws://") + "/responses"
    answers = []
    async with websockets.connect(ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as conn:
        for frame in frames:
            await conn.send(frame)
            while True:
                event = json.loads(await asyncio.wait_for(conn.recv(), 5))
                if event["type"] in ("response.completed", "error"):
                    answers.append(event)
                    break
    assert [r["body"] for r in recording] == [json.loads(f) for f in frames]  # unchanged, both shapes
    assert [a["type"] for a in answers] == ["response.completed"] * 2
    first, second = (record(emulator, a["response"]["id"]) for a in answers)
    assert first["context_digest"] == second["context_digest"] == context_digest([user("relay me")])


async def test_explain_a_pruned_history(emulator: Emulator) -> None:
    """``upshift explain`` on a history pruned at a compaction item: the one the previous output
    held continues; an edited echo after it is ``pruned_at_compaction``, in words."""
    previous = {"model": MODEL, "input": [user("long task"), {"type": "compaction_trigger"}], "store": False}
    async with aiohttp.ClientSession() as session:
        response = (await post(session, emulator.base_url, previous)).body
    compaction, answer = response["output"]
    good = {**previous, "input": [compaction, answer, user("go on")]}
    edited = {**previous, "input": [compaction, {**answer, "content": [{"type": "output_text", "text": "x"}]}]}
    edited["input"].append(user("go on"))
    raw = json.dumps(previous).encode()
    kept = explain_files(raw, response, json.dumps(good).encode(), tolerate=())
    assert kept[0] == "continuation" and kept[1] == 1
    verdict, explanation = explain_files(raw, response, json.dumps(edited).encode(), tolerate=())
    assert verdict == "miss" and explanation.reason == MissReason.PRUNED_AT_COMPACTION
    assert "starts at a compaction item" in "\n".join(describe(explanation, "completed"))
