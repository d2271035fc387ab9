"""Every client echo pattern of client-echo.md, as raw HTTP bodies through the sidecar.

Each style rebuilds the previous output the way a real client does (dropped ids and statuses,
``model_dump()`` nulls, chat-style messages, re-serialised arguments, item references, Codex and
openai-node extras, ...). For every turn the same body also goes straight to the emulator over
HTTP, so each answer is compared with a direct full-history request of the same input.

* Equal context → a continuation (after the first turn), and the emulator's effective context
  digest equals the digest of the app's input.
* A meaning-changing mutation (edited message, changed argument, reordered items, dropped tool
  output or assistant message) → the full history goes upstream without an anchor, and the answer
  equals the direct request's; the turn after it continues the new chain.
* Dropped reasoning items → full history by default; a continuation only with
  ``matching.tolerate: [reasoning]`` (or the deprecated ``matching.allow_dropped_reasoning``).
* The tool script asks for a ``preamble``, so the model labels its messages with ``phase``
  (``commentary`` before each call, ``final_answer`` at the end): every faithful style keeps it
  and continues. A style that drops ``phase`` (LangChain's chat form, llama-index, hand-built
  ``{"role", "content"}`` histories) goes full by default and continues, counted, only with
  ``matching.tolerate: [phase]``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from openai._models import construct_type
from openai.types.responses import Response

from tests.sidecar import Sidecar
from upshift_emulator import Emulator, context_digest

from .support import (
    MODEL,
    READ_FILE,
    WEATHER,
    Reply,
    delta,
    metrics,
    post,
    record,
    summarize,
    tool_result,
)

JSON = Any
Item = dict[str, JSON]

# -- how clients build their own items ---------------------------------------------------------------


def user_plain(text: str, turn: str) -> Item:
    return {"role": "user", "content": text}


def user_agents(text: str, turn: str) -> Item:
    return {"content": text, "role": "user"}


def user_langchain(text: str, turn: str) -> Item:
    return {"type": "message", "content": text, "role": "user"}


def user_vercel(text: str, turn: str) -> Item:
    return {"role": "user", "content": [{"type": "input_text", "text": text}]}


def user_codex(text: str, turn: str) -> Item:
    return {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
        "id": f"msg_user_{turn}",
        "internal_chat_message_metadata_passthrough": {"turn_id": turn},
    }


def fco_plain(call: Item, turn: str) -> Item:
    return {
        "type": "function_call_output",
        "call_id": call["call_id"],
        "output": tool_result(call["name"], call["arguments"]),
    }


def fco_langchain(call: Item, turn: str) -> Item:
    return {
        "type": "function_call_output",
        "output": tool_result(call["name"], call["arguments"]),
        "call_id": call["call_id"],
    }


def fco_codex(call: Item, turn: str) -> Item:
    return {
        "type": "function_call_output",
        "call_id": call["call_id"],
        "output": tool_result(call["name"], call["arguments"]),
        "id": "fco_" + call["call_id"][5:],
        "internal_chat_message_metadata_passthrough": {"turn_id": turn},
    }


# -- how clients echo the previous output ------------------------------------------------------------


def sdk_objects(output: list[Item]) -> list[Any]:
    """The output as the Python SDK parses it (``construct_type``, as for real responses)."""
    body = {
        "id": "resp_x",
        "object": "response",
        "created_at": 0,
        "status": "completed",
        "model": MODEL,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    return list(construct_type(type_=Response, value=body).output)


def echo_verbatim(output: list[Item]) -> list[Item]:
    return copy.deepcopy(output)


def echo_drop_ids_status(output: list[Item]) -> list[Item]:
    out = []
    for item in copy.deepcopy(output):
        if item["type"] in ("message", "function_call"):
            item.pop("id", None)
            item.pop("status", None)
        out.append(item)
    return out


def echo_model_dump(output: list[Item]) -> list[Item]:
    return [o.model_dump() for o in sdk_objects(output)]


def echo_model_dump_json(output: list[Item]) -> list[Item]:
    return [json.loads(o.model_dump_json()) for o in sdk_objects(output)]


def echo_exclude_none(output: list[Item]) -> list[Item]:
    return [o.model_dump(exclude_none=True) for o in sdk_objects(output)]


def echo_to_dict(output: list[Item]) -> list[Item]:
    return [o.to_dict() for o in sdk_objects(output)]


def echo_stream_async_both(output: list[Item]) -> list[Item]:
    """The SDK's ``stream()`` path: function calls carry both ``async_`` and ``async``."""
    out = []
    for item in echo_model_dump(output):
        if item["type"] == "function_call":
            item["async"] = None
        out.append(item)
    return out


