"""Deterministic coding-agent rollouts: instructions, tools, a task, then T tool outputs.

Everything is derived from a seeded RNG, so every setup (A, B, C) of one run sends the same
content and sizes. The emulator's scripted model decides the calls: the task message asks for
``steps=T`` (docs/emulator.md prompt grammar), so the model answers with one ``function_call``
per turn (plus a reasoning item) until T outputs came back, then a final message.

Tool outputs are slices of a generated corpus of code, test logs, diffs and grep hits, sized
1–20 KB by default (skewed towards the top, as file reads and test runs dominate real rollouts),
so a 30-call rollout grows to about 0.5 MB of history, plus the initial repository context.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson

__all__ = [
    "MODEL",
    "TOOLS",
    "AgentHistory",
    "Rollout",
    "RolloutSpec",
    "body_fields",
    "corpus",
    "history_of_size",
    "make_rollout",
    "tool_output_bytes",
]

JSON = Any
MODEL = "gpt-6.1-sol"

TOOLS: list[JSON] = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a shell command in the repository and return its stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}, "description": "argv"},
                "workdir": {"type": "string", "description": "working directory"},
                "timeout_ms": {"type": "integer", "description": "kill after this many ms"},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
        "strict": False,
    },
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file of the repository, optionally a line range.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "offset": {"type": "integer"},
                "limit": {"type": "integer"},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
        "strict": False,
    },
    {
        "type": "function",
        "name": "apply_patch",
        "description": "Apply a unified diff to the working tree. Use the V4A patch format.",
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string", "description": "the patch"}},
            "required": ["input"],
            "additionalProperties": False,
        },
        "strict": False,
    },
    {
        "type": "function",
        "name": "search",
        "description": "Search the repository with ripgrep; returns matching lines with file and line number.",
        "parameters": {
            "type": "object",
            "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
            "required": ["pattern"],
            "additionalProperties": False,
        },
        "strict": False,
    },
    {
        "type": "function",
        "name": "update_plan",
        "description": "Record the current plan as a list of steps with a status each.",
        "parameters": {
            "type": "object",
            "properties": {
                "plan": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"step": {"type": "string"}, "status": {"type": "string"}},
                    },
                }
            },
            "required": ["plan"],
        },
        "strict": False,
    },
]

_IDENT = (
    "parse request config session buffer token stream item head anchor socket frame digest cache "
    "output input chain result value index offset length handler reader writer state event record"
).split()
_WORDS = (
    "the a when then if it is not be should must returns raises before after this that each every "
    "conversation request body input history upstream socket response item event module test fix"
).split()


def _code(rng: random.Random, lines: int) -> str:
    out: list[str] = []
    while len(out) < lines:
        name = f"{rng.choice(_IDENT)}_{rng.choice(_IDENT)}"
        args = ", ".join(rng.sample(_IDENT, rng.randint(1, 3)))
        out.append(f"def {name}({args}) -> dict[str, int] | None:")
        out.append(f'    """{" ".join(rng.choices(_WORDS, k=rng.randint(5, 12))).capitalize()}."""')
        for _ in range(rng.randint(2, 8)):
            a, b = rng.sample(_IDENT, 2)
            out.append(rng.choice([
                f"    {a} = {b}.get(\"{rng.choice(_IDENT)}\", {rng.randint(0, 4096)})",
                f"    if {a} is None or len({b}) > {rng.randint(1, 64)}:",
                f"        raise ValueError(f\"bad {a}: {{{b}!r}}\")",
                f"    for {a} in sorted({b}, key=lambda x: x[{rng.randint(0, 3)}]):",
                f"        yield {a}, {b}[{rng.randint(0, 9)}:]",
                f"    return {{\"{a}\": {b}, \"n\": {rng.randint(0, 99)}}}",
            ]))  # fmt: skip
        out.append("")
    return "\n".join(out)


def _log(rng: random.Random, lines: int) -> str:
    out = ["============================= test session starts ==============================",
           "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0"]  # fmt: skip
    while len(out) < lines:
        mod = f"tests/test_{rng.choice(_IDENT)}.py"
        verdict = rng.choice(["PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"])
        out.append(f"{mod}::test_{rng.choice(_IDENT)}_{rng.choice(_IDENT)} {verdict} [{rng.randint(0, 100):3d}%]")
        if verdict == "FAILED":
            out.append(f"E       AssertionError: assert {rng.randint(0, 999)} == {rng.randint(0, 999)}")
            out.append(f"E        +  where {rng.randint(0, 999)} = {rng.choice(_IDENT)}(b'\\x00\\x1f')")
    return "\n".join(out)


def _grep(rng: random.Random, lines: int) -> str:
    return "\n".join(
        f"proxy/{rng.choice(_IDENT)}.py:{rng.randint(1, 900)}:    {rng.choice(_IDENT)} = "
        f'{rng.choice(_IDENT)}({rng.choice(_IDENT)}, "{rng.choice(_WORDS)}")'
        for _ in range(lines)
    )


def _diff(rng: random.Random, lines: int) -> str:
    out = [f"diff --git a/proxy/{rng.choice(_IDENT)}.py b/proxy/{rng.choice(_IDENT)}.py", "@@ -10,7 +10,9 @@"]
    while len(out) < lines:
        sign = rng.choice(" +-")
        out.append(
            f"{sign}    {rng.choice(_IDENT)} = {rng.choice(_IDENT)}[{rng.randint(0, 9)}]  # {rng.choice(_WORDS)}"
        )
    return "\n".join(out)


@lru_cache(maxsize=4)
def corpus(seed: int, size: int = 1 << 20) -> str:
    """About ``size`` characters of code, logs, greps and diffs (cached per seed)."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < size:
        kind = rng.random()
        lines = rng.randint(40, 160)
        text = (
            _code(rng, lines)
            if kind < 0.5
            else _log(rng, lines)
            if kind < 0.7
            else (_grep(rng, lines) if kind < 0.85 else _diff(rng, lines))
        )
        parts.append(text)
        total += len(text) + 1
    return "\n".join(parts)


