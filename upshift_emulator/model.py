"""The scripted, deterministic model: effective context + tools → output items (without ids).

Pure: no I/O, no clock, no randomness. The reply depends only on the canonical context (call ids
excluded, so replays match), the declared tools and the request's reasoning / token settings.

Prompt grammar, read from the **last user message** (case-insensitive, anywhere in the text):

==========================  ==========================================================
``steps=N``, ``N tool calls``, ``N tool steps``   run N function calls, then answer
``parallel=K`` / ``parallel K``                   emit up to K calls per turn (default 1)
``tool=NAME``                                     call the function tool NAME (default: first declared)
``reply_bytes=N``                                 size of a plain text reply
``preamble``                                      say what comes before each call, as newer
                                                  models do: a ``phase: "commentary"``
                                                  message before the calls, and the answer
                                                  labelled ``phase: "final_answer"``
``program``                                       programmatic tool calling (protocol.md §7): a
                                                  ``program`` item, then the calls it issues, each
                                                  with ``caller: {"type": "program", "caller_id"}``
                                                  (the tool must allow ``programmatic`` callers);
                                                  after their outputs a ``program_output`` item
                                                  before the answer
``safeguard``                                     a safeguard review pauses the output mid-stream
                                                  (the emulator's ``safeguard_pause_s``)
==========================  ==========================================================

Each ``function_call_output`` after that user message counts one step done; when all N are done
(or outputs arrive without a step request) the model answers quoting the last output. Without a
request for steps it answers ``[<context digest>] Echo: '<user text>' …`` padded to ``reply_bytes``,
so a different context gives a visibly different reply.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

import orjson

from .oracle import Segment

__all__ = ["ModelRequest", "Plan", "PlannedItem", "plan", "tokens"]

JSON = Any
_STEPS: Final = re.compile(r"steps?\s*[=:]\s*(\d+)|(\d+)\s+tool[\s_-]*(?:calls?|steps?)", re.I)
_PARALLEL: Final = re.compile(r"parallel\s*[=:]?\s*(\d+)", re.I)
_TOOL: Final = re.compile(r"tool\s*=\s*([A-Za-z0-9_.-]+)", re.I)
_REPLY_BYTES: Final = re.compile(r"reply_bytes\s*[=:]\s*(\d+)", re.I)
_PREAMBLE: Final = re.compile(r"\bpreamble\b", re.I)
_PROGRAM: Final = re.compile(r"\bprogram\b", re.I)
_SAFEGUARD: Final = re.compile(r"\bsafeguard\b", re.I)
_WORDS: Final = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
    "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
_QUOTE_CHARS: Final = 160


def tokens(text: str) -> int:
    """Token estimate used everywhere: UTF-8 bytes / 4, rounded up."""
    return math.ceil(len(text.encode()) / 4)


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """What the model sees."""

    context: Segment
    tools: tuple[JSON, ...] = ()
    tool_choice: JSON = None
    reasoning: bool = False
    reply_bytes: int = 120
    max_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class PlannedItem:
    """One output item before ids are assigned."""

    kind: Literal["reasoning", "message", "function_call", "program", "program_output"]
    text: str = ""
    """Message text, or the reasoning summary."""
    name: str = ""
    arguments: str = ""
    encrypted_content: str = ""
    status: Literal["completed", "incomplete"] = "completed"
    phase: Literal["commentary", "final_answer"] | None = None
    """A message's ``phase`` (only with the ``preamble`` directive)."""
    programmatic: bool = False
    """A function call issued by the ``program`` item before it (``caller``)."""
    call_id: str = ""
    """A ``program_output``'s program call id."""

    @property
    def tokens(self) -> int:
        """Output tokens this item costs."""
        return tokens(self.text) + tokens(self.name) + tokens(self.arguments)