def echo_chat(output: list[Item]) -> list[Item]:
    """``[{"role": el.role, "content": el.content} for el in response.output]``."""
    return [
        {"role": o.role, "content": [p.model_dump(exclude_unset=True) for p in o.content]} for o in sdk_objects(output)
    ]


def echo_string_content(output: list[Item]) -> list[Item]:
    """``{"role": "assistant", "content": response.output_text}``."""
    text = "".join(p["text"] for o in output if o["type"] == "message" for p in o["content"])
    return [{"role": "assistant", "content": text}]


def _langchain(output: list[Item], dumps: Callable[[Any], str]) -> list[Item]:
    out: list[Item] = []
    for item in output:
        if item["type"] == "function_call":
            args = dumps(json.loads(item["arguments"]))
            out.append(
                {
                    "type": "function_call",
                    "name": item["name"],
                    "arguments": args,
                    "call_id": item["call_id"],
                    "id": item["id"],
                }
            )
        elif item["type"] == "message":
            parts = [
                {"type": "output_text", "text": p["text"], "annotations": p["annotations"]} for p in item["content"]
            ]
            message = {"type": "message", "content": parts, "role": "assistant", "id": item["id"]}
            if "phase" in item:
                message["phase"] = item["phase"]
            out.append(message)
        else:
            out.append({k: v for k, v in item.items() if v is not None})
    return out


def echo_langchain_v0(output: list[Item]) -> list[Item]:
    """``output_version="v0"``: arguments re-serialised by ``json.dumps(ensure_ascii=False)``."""
    return _langchain(output, lambda a: json.dumps(a, ensure_ascii=False))


def echo_langchain_v1(output: list[Item]) -> list[Item]:
    """``output_version="v1"``: ``json.dumps(separators=(",", ":"))`` escapes non-ASCII."""
    return _langchain(output, lambda a: json.dumps(a, separators=(",", ":")))


def _vercel_call(item: Item) -> Item:
    args = json.dumps(json.loads(item["arguments"]), separators=(",", ":"), ensure_ascii=False)
    return {"type": "function_call", "call_id": item["call_id"], "name": item["name"], "arguments": args}


def echo_vercel_store_false(output: list[Item]) -> list[Item]:
    out: list[Item] = []
    for item in output:
        if item["type"] == "reasoning":
            out.append(
                {
                    "type": "reasoning",
                    "id": item["id"],
                    "encrypted_content": item["encrypted_content"],
                    "summary": item["summary"],
                }
            )
        elif item["type"] == "function_call":
            out.append(_vercel_call(item))
        else:
            parts = [{"type": "output_text", "text": p["text"]} for p in item["content"]]
            message = {"role": "assistant", "content": parts, "id": item["id"]}
            if "phase" in item:
                message["phase"] = item["phase"]
            out.append(message)
    return out


def echo_item_reference(output: list[Item]) -> list[Item]:
    """Vercel without ``store:false``: reasoning and messages as ``item_reference``."""
    return [
        _vercel_call(item) if item["type"] == "function_call" else {"type": "item_reference", "id": item["id"]}
        for item in output
    ]


def echo_node_parsed(output: list[Item]) -> list[Item]:
    """openai-node ``stream().finalResponse()``: ``parsed_arguments`` and ``parsed: null`` extras."""
    out = []
    for item in copy.deepcopy(output):
        if item["type"] == "function_call":
            item["parsed_arguments"] = json.loads(item["arguments"])
        elif item["type"] == "message":
            for part in item["content"]:
                part["parsed"] = None
        out.append(item)
    return out


def echo_codex(output: list[Item], turn: str = "") -> list[Item]:
    out: list[Item] = []
    for item in output:
        if item["type"] == "reasoning":
            new = {
                "type": "reasoning",
                "id": item["id"],
                "summary": item["summary"],
                "content": None,
                "encrypted_content": item["encrypted_content"],
            }
        elif item["type"] == "function_call":
            keys = ("type", "status", "id", "name", "arguments", "call_id")
            new = {k: item[k] for k in keys}
        else:
            keys = ("type", "role", "content", "id", "status", "phase")
            new = {k: item[k] for k in keys if k in item}
        new["internal_chat_message_metadata_passthrough"] = {"turn_id": turn}
        out.append(new)
    return out