def _slice(rng: random.Random, text: str, size: int) -> str:
    start = rng.randrange(0, max(1, len(text) - size))
    start = text.find("\n", start) + 1
    return text[start : start + size]


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    """What a rollout looks like."""

    turns: int = 30
    """Tool calls (T); the rollout has T + 1 model responses."""
    tool_kb: tuple[float, float] = (1.0, 20.0)
    """Tool output size range in KB (1 KB = 1,000 characters)."""
    context_kb: float = 40.0
    """Initial repository context (AGENTS.md, file tree) sent as a developer message."""
    seed: int = 1


@dataclass(slots=True)
class Rollout:
    """One conversation's content: first input, and the output text of each tool call."""

    index: int
    first_input: list[JSON]
    tool_outputs: list[str] = field(default_factory=list)

    def output_for(self, step: int) -> str:
        """Tool output for call number ``step`` (0-based); the last one repeats if the model asks more."""
        return self.tool_outputs[min(step, len(self.tool_outputs) - 1)]


def make_rollout(spec: RolloutSpec, index: int) -> Rollout:
    """The deterministic rollout number ``index`` of ``spec``."""
    rng = random.Random(spec.seed * 1_000_003 + index)
    text = corpus(spec.seed)
    context = (
        "# AGENTS.md\n\nRun `pytest -q` before finishing. Keep functions small and typed.\n\n"
        f"<repository_map conversation={index}>\n{_slice(rng, text, int(spec.context_kb * 1000))}\n</repository_map>"
    )
    task = (
        f"Conversation {index}: tests/test_{rng.choice(_IDENT)}.py fails after the last refactor of the "
        f"{rng.choice(_IDENT)} module. Find the cause, fix it, and run the test suite. "
        f"(benchmark: steps={spec.turns})"
    )
    first = [{"role": "developer", "content": context}, {"role": "user", "content": task}]
    lo, hi = spec.tool_kb
    outputs = []
    for step in range(spec.turns):
        size = int((lo + (hi - lo) * rng.betavariate(3.0, 1.0)) * 1000)
        header = f"$ {rng.choice(['cat', 'pytest -q', 'rg', 'git diff', 'sed -n 1,400p'])} (step {step + 1})\n"
        outputs.append(header + _slice(rng, text, max(0, size - len(header))))
    return Rollout(index, first, outputs)


INSTRUCTIONS = (
    "You are a coding agent running in a terminal. You can run shell commands, read files, search "
    "the repository and apply patches. Work step by step: inspect, change, verify. Prefer small, "
    "reviewable patches. Never invent tool output. " * 12
)