@dataclass(frozen=True, slots=True)
class Plan:
    """The model's answer: items in output order, and whether ``max_output_tokens`` cut it short."""

    items: tuple[PlannedItem, ...]
    incomplete: bool = False
    safeguard: bool = False
    """A safeguard review pauses this answer mid-stream."""


def _message_text(item: JSON) -> str:
    return "".join(str(p.get("text", "")) for p in item.get("content", []) if isinstance(p, dict))


def _int(pattern: re.Pattern[str], text: str) -> int | None:
    match = pattern.search(text)
    if match is None:
        return None
    return int(next(group for group in match.groups() if group is not None))


def _seed(context: Segment) -> bytes:
    """A digest of the context that ignores call ids and ``caller`` links (random per run)."""
    hasher = hashlib.sha256()
    for item in context.to_list():
        if isinstance(item, dict) and ("call_id" in item or "caller" in item):
            item = {k: v for k, v in item.items() if k not in ("call_id", "caller")}
        hasher.update(orjson.dumps(item, option=orjson.OPT_SORT_KEYS))
    return hasher.digest()


def _value(name: str, schema: JSON, step: int, depth: int = 0) -> JSON:
    """A deterministic value for one JSON-schema property."""
    if not isinstance(schema, dict):
        return f"{name}-{step}"
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        options = [s for s in schema.get(key, []) if isinstance(s, dict) and s.get("type") != "null"]
        if options:
            return _value(name, options[0], step, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "integer":
        return step
    if kind == "number":
        return step + 0.5
    if kind == "boolean":
        return step % 2 == 1
    if kind == "array":
        return [_value(name, schema.get("items", {}), step, depth + 1)] if depth < 3 else []
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: _value(k, v, step, depth + 1) for k, v in props.items()} if depth < 3 else {}
    lowered = name.lower()
    if "path" in lowered or "file" in lowered:
        return f"src/step_{step}.txt"
    return f"{name}-{step}"


def _arguments(tool: JSON, step: int, total: int) -> str:
    params = tool.get("parameters") if isinstance(tool, dict) else None
    props = params.get("properties") if isinstance(params, dict) else None
    if not props:
        args: JSON = {"step": step, "of": total, "path": f"src/step_{step}.txt"}
    else:
        args = {key: _value(key, schema, step) for key, schema in props.items()}
    return orjson.dumps(args).decode()


def _pick_tool(request: ModelRequest, wanted: str | None) -> JSON:
    functions = [t for t in request.tools if isinstance(t, dict) and t.get("type") == "function"]
    choice = request.tool_choice
    if isinstance(choice, dict) and choice.get("name"):
        wanted = wanted or str(choice["name"])
    for tool in functions:
        if wanted is None or tool.get("name") == wanted:
            return tool
    return None


def _pad(head: str, size: int, seed: bytes) -> str:
    words = [head.rstrip()]
    length = len(head)
    index = 0
    while length < size:
        word = _WORDS[(seed[index % len(seed)] + index) % len(_WORDS)]
        words.append(word)
        length += len(word) + 1
        index += 1
    return " ".join(words) + "."


def _quote(text: str) -> str:
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "…"


def _programmatic(tool: JSON) -> bool:
    callers = tool.get("allowed_callers") if isinstance(tool, dict) else None
    return isinstance(callers, list) and "programmatic" in callers