def echo_agents_reasoning_omitted(output: list[Item]) -> list[Item]:
    """openai-agents: ``model_dump(exclude_unset=True)``; ``reasoning_item_id_policy="omit"``."""
    out = []
    for obj in sdk_objects(output):
        item = obj.model_dump(exclude_unset=True)
        if item["type"] == "reasoning":
            item.pop("id", None)
        out.append(item)
    return out


def _reversed_keys(value: JSON) -> JSON:
    if isinstance(value, dict):
        return {k: _reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed_keys(v) for v in value]
    return value


def echo_key_order(output: list[Item]) -> list[Item]:
    return [_reversed_keys(item) for item in output]


def echo_drop_reasoning(output: list[Item]) -> list[Item]:
    return [copy.deepcopy(i) for i in output if i["type"] != "reasoning"]


def echo_drop_phase(output: list[Item]) -> list[Item]:
    """LangChain's chat form, llama-index: assistant messages sent back without ``phase``."""
    return [{k: v for k, v in i.items() if k != "phase"} for i in copy.deepcopy(output)]


# -- styles --------------------------------------------------------------------------------------------

REASONING_STORE_FALSE = {
    "store": False,
    "reasoning": {"effort": "low", "summary": "auto"},
    "include": ["reasoning.encrypted_content"],
}


@dataclass(frozen=True)
class Style:
    echo: Callable[..., list[Item]]
    user: Callable[[str, str], Item] = user_plain
    fco: Callable[[Item, str], Item] = fco_plain
    body: dict[str, JSON] = field(default_factory=dict)
    tool: dict[str, JSON] = field(default_factory=lambda: WEATHER)
    first: tuple[Item, ...] = ()
    """Items before the first user message (a system/developer prompt)."""
    per_request: Callable[[int, dict[str, JSON]], None] | None = None
    """Changes a request body in place before it is sent (what clients vary per request)."""
    turn_aware: bool = False
    """``echo`` takes the current turn id (Codex tags echoed items with it)."""


def codex_metadata(request: int, body: dict[str, JSON]) -> None:
    """Codex's ``client_metadata``: new turn ids, and a HashMap's key order, every request."""
    keys = ["x-codex-turn-metadata", "originator", "x-codex-window-id"]
    values = {
        "x-codex-turn-metadata": json.dumps({"turn_id": f"turn-{request}", "request_kind": "turn"}),
        "originator": "codex_exec",
        "x-codex-window-id": "thread-1:0",
    }
    order = keys[request % 3 :] + keys[: request % 3]
    body["client_metadata"] = {k: values[k] for k in order}


def include_order_flips(request: int, body: dict[str, JSON]) -> None:
    """openai-agents builds ``include`` from a set: its order may differ between requests."""
    if request % 2:
        body["include"].reverse()


def stream_flips(request: int, body: dict[str, JSON]) -> None:
    """An app that switches between streamed and non-streamed turns."""
    body["stream"] = request % 2 == 1


