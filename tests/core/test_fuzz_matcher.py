"""Matcher fuzzing: random histories, random client echo styles, random meaning-changing edits.

The property is checked with the emulator's fidelity oracle (``upshift_emulator.oracle``), an
implementation of client-echo.md written separately from the sidecar's matcher:

* whenever the sidecar would continue a chain, the context the upstream then holds (its
  chain plus the new items) has the same oracle digest as the app's full input;
* an unmutated echo in any faithful client style is always continued.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.conversation import HeadTable
from tests.core.test_items import ECHO_STYLES, PHASE_DROPPING
from upshift_emulator.oracle import context_digest

PROFILE = os.environ.get("UPSHIFT_FUZZ", "fast")
EXAMPLES = {"fast": 150, "deep": 3000}[PROFILE]

# Styles that drop nothing the oracle counts; those that drop ``phase`` only for unlabelled messages.
FAITHFUL = [name for name in ECHO_STYLES if name != "agents_reasoning_id_omitted"]
KEEPS_PHASE = [name for name in FAITHFUL if name not in PHASE_DROPPING]
PHASES = st.sampled_from([None, None, "commentary", "final_answer"])


def styles_for(output: list[dict[str, Any]]) -> list[str]:
    """The faithful styles for ``output``: a labelled message rules out the phase-dropping ones."""
    return KEEPS_PHASE if any("phase" in item for item in output) else FAITHFUL


texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(-1e3, 1e3, allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)


@st.composite
def output_items(draw: st.DrawFn, turn: int) -> list[dict[str, Any]]:
    """One response's output: optional reasoning, optional message, 0-2 function calls."""
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append(
            {
                "id": f"rs_{turn}",
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": draw(texts)}],
                "encrypted_content": f"enc-{turn}-{draw(texts)}",
            }
        )
    if draw(st.booleans()):
        message = {
            "id": f"msg_{turn}",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": draw(texts), "annotations": [], "logprobs": []}],
        }
        phase = draw(PHASES)
        if phase is not None:
            message["phase"] = phase
        out.append(message)
    for k in range(draw(st.integers(0, 2))):
        args = draw(st.dictionaries(texts, json_values, max_size=3))
        out.append(
            {
                "id": f"fc_{turn}_{k}",
                "type": "function_call",
                "status": "completed",
                "call_id": f"call_{turn}_{k}",
                "name": "tool",
                "arguments": json.dumps(args),
            }
        )
    if not out:
        out.append(
            {
                "id": f"msg_{turn}",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "done", "annotations": []}],
            }
        )
    return out


def new_items_for(output: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    calls = [i for i in output if i["type"] == "function_call"]
    if calls:
        return [{"type": "function_call_output", "call_id": c["call_id"], "output": text} for c in calls]
    return [{"role": "user", "content": text}]


def mutate(items: list[dict[str, Any]], kind: str, where: int) -> list[dict[str, Any]]:
    items = copy.deepcopy(items)
    i = where % len(items)
    if kind == "edit":
        item = items[i]
        if "content" in item:
            item["content"] = "edited"
        elif "arguments" in item:
            item["arguments"] = json.dumps({"changed": where})
        elif "output" in item:
            item["output"] = str(item["output"]) + "!"
        elif "summary" in item:
            item["summary"] = [{"type": "summary_text", "text": "edited"}]
        else:
            item["x"] = 1
    elif kind == "drop" and len(items) > 1:
        del items[i]
    elif kind == "swap" and len(items) > 1:
        j = (i + 1) % len(items)
        if items[i] != items[j]:
            items[i], items[j] = items[j], items[i]
    return items


def resolve(items: list[dict[str, Any]], by_id: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace item references by the stored items (the upstream does the same)."""
    return [by_id.get(i.get("id", ""), i) if i.get("type") == "item_reference" else i for i in items]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_continuation_only_when_the_context_is_identical(data: st.DataObject) -> None:
    heads = HeadTable(max_heads=64, ttl_seconds=1e9, allow_dropped_reasoning=False)
    upstream: dict[str, list[dict[str, Any]]] = {}  # anchor -> context the upstream holds
    by_id: dict[str, dict[str, Any]] = {}
    app_items: list[dict[str, Any]] = [{"role": "user", "content": data.draw(texts)}]
    fields = {"model": "m", "store": False, "tools": [{"type": "function", "name": "tool"}]}
    mutated_ever = False
    for turn in range(data.draw(st.integers(1, 5))):
        sent = app_items
        mutation = data.draw(st.sampled_from(["none", "none", "none", "edit", "drop", "swap"]))
        if mutation != "none" and turn:
            sent = mutate(app_items, mutation, data.draw(st.integers(0, 99)))
            mutated_ever = mutated_ever or sent != app_items
        body = orjson.dumps({**fields, "input": sent})
        req = heads.parse("me", body)
        found = heads.lookup("me", req, turn)
        anchor = f"s{turn % 3}"
        if found.match is not None:
            anchor = str(found.match.anchor)
            seen = upstream[anchor] + found.match.new_items
            assert context_digest(resolve(seen, by_id)) == context_digest(resolve(sent, by_id)), (
                f"turn {turn}: continuation with a different context ({mutation})"
            )
        else:
            seen = sent
            assert mutated_ever or turn == 0 or found.reason != "diverged", found
        output = output_items(turn).example() if False else data.draw(output_items(turn))
        for item in output:
            by_id[item["id"]] = item
        heads.record("me", anchor, req, {"id": f"resp_{turn}", "output": output}, turn)
        for other in list(upstream):
            if other == anchor:
                continue
        upstream[anchor] = resolve(seen, by_id) + output
        # any style, the phase-dropping ones included: a wrong continuation is what fails here
        style = data.draw(st.sampled_from(FAITHFUL))
        echo = [ECHO_STYLES[style](item) for item in output]
        app_items = sent + echo + new_items_for(output, data.draw(texts))


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_faithful_echo_is_always_continued(data: st.DataObject) -> None:
    heads = HeadTable(max_heads=8, ttl_seconds=1e9)
    items: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for turn in range(4):
        req = heads.parse("me", orjson.dumps({"model": "m", "input": items}))
        found = heads.lookup("me", req, turn)
        assert (found.match is not None) == (turn > 0), (turn, found.reason)
        output = data.draw(output_items(turn))
        heads.record("me", "s", req, {"id": f"resp_{turn}", "output": output}, turn)
        style = data.draw(st.sampled_from(styles_for(output)))
        items = items + [ECHO_STYLES[style](i) for i in output] + new_items_for(output, "r")