def body_fields(stream: bool = True, light: bool = False) -> dict[str, JSON]:
    """The non-input request fields of every turn (as a coding agent sends them).

    ``light``: one tool and a one-line instruction, so that a "1 KB" request is about 1 KB.
    """
    fields: dict[str, JSON] = {
        "model": MODEL,
        "instructions": "You are a coding agent." if light else INSTRUCTIONS,
        "tools": TOOLS[:1] if light else TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    if stream:
        fields["stream"] = True
    return fields


def history_of_size(target_bytes: int, seed: int, tag: str, steps: int) -> list[JSON]:
    """An input list of about ``target_bytes`` of JSON, ending in a user message asking for ``steps`` calls.

    Earlier turns are client-built ``function_call``/``function_call_output`` pairs of up to 10 KB,
    as a resumed coding session replays them. ``tag`` makes the content unique per conversation.
    """
    rng = random.Random(f"{seed}:{tag}")
    text = corpus(seed)
    head: JSON = {"role": "user", "content": f"[{tag}] Resume the session."}
    tail: JSON = {"role": "user", "content": f"[{tag}] Continue. (benchmark: steps={steps})"}
    items: list[JSON] = [head]
    size = 2 + len(orjson.dumps(head)) + len(orjson.dumps(tail)) + 2
    pair = 0
    while target_bytes - size > 600:
        call_id = f"call_{tag}_{pair}"
        call = {"type": "function_call", "call_id": call_id, "name": "shell",
                "arguments": f'{{"command":["cat","src/{pair}.py"]}}'}  # fmt: skip
        room = target_bytes - size - len(orjson.dumps(call)) - 80
        out = {"type": "function_call_output", "call_id": call_id, "output": ""}
        out["output"] = _slice(rng, text, min(10_000, room))
        while len(orjson.dumps(out)) > room + 60 and len(out["output"]) > 50:
            out["output"] = out["output"][: int(len(out["output"]) * 0.95)]
        items += [call, out]
        size += len(orjson.dumps(call)) + len(orjson.dumps(out)) + 2
        pair += 1
    pad = max(0, target_bytes - size)
    if pad:
        head["content"] += " Context: " + _slice(rng, text, pad)
    items.append(tail)
    return items


TOOL_MIN, TOOL_MAX = 100, 16_000
"""Bounds of a reasoning agent's tool output, bytes."""


def tool_output_bytes(rng: random.Random) -> int:
    """A heavy-tailed tool output size: log-normal, median 1 KB, clipped to 0.1–16 KB.

    Most calls (``ls``, short greps, ``apply_patch`` confirmations) return a few hundred bytes; a
    file read or a failing test run returns several KB, a few hit the tool's 16 KB cap.
    """
    return int(min(TOOL_MAX, max(TOOL_MIN, rng.lognormvariate(6.9, 1.2))))


def _encrypted(rng: random.Random, size: int) -> str:
    """An opaque ``encrypted_content`` blob (URL-safe base64 text, as the API returns)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    return "gAAAAAB" + "".join(rng.choices(alphabet, k=size))


class AgentHistory:
    """A reasoning coding agent's history, as the app re-sends it every turn.

    Each earlier turn is what such an agent's model returned and the app echoed: a reasoning item
    with ``encrypted_content`` (and a one-line summary), now and then a commentary message
    (``phase: "commentary"``, the preamble a coding model says before a tool call), one
    ``function_call``, then the app's ``function_call_output`` of heavy-tailed size
    (:func:`tool_output_bytes`). The first item is the task; the last user message asks the
    emulator's scripted model for ``steps`` more calls, so every live turn streams a reasoning item
    and a function call.
    """

    def __init__(self, target_bytes: int, seed: int, tag: str, steps: int) -> None:
        self.rng = random.Random(f"agent:{seed}:{tag}")
        self.text = corpus(seed)
        self.tag = tag
        head: JSON = {"role": "user", "content": f"[{tag}] Fix the failing test in tests/test_core.py."}
        self.items: list[JSON] = [head]
        size = len(orjson.dumps(head)) + 200
        turn = 0
        while target_bytes - size > 2_500:
            for item in self._turn(turn, target_bytes - size):
                self.items.append(item)
                size += len(orjson.dumps(item)) + 1
            turn += 1
        pad = max(0, target_bytes - size)
        if pad:
            head["content"] += " Context: " + _slice(self.rng, self.text, pad)
        self.items.append({"role": "user", "content": f"[{tag}] Continue. (benchmark: steps={steps})"})

    def _turn(self, turn: int, room: int) -> list[JSON]:
        rng = self.rng
        call_id = f"call_{self.tag}_{turn}"
        out: list[JSON] = [
            {
                "type": "reasoning",
                "id": f"rs_{self.tag}_{turn}",
                "summary": [{"type": "summary_text", "text": f"**Inspecting** step {turn}: read, then patch."}],
                "encrypted_content": _encrypted(rng, rng.randint(600, 2_400)),
            }
        ]
        if rng.random() < 0.3:
            out.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "id": f"msg_{self.tag}_{turn}",
                    "status": "completed",
                    "phase": "commentary",
                    "content": [
                        {"type": "output_text", "text": "Reading the module before changing it.", "annotations": []}
                    ],
                }
            )
        out.append(
            {
                "type": "function_call",
                "id": f"fc_{self.tag}_{turn}",
                "call_id": call_id,
                "name": "shell",
                "arguments": f'{{"command":["sed","-n","1,200p","src/mod_{turn}.py"]}}',
                "status": "completed",
            }
        )
        size = min(tool_output_bytes(rng), max(50, room - 3_000))
        out.append({"type": "function_call_output", "call_id": call_id, "output": _slice(rng, self.text, size)})
        return out

    def tool_output(self, call_id: str) -> JSON:
        """The app's output for the live call ``call_id`` (heavy-tailed size)."""
        size = tool_output_bytes(self.rng)
        return {"type": "function_call_output", "call_id": call_id, "output": _slice(self.rng, self.text, size)}