STYLES: dict[str, Style] = {
    "verbatim": Style(echo_verbatim),
    "drop_ids_status": Style(echo_drop_ids_status),
    "model_dump_nulls": Style(echo_model_dump),
    "model_dump_json_nulls": Style(echo_model_dump_json, body={"reasoning": {"effort": "low"}}),
    "exclude_none": Style(echo_exclude_none, body=REASONING_STORE_FALSE),
    "to_dict": Style(echo_to_dict),
    "async_to_async_underscore": Style(echo_stream_async_both, tool=READ_FILE),
    "langchain_v0_args_reserialised": Style(
        echo_langchain_v0, user=user_langchain, fco=fco_langchain, body={"stream": False}
    ),
    "langchain_v1_args_ascii_escaped": Style(
        echo_langchain_v1, user=user_langchain, fco=fco_langchain, body={"stream": False}
    ),
    "vercel_store_false": Style(
        echo_vercel_store_false,
        user=user_vercel,
        body={**REASONING_STORE_FALSE, "tool_choice": "auto"},
        first=({"role": "developer", "content": "You are a travel assistant."},),
    ),
    "item_reference_store_default": Style(
        echo_item_reference,
        user=user_vercel,
        body={"reasoning": {"effort": "low", "summary": "auto"}, "tool_choice": "auto"},
        first=({"role": "developer", "content": "You are a travel assistant."},),
    ),
    "node_parsed_extras": Style(echo_node_parsed, body={"stream": True}),
    "codex": Style(
        echo_codex,
        user=user_codex,
        fco=fco_codex,
        body={
            "stream": True,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": {"effort": "medium"},
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "thread-1",
            "text": {"verbosity": "low"},
        },
        first=(
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex, a coding agent."}],
                "id": "msg_developer",
                "internal_chat_message_metadata_passthrough": {"turn_id": "turn-0"},
            },
        ),
        per_request=codex_metadata,
        turn_aware=True,
    ),
    "agents_reasoning_id_omitted": Style(
        echo_agents_reasoning_omitted,
        user=user_agents,
        body={**REASONING_STORE_FALSE, "instructions": "You help travellers."},
    ),
    "key_order_changed": Style(echo_key_order, body=REASONING_STORE_FALSE),
    "include_order_changes": Style(
        echo_exclude_none,
        user=user_agents,
        body={**REASONING_STORE_FALSE, "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]},
        per_request=include_order_flips,
    ),
    "stream_switches": Style(echo_to_dict, per_request=stream_flips),
}

CHAT_STYLES: dict[str, Style] = {
    "chat_role_content": Style(echo_chat),
    "assistant_content_string": Style(echo_string_content),
    "chat_model_dump": Style(echo_model_dump),
    "chat_key_order": Style(echo_key_order, user=user_agents),
    "chat_vercel_no_type": Style(echo_vercel_store_false, user=user_vercel, body={"store": False}),
    "chat_item_reference": Style(echo_item_reference, user=user_vercel),
    "chat_langchain": Style(echo_langchain_v0, user=user_langchain),
}

TOOL_SCRIPT = ("Weather report for the trip, preamble: steps=2.", "Once more for tomorrow, preamble, steps=1.")
CHAT_SCRIPT = ("Hello there! reply_bytes=90", "Tell me more about it.", "Thanks, that is all.")


# -- the driver ------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One turn: what the sidecar did with it."""

    reply: Reply
    direct: Reply
    record: dict[str, JSON] | None
    body: dict[str, JSON]
    new_items: int
    pristine: list[Item] | None = None
    """The history as it would have been without the mutation (mutated turns only)."""


@dataclass
class Ctx:
    session: aiohttp.ClientSession
    emulator: Emulator
    sidecar: Sidecar


@pytest.fixture
async def ctx(emulator: Emulator, sidecar: Sidecar) -> AsyncIterator[Ctx]:
    async with aiohttp.ClientSession() as session:
        yield Ctx(session, emulator, sidecar)


Mutation = Callable[[int, list[Item], list[Item]], bool]
"""``(turn, history, last_echo) -> mutated?``: edits the app's history in place before a turn."""


def resolve(history: list[Item], seen: dict[str, Item]) -> list[Item]:
    """The input with ``item_reference`` items replaced by what they name."""
    return [seen[i["id"]] if i.get("type") == "item_reference" else i for i in history]


