"""Each fidelity decision of today's protocol, proven against the emulator's oracle over random
histories (hypothesis): rolling cache breakpoints, reasoning left out under ``reasoning.context``
``current_turn`` / ``all_turns`` / absent (from the previous output or from earlier input), a
history pruned at a compaction item, ``caller`` dropped from a call.

The property (the invariant): whenever the matcher continues a head, what the upstream then holds
(the head's input and output plus the new items) reads, by the oracle's own rules
(``upshift_emulator.oracle.visible``: a compaction item stands for everything before it;
``current_turn`` reads no reasoning before the last user message), exactly as the app's request
does. And where the decision makes chaining safe, the matcher does continue.
"""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.conversation import HeadTable
from proxy.core.request import parse_request
from upshift_emulator.oracle import context_digest

JSON = Any
CONTEXTS = st.sampled_from(["current_turn", "all_turns", None])
MARK = {"mode": "explicit"}


def user(text: str, mark: bool = False) -> JSON:
    part: JSON = {"type": "input_text", "text": text}
    if mark:
        part["prompt_cache_breakpoint"] = MARK
    return {"role": "user", "content": [part]}


def reasoning(tag: str) -> JSON:
    return {"id": f"rs_{tag}", "type": "reasoning", "summary": [], "encrypted_content": f"enc-{tag}"}


def call(tag: str, program: bool) -> JSON:
    item: JSON = {"id": f"fc_{tag}", "type": "function_call", "call_id": f"call_{tag}", "name": "f", "arguments": "{}"}
    if program:
        item["caller"] = {"type": "program", "caller_id": f"prog_{tag}"}
    return item


def answer(tag: str) -> JSON:
    return {
        "id": f"msg_{tag}",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": tag}],
    }


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[JSON], list[JSON], str | None]:
    """A head's input and output: user turns of tool loops, with reasoning, calls (some issued by a
    program), answers and maybe a compaction item."""
    history: list[JSON] = []
    for turn in range(draw(st.integers(1, 3))):
        history.append(user(f"u{turn}"))
        for step in range(draw(st.integers(0, 2))):
            tag = f"{turn}{step}"
            if draw(st.booleans()):
                history.append(reasoning(tag))
            history.append(call(tag, draw(st.booleans())))
            history.append({"type": "function_call_output", "call_id": f"call_{tag}", "output": "ok"})
        if draw(st.booleans()):
            history.append(reasoning(f"{turn}a"))
        history.append(answer(f"{turn}"))
    history.append(user("last"))
    output: list[JSON] = []
    if draw(st.booleans()):
        output.append({"id": "cmp_1", "type": "compaction", "encrypted_content": "cmp-blob"})
    if draw(st.booleans()):
        output.append(reasoning("out"))
    ends_in_call = draw(st.booleans())
    output.append(call("out", draw(st.booleans())) if ends_in_call else answer("out"))
    return history, output, draw(CONTEXTS)


def body(items: list[JSON], context: str | None) -> bytes:
    fields: JSON = {"model": "gpt-6.1-sol", "input": items, "store": False}
    fields["reasoning"] = {"effort": "low", **({"context": context} if context else {})}
    return orjson.dumps(fields)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.data())
def test_every_continuation_reads_as_the_app_sent(case: tuple[list[JSON], list[JSON], str | None], data: Any) -> None:
    history, output, context = case
    rule = context or "all_turns"
    table = HeadTable(max_heads=16, ttl_seconds=3600.0)
    table.record("id", "lane", parse_request(body(history, context)), {"id": "resp_1", "output": output}, 0.0)
    # The app's next request: its history echoed, then new items, with edits of its own.
    echo = list(history) + list(output)
    if output[-1]["type"] == "function_call":
        echo.append({"type": "function_call_output", "call_id": output[-1]["call_id"], "output": "done"})
    if output[-1]["type"] != "function_call" or data.draw(st.booleans()):
        echo.append(user("next"))
    edits = data.draw(st.lists(st.sampled_from(["drop_reasoning", "roll_mark", "prune", "drop_caller"]), max_size=3))
    if "drop_reasoning" in edits:
        echo = [i for i in echo if i.get("type") != "reasoning"]
    if "roll_mark" in edits:
        echo = [user(i["content"][0]["text"], mark=False) if i.get("role") == "user" else i for i in echo]
        last_user = max(k for k, i in enumerate(echo) if i.get("role") == "user")
        echo[last_user] = user(echo[last_user]["content"][0]["text"], mark=True)
    if "prune" in edits:
        cut = [k for k, i in enumerate(echo) if i.get("type") == "compaction"]
        echo = echo[cut[-1] :] if cut else echo
    if "drop_caller" in edits:
        echo = [{k: v for k, v in i.items() if k != "caller"} for i in echo]
    found = table.lookup("id", parse_request(body(echo, context)), 1.0)
    app_reads = context_digest(echo, rule)
    if found.match is not None:
        upstream = history + output + found.match.new_items
        assert context_digest(upstream, rule) == app_reads, (edits, context, found.match.new_items)
        return
    # Where the decision makes chaining safe, the matcher continues.
    dropped = {"drop_reasoning", "drop_caller"} & set(edits)
    if not dropped and "prune" not in edits:
        raise AssertionError(f"an exact echo (breakpoints moved: {'roll_mark' in edits}) missed: {found.reason}")
    if edits == ["drop_reasoning"] and rule == "current_turn" and echo[-1].get("role") == "user":
        raise AssertionError(f"reasoning of earlier user turns only, under current_turn: {found.reason}")