def _decide(request: ModelRequest, seed: bytes) -> list[PlannedItem]:
    tail: list[JSON] = []
    user_text = ""
    for item in request.context.iter_reversed():
        if item.get("type") == "message" and item.get("role") == "user":
            user_text = _message_text(item)
            break
        tail.append(item)
    tail.reverse()
    calls_made = sum(1 for item in tail if item.get("type") == "function_call")
    outputs = [item for item in tail if item.get("type") == "function_call_output"]
    steps = _int(_STEPS, user_text) or 0
    forced = request.tool_choice == "required" or isinstance(request.tool_choice, dict)
    if steps == 0 and forced:
        steps = 1
    if request.tool_choice == "none":
        steps = 0
    tag = seed.hex()[:12]
    preamble = _PREAMBLE.search(user_text) is not None
    reply_bytes = _int(_REPLY_BYTES, user_text) or request.reply_bytes
    if steps > calls_made:
        tool = _pick_tool(request, (m.group(1) if (m := _TOOL.search(user_text)) else None))
        if tool is None:
            return [PlannedItem("message", f"[{tag}] No function tool declared: cannot run {steps} tool steps.")]
        parallel = max(1, _int(_PARALLEL, user_text) or 1)
        count = min(parallel, steps - calls_made)
        name = str(tool.get("name"))
        program = _PROGRAM.search(user_text) is not None and _programmatic(tool)
        calls = [
            PlannedItem(
                "function_call", name=name, arguments=_arguments(tool, calls_made + i + 1, steps), programmatic=program
            )
            for i in range(count)
        ]
        if program:
            code = f"for (const step of [{calls_made + 1}]) await tools.{name}({{step}});"
            calls.insert(0, PlannedItem("program", code, name=name))
        if preamble:
            note = f"[{tag}] Calling {name} for step {calls_made + 1} of {steps}."
            calls.insert(0, PlannedItem("message", note, phase="commentary"))
        return calls
    final: Literal["final_answer"] | None = "final_answer" if preamble else None
    if outputs:
        last = outputs[-1].get("output", "")
        last_text = last if isinstance(last, str) else orjson.dumps(last).decode()
        head = f"[{tag}] Done after {calls_made} tool call(s). Last output: {_quote(last_text)}"
        answer = [PlannedItem("message", head, phase=final)]
        issued = next((item for item in reversed(tail) if item.get("type") == "program"), None)
        if issued is not None:
            result = PlannedItem("program_output", _quote(last_text), call_id=str(issued.get("call_id", "")))
            answer.insert(0, result)
        return answer
    head = f"[{tag}] Echo: {_quote(user_text)!r}"
    return [PlannedItem("message", _pad(head, reply_bytes, seed), phase=final)]


def _reasoning(request: ModelRequest, seed: bytes, first: PlannedItem) -> PlannedItem:
    what = f"calling {first.name}" if first.kind == "function_call" else "answering directly"
    summary = f"**Planning**\n\nContext {seed.hex()[:12]} has {request.context.count} items; {what}."
    blob = b"".join(hashlib.sha256(seed + bytes([i])).digest() for i in range(4))
    encrypted = "gAAAAAB" + base64.urlsafe_b64encode(blob).decode()
    return PlannedItem("reasoning", summary, encrypted_content=encrypted)


def _budget(items: list[PlannedItem], limit: int | None) -> Plan:
    if limit is None:
        return Plan(tuple(items))
    remaining = limit
    out: list[PlannedItem] = []
    for item in items:
        cost = item.tokens
        if cost <= remaining:
            out.append(item)
            remaining -= cost
            continue
        if item.kind == "reasoning":
            out.append(item)
        elif item.kind == "message" and remaining > 0:
            out.append(
                replace(
                    item,
                    text=item.text.encode()[: remaining * 4].decode(errors="ignore"),
                    status="incomplete",
                )
            )
        return Plan(tuple(out), incomplete=True)
    return Plan(tuple(out))


def plan(request: ModelRequest) -> Plan:
    """Decide the output items for ``request`` (deterministic)."""
    seed = _seed(request.context)
    items = _decide(request, seed)
    if request.reasoning:
        first = next((i for i in items if i.kind == "function_call"), items[0])
        items.insert(0, _reasoning(request, seed, first))
    result = _budget(items, request.max_output_tokens)
    if _SAFEGUARD.search(_last_user_text(request.context)):
        result = replace(result, safeguard=True)
    return result


def _last_user_text(context: Segment) -> str:
    for item in context.iter_reversed():
        if item.get("type") == "message" and item.get("role") == "user":
            return _message_text(item)
    return ""