async def converse(
    ctx: Ctx,
    style: Style,
    script: tuple[str, ...],
    *,
    tools: bool = True,
    mutate: Mutation | None = None,
    sidecar: Sidecar | None = None,
    fidelity: bool = True,
    max_turns: int = 10,
) -> list[Step]:
    """Play ``script`` through the sidecar, sending each body to the emulator directly as well.

    Always checked: same answer (and same SSE event sequence) as the direct full-history request,
    and, with ``fidelity``, the sidecar's effective context digest = the app's input digest =
    the direct request's digest.
    """
    sc = sidecar or ctx.sidecar
    users = iter(script)
    user_turn = 0
    turn_id = "turn-0"
    history: list[Item] = [copy.deepcopy(i) for i in style.first]
    history.append(style.user(next(users), turn_id))
    new_items = len(history)
    seen: dict[str, Item] = {}
    steps: list[Step] = []
    last_echo: list[Item] = []
    for turn in range(max_turns):
        pristine = copy.deepcopy(history)
        mutated = mutate is not None and mutate(turn, history, last_echo)
        if mutated:
            new_items = -1  # unknown: not a plain extension
        body: dict[str, JSON] = {"model": MODEL, "input": history, **style.body}
        if tools:
            body["tools"] = [style.tool]
        body = copy.deepcopy(body)
        if style.per_request is not None:
            style.per_request(turn, body)
        reply = await post(ctx.session, sc.base_url, body)
        direct = await post(ctx.session, ctx.emulator.base_url, body)
        assert reply.status == direct.status, (reply.status, reply.body, direct.body)
        if reply.status != 200:
            assert reply.body == direct.body
            steps.append(Step(reply, direct, None, body, new_items, pristine if mutated else None))
            return steps
        assert reply.body["status"] == "completed"
        if fidelity:
            assert [summarize(o) for o in reply.output] == [summarize(o) for o in direct.output], f"turn {turn}"
        if reply.events:
            assert [e["type"] for e in reply.events] == [e["type"] for e in direct.events]
        rec = record(ctx.emulator, reply.body["id"])
        direct_rec = record(ctx.emulator, direct.body["id"])
        if fidelity:
            app_digest = context_digest(resolve(history, seen))
            assert rec["context_digest"] == app_digest, f"turn {turn}: the model saw another context"
            assert direct_rec["context_digest"] == app_digest
        steps.append(Step(reply, direct, rec, body, new_items, pristine if mutated else None))
        output = reply.output
        seen.update({o["id"]: o for o in output})
        last_echo = style.echo(output, turn_id) if style.turn_aware else style.echo(output)
        history += last_echo
        calls = [o for o in output if o["type"] == "function_call"]
        if calls:
            added = [style.fco(c, turn_id) for c in calls]
        else:
            text = next(users, None)
            if text is None:
                return steps
            user_turn += 1
            turn_id = f"turn-{user_turn}"
            added = [style.user(text, turn_id)]
        history += added
        new_items = len(added)
    raise AssertionError("the script did not finish")


def assert_continued(steps: list[Step], index: int) -> None:
    """Turn ``index`` went upstream as a cache-hitting continuation with only its new items."""
    step, prev = steps[index], steps[index - 1]
    rec = step.record
    assert rec is not None
    assert step.reply.mode == "continuation", f"turn {index}: {step.reply.mode}"
    assert rec["continuation"] is True and rec["cache_hit"] is True, f"turn {index}: {rec}"
    assert rec["previous_response_id"] == prev.reply.body["id"]
    assert rec["input_items"] == step.new_items, f"turn {index}: {rec['input_items']} != {step.new_items}"


def assert_full(steps: list[Step], index: int) -> None:
    """Turn ``index`` went upstream with the app's whole input and no anchor."""
    step = steps[index]
    rec = step.record
    assert rec is not None
    assert step.reply.mode == "full", f"turn {index}: {step.reply.mode}"
    assert rec["continuation"] is False and rec["previous_response_id"] is None, f"turn {index}: {rec}"
    assert rec["input_items"] == len(step.body["input"])
    assert rec["transport"] == "ws"


# -- equal context: continuations ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(STYLES))
async def test_tool_loop_echo_style_continues(ctx: Ctx, name: str) -> None:
    style = STYLES[name]
    steps = await converse(ctx, style, TOOL_SCRIPT)
    assert [s.reply.output[-1]["type"] for s in steps] == [
        "function_call",
        "function_call",
        "message",
        "function_call",
        "message",
    ]
    messages = [o for s in steps for o in s.reply.output if o["type"] == "message"]
    assert [m["phase"] for m in messages] == ["commentary", "commentary", "final_answer", "commentary", "final_answer"]
    # the style sends every message back with its phase (or as an item reference)
    sent = steps[-1].body["input"]
    assistant = [i for i in sent if i.get("role") == "assistant"]
    refs = [i for i in sent if i.get("type") == "item_reference" and i["id"].startswith("msg_")]
    assert len(assistant) + len(refs) == 4 and all("phase" in i for i in assistant)
    assert_full(steps, 0)
    for index in range(1, len(steps)):
        assert_continued(steps, index)
    wants_reasoning = "reasoning" in style.body
    assert all((s.reply.output[0]["type"] == "reasoning") == wants_reasoning for s in steps)
    last = steps[-1].reply.output[-1]["content"][0]["text"]
    assert "Last output: get_weather -> ok" in last or "Last output: read_file -> ok" in last


@pytest.mark.parametrize("name", list(CHAT_STYLES))
async def test_chat_echo_style_continues(ctx: Ctx, name: str) -> None:
    steps = await converse(ctx, CHAT_STYLES[name], CHAT_SCRIPT, tools=False)
    assert len(steps) == 3
    assert_full(steps, 0)
    assert_continued(steps, 1)
    assert_continued(steps, 2)
    assert "Echo: 'Thanks, that is all.'" in steps[2].reply.output[0]["content"][0]["text"]


async def test_reserialised_arguments_really_differ_in_bytes(ctx: Ctx) -> None:
    """The LangChain styles do change the argument bytes (else the tests above prove nothing)."""
    output = [{"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "call_1", "name": "get_weather",
               "arguments": '{"city":"São Paulo","unit":"celsius","day":1}'}]  # fmt: skip
    assert echo_langchain_v0(output)[0]["arguments"] == '{"city": "São Paulo", "unit": "celsius", "day": 1}'
    assert echo_langchain_v1(output)[0]["arguments"] == '{"city":"S\\u00e3o Paulo","unit":"celsius","day":1}'


async def test_codex_varying_client_metadata_still_continues(ctx: Ctx) -> None:
    """``client_metadata`` changes every request (key order, turn ids): not a settings change."""
    steps = await converse(ctx, STYLES["codex"], TOOL_SCRIPT)
    metadata = [s.body["client_metadata"] for s in steps]
    assert len({json.dumps(m) for m in metadata}) == len(steps) == 5
    assert all(s.reply.headers["content-type"].startswith("text/event-stream") for s in steps)
    for index in range(1, len(steps)):
        assert_continued(steps, index)


# -- changed context: full history -----------------------------------------------------------------------


def edit_first_user_message(turn: int, history: list[Item], last_echo: list[Item]) -> bool:
    if turn != 2:
        return False
    first = next(i for i in history if i.get("role") == "user")
    first["content"] += " (edited: also check the humidity)"
    return True


def change_argument_value(turn: int, history: list[Item], last_echo: list[Item]) -> bool:
    if turn != 1:
        return False
    call = next(i for i in last_echo if i.get("type") == "function_call")
    args = json.loads(call["arguments"])
    args["day"] = 7
    call["arguments"] = json.dumps(args, ensure_ascii=False)
    return True


def reorder_earlier_items(turn: int, history: list[Item], last_echo: list[Item]) -> bool:
    """Swap the two parallel calls of the first turn, already sent in turn 1, in turn 2."""
    if turn != 2:
        return False
    assert history[1]["type"] == history[2]["type"] == "function_call"
    history[1], history[2] = history[2], history[1]
    return True


def reverse_echoed_calls(turn: int, history: list[Item], last_echo: list[Item]) -> bool:
    if turn != 1:
        return False
    assert history[1]["type"] == history[2]["type"] == "function_call"
    history[1], history[2] = history[2], history[1]
    return True


def drop_new_tool_output(turn: int, history: list[Item], last_echo: list[Item]) -> bool:
    """The app never answers the call it just got (an interrupted tool call)."""
    if turn != 1:
        return False
    assert history[-1]["type"] == "function_call_output"
    history[-1] = {"role": "user", "content": "Never mind the tool, just answer."}
    return True


def drop_earlier_tool_output(turn: int, history: list[Item], last_echo: list[Item]) -> bool:
    """The app removes a tool output it had already sent."""
    if turn != 2:
        return False
    del history[next(i for i, item in enumerate(history) if item.get("type") == "function_call_output")]
    return True


def drop_assistant_message(turn: int, history: list[Item], last_echo: list[Item]) -> bool:
    if turn != 1:
        return False
    assert history[-2].get("type") == "message" and history[-2]["role"] == "assistant"
    del history[-2]
    return True


def truncate_history(turn: int, history: list[Item], last_echo: list[Item]) -> bool:
    if turn != 2:
        return False
    del history[:2]  # the app dropped its oldest exchange (a context-window trim)
    return True


PARALLEL_SCRIPT = ("Plan: steps=4 parallel=2.", "Again: steps=2 parallel=2.")

MUTATIONS: dict[str, tuple[Mutation, tuple[str, ...], bool, int]] = {
    # name: (mutation, script, tools, mutated turn)
    "edited_earlier_message": (edit_first_user_message, TOOL_SCRIPT, True, 2),
    "changed_argument_value": (change_argument_value, TOOL_SCRIPT, True, 1),
    "reordered_earlier_items": (reorder_earlier_items, PARALLEL_SCRIPT, True, 2),
    "reordered_echoed_calls": (reverse_echoed_calls, PARALLEL_SCRIPT, True, 1),
    "dropped_assistant_message": (drop_assistant_message, CHAT_SCRIPT, False, 1),
    "truncated_history": (truncate_history, CHAT_SCRIPT + ("One more thing.",), False, 2),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
async def test_meaning_changing_edit_goes_full(ctx: Ctx, name: str) -> None:
    mutate, script, tools, mutated = MUTATIONS[name]
    steps = await converse(ctx, Style(echo_model_dump, tool=READ_FILE), script, tools=tools, mutate=mutate)
    assert len(steps) > mutated + 1
    assert_full(steps, 0)
    for index in range(1, mutated):
        assert_continued(steps, index)
    assert_full(steps, mutated)
    # the mutated request starts a new chain, which the next turn continues
    assert_continued(steps, mutated + 1)
    # the edit changed the meaning: continuing the old chain would have shown the model another context
    step = steps[mutated]
    assert step.pristine is not None and step.record is not None
    assert context_digest(step.pristine) != step.record["context_digest"]
    assert context_digest(step.body["input"]) == step.record["context_digest"]


@pytest.mark.parametrize(
    ("mutate", "mutated", "mode"), [(drop_new_tool_output, 1, "continuation"), (drop_earlier_tool_output, 2, "full")]
)
async def test_dropped_tool_output_is_rejected_like_upstream(
    ctx: Ctx, mutate: Mutation, mutated: int, mode: str
) -> None:
    """A call without its output: the upstream's 400 reaches the app exactly as a direct request
    gets it (pitfall 19: never invent outputs). Leaving out the output of the call just made is
    still a prefix extension (the upstream sees the very same context, and refuses it); removing
    one sent before is a divergence, so the full history goes."""
    steps = await converse(ctx, Style(echo_verbatim, tool=READ_FILE), TOOL_SCRIPT, mutate=mutate)
    assert len(steps) == mutated + 1
    last = steps[-1]
    assert last.reply.status == 400
    assert last.reply.body["error"]["message"].startswith("No tool output found for function call call_")
    assert last.reply.body == last.direct.body
    assert last.reply.mode == mode
    for index in range(1, mutated):
        assert_continued(steps, index)


async def test_after_a_rejected_turn_the_fixed_request_gets_the_right_answer(ctx: Ctx) -> None:
    """The upstream evicts the anchor of a failed continuation; the sidecar must not build on it."""
    user = {"role": "user", "content": "Check it: steps=1."}
    base = {"model": MODEL, "tools": [READ_FILE]}
    first = await post(ctx.session, ctx.sidecar.base_url, {**base, "input": [user]})
    calls = first.output
    bad = {**base, "input": [user, *calls, {"role": "user", "content": "Never mind."}]}
    rejected = await post(ctx.session, ctx.sidecar.base_url, bad)
    assert rejected.status == 400
    good = {**base, "input": [user, *calls, *[fco_plain(c, "") for c in calls]]}
    reply = await post(ctx.session, ctx.sidecar.base_url, good)
    direct = await post(ctx.session, ctx.emulator.base_url, good)
    assert reply.status == 200, reply.body
    assert [summarize(o) for o in reply.output] == [summarize(o) for o in direct.output]
    assert reply.output[0]["content"][0]["text"].endswith("Last output: read_file -> ok: path=src/step_1.txt")
    assert record(ctx.emulator, reply.body["id"])["context_digest"] == context_digest(good["input"])


# -- dropped reasoning -------------------------------------------------------------------------------


DROPPED_REASONING = Style(echo_drop_reasoning, body=REASONING_STORE_FALSE)


async def test_dropped_reasoning_goes_full_by_default(ctx: Ctx) -> None:
    before = await metrics(ctx.sidecar.admin_url)
    steps = await converse(ctx, DROPPED_REASONING, TOOL_SCRIPT)
    after = await metrics(ctx.sidecar.admin_url)
    assert len(steps) == 5
    assert all(s.reply.output[0]["type"] == "reasoning" for s in steps)
    for index in range(len(steps)):
        assert_full(steps, index)
    assert delta(before, after, "upshift_dropped_reasoning_echoes_total", accepted="false") == 4
    assert delta(before, after, "upshift_continuation_misses_total", reason="dropped_reasoning") == 4


@pytest.mark.parametrize(
    "matching", [{"tolerate": ["reasoning"]}, {"allow_dropped_reasoning": True}], ids=["tolerate", "deprecated_alias"]
)
async def test_dropped_reasoning_continues_when_allowed(ctx: Ctx, make_sidecar: Any, matching: dict[str, Any]) -> None:
    """Accepted: the upstream chain keeps the reasoning the app left out (the documented,
    counted break of fidelity). The effective context is the app's input plus those items."""
    relaxed = await make_sidecar(matching=matching)
    before = await metrics(relaxed.admin_url)
    steps = await converse(ctx, DROPPED_REASONING, TOOL_SCRIPT, sidecar=relaxed, fidelity=False)
    after = await metrics(relaxed.admin_url)
    assert len(steps) == 5
    assert_full(steps, 0)
    full_context: list[Item] = list(steps[0].body["input"])
    for index in range(1, len(steps)):
        assert_continued(steps, index)
        prev = steps[index - 1]
        full_context += prev.reply.output + steps[index].body["input"][-steps[index].new_items :]
        rec = steps[index].record
        assert rec is not None
        assert rec["context_digest"] == context_digest(full_context)
        assert rec["context_digest"] != context_digest(steps[index].body["input"])
        # the answer is the one the effective context gives
        direct = await post(ctx.session, ctx.emulator.base_url, {**steps[index].body, "input": full_context})
        assert [summarize(o) for o in direct.output] == [summarize(o) for o in steps[index].reply.output]
    assert delta(before, after, "upshift_dropped_reasoning_echoes_total", accepted="true") == 4
    assert delta(before, after, "upshift_echo_tolerances_total", tolerance="reasoning", accepted="true") == 4


# -- dropped phase -----------------------------------------------------------------------------------

DROPPED_PHASE = Style(echo_drop_phase)


async def test_dropped_phase_goes_full_by_default(ctx: Ctx) -> None:
    """A ``phase``-less echo of a labelled message is another message for the model: full, with
    the app's exact context (checked by ``converse``), and the same answers as a direct request."""
    before = await metrics(ctx.sidecar.admin_url)
    steps = await converse(ctx, DROPPED_PHASE, TOOL_SCRIPT)
    after = await metrics(ctx.sidecar.admin_url)
    assert len(steps) == 5
    assert all(any("phase" in o for o in s.reply.output if o["type"] == "message") for s in steps)
    for index in range(len(steps)):
        assert_full(steps, index)
    assert delta(before, after, "upshift_continuation_misses_total", reason="dropped_phase") == 4
    assert delta(before, after, "upshift_echo_tolerances_total", tolerance="phase", accepted="false") == 4


async def test_dropped_phase_continues_when_tolerated(ctx: Ctx, make_sidecar: Any) -> None:
    """``matching.tolerate: [phase]``: continued and counted; the model then sees the phases the
    app left out (the documented difference), which the oracle shows."""
    relaxed = await make_sidecar(matching={"tolerate": ["phase"]})
    before = await metrics(relaxed.admin_url)
    steps = await converse(ctx, DROPPED_PHASE, TOOL_SCRIPT, sidecar=relaxed, fidelity=False)
    after = await metrics(relaxed.admin_url)
    assert len(steps) == 5
    assert_full(steps, 0)
    full_context: list[Item] = list(steps[0].body["input"])
    for index in range(1, len(steps)):
        assert_continued(steps, index)
        full_context += steps[index - 1].reply.output + steps[index].body["input"][-steps[index].new_items :]
        rec = steps[index].record
        assert rec is not None
        assert rec["context_digest"] == context_digest(full_context)
        assert rec["context_digest"] != context_digest(steps[index].body["input"])
    assert delta(before, after, "upshift_echo_tolerances_total", tolerance="phase", accepted="true") == 4
    assert delta(before, after, "upshift_continuation_misses_total", reason="dropped_phase") == 0
