"""End-to-end matcher fuzzing through the real sidecar and the emulator (docs/reliability.md §3).

The core-level half lives in tests/core/test_fuzz_matcher.py; this half runs whole conversations over
sockets: random histories (plain replies, tool calls, parallel calls, reasoning), every client echo
style of client-echo.md, and meaning-changing mutations (an edited earlier message, an edited item
in the echo of the last reply, a reordered item, a changed argument value, a dropped tool output).
For every turn:

1. the context the upstream generated from (the emulator's oracle record) equals the app's
   input, whether the sidecar sent a continuation or the full history;
2. the answer is identical to a direct full-history request to the upstream (same status and
   error for requests the upstream rejects);
3. an unmutated, faithful echo after a completed turn is sent as a continuation.

``UPSHIFT_FUZZ=deep`` runs many more examples.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.core.test_items import ECHO_STYLES
from tests.reliability.helpers import MODEL, Reply, post, project
from tests.sidecar import Sidecar
from upshift_emulator import Emulator
from upshift_emulator.oracle import context_digest

pytestmark = pytest.mark.timeout(120)

EXAMPLES = {"fast": 25, "deep": 400}[os.environ.get("UPSHIFT_FUZZ", "fast")]
FAITHFUL = [name for name in ECHO_STYLES if name != "agents_reasoning_id_omitted"]
MUTATIONS = ["edit_message", "edit_last_reply", "reorder", "change_argument", "drop_tool_output"]
TOOLS = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
]

words = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=16)


@st.composite
def prompts(draw: st.DrawFn) -> str:
    """A user message; sometimes asking the scripted model for (parallel) tool calls."""
    text = draw(words).replace("steps", "").replace("tool", "").replace("parallel", "").replace("reply", "")
    steps = draw(st.sampled_from([0, 0, 1, 2, 3]))
    if steps:
        text += f" steps={steps} parallel={draw(st.integers(1, 2))}"
    return text


def mutate(items: list[dict[str, Any]], kind: str, pick: int, echo: range) -> list[dict[str, Any]] | None:
    """``items`` with one meaning-changing edit, or None if the history has nothing to edit.

    ``echo`` is where the echo of the last response sits: the slice a continuation would skip,
    so edits there are the matcher's hardest cases.
    """
    out = copy.deepcopy(items)
    if kind == "edit_last_reply":
        if not echo:
            return None
        i = echo[pick % len(echo)]
        item = out[i]
        if item.get("type") == "function_call":
            item["arguments"] = json.dumps({"path": f"edited/{pick}.txt"})
        elif item.get("type") == "reasoning":
            item["summary"] = [{"type": "summary_text", "text": "an edited summary"}]
            item.pop("id", None)
        elif item.get("type") == "item_reference":
            out[i] = {"role": "assistant", "content": "an edited reply"}
        else:
            out[i] = {**item, "content": "an edited reply"}
    elif kind == "edit_message":
        where = [i for i, it in enumerate(out) if it.get("role") == "user"]
        if not where:
            return None
        out[where[pick % len(where)]] = {"role": "user", "content": "an edited earlier message"}
    elif kind == "reorder":
        where = [i for i in range(len(out) - 1) if out[i] != out[i + 1]]
        if not where:
            return None
        i = where[pick % len(where)]
        out[i], out[i + 1] = out[i + 1], out[i]
    elif kind == "change_argument":
        where = [i for i, it in enumerate(out) if it.get("type") == "function_call"]
        if not where:
            return None
        call = out[where[pick % len(where)]]
        args = json.loads(call.get("arguments") or "{}")
        call["arguments"] = json.dumps({**args, "path": f"changed/{pick}.txt"})
    elif kind == "drop_tool_output":
        where = [i for i, it in enumerate(out) if it.get("type") == "function_call_output"]
        if not where:
            return None
        del out[where[pick % len(where)]]
    return out


def resolve(items: list[dict[str, Any]], by_id: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """What the upstream resolves: item references, and reasoning items given by id alone."""
    out = []
    for item in items:
        by_ref = item.get("type") == "item_reference" or (
            item.get("type") == "reasoning" and item.get("encrypted_content") is None and "id" in item
        )
        out.append(by_id[item["id"]] if by_ref and item.get("id") in by_id else item)
    return out


def error_of(reply: Reply) -> tuple[int, Any]:
    error = reply.json.get("error", {})
    return reply.status, (error.get("code"), error.get("message"), error.get("param"))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
async def test_continuation_only_for_the_same_context_and_same_answer_as_direct(
    http: aiohttp.ClientSession, emulator: Emulator, sidecar: Sidecar, data: st.DataObject
) -> None:
    key = f"sk-fuzz-{uuid.uuid4().hex}"  # every example its own identity: its own sockets and heads
    store = data.draw(st.booleans(), label="store")
    fields: dict[str, Any] = {"model": MODEL, "store": store, "tools": TOOLS}
    if data.draw(st.booleans(), label="reasoning"):
        fields |= {"reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"]}
    styles = [s for s in ECHO_STYLES if store or s != "vercel_item_reference"]
    by_id: dict[str, dict[str, Any]] = {}
    app_items: list[dict[str, Any]] = [{"role": "user", "content": data.draw(prompts(), label="first")}]
    faithful_next = False
    echo_slice = range(0)
    for turn in range(data.draw(st.integers(1, 5), label="turns")):
        sent = app_items
        mutation = data.draw(st.sampled_from(["none"] * 3 + MUTATIONS), label="mutation") if turn else "none"
        if mutation != "none":
            pick = data.draw(st.integers(0, 99), label="where")
            sent = mutate(app_items, mutation, pick, echo_slice) or app_items
        mutated = sent != app_items
        stream = data.draw(st.booleans(), label="stream")
        reply = await post(http, sidecar.base_url, {**fields, "input": sent, "stream": stream}, key=key)
        direct = await post(http, emulator.base_url, {**fields, "input": sent}, key=key)
        if direct.status != 200 or reply.status != 200:
            # The upstream rejects this history (e.g. a dropped tool output): the app gets exactly
            # the upstream's answer, whichever way the sidecar sent it.
            assert error_of(reply) == error_of(direct), (mutation, reply.raw[:300], direct.raw[:300])
            event(f"rejected by the upstream after {mutation}")
            return
        response = reply.response
        record = emulator.record(response["id"])
        assert record is not None and record["status"] == "completed", record
        # (1) The context the upstream generated from is the app's input, continuation or not.
        assert record["context_digest"] == context_digest(resolve(sent, by_id)), (
            f"turn {turn}: the upstream saw another context (continuation={record['continuation']}, {mutation})"
        )
        # (2) The same answer as a direct full-history request.
        assert project(response["output"]) == project(direct.json["output"]), (turn, mutation)
        assert response.get("previous_response_id") is None
        event(f"{'continuation' if record['continuation'] else 'full'} after {mutation if mutated else 'none'}")
        # (3) A faithful, unmutated echo of a completed turn is continued.
        if faithful_next and not mutated:
            assert record["continuation"] is True, (turn, reply.mode)
        for item in response["output"]:
            by_id[item["id"]] = item
        style = data.draw(st.sampled_from(styles), label="echo style")
        echo = [ECHO_STYLES[style](item) for item in response["output"]]
        calls = [item for item in response["output"] if item["type"] == "function_call"]
        if calls:
            new = [{"type": "function_call_output", "call_id": c["call_id"], "output": data.draw(words)} for c in calls]
        else:
            new = [{"role": "user", "content": data.draw(prompts(), label="next")}]
        app_items = sent + echo + new
        echo_slice = range(len(sent), len(sent) + len(echo))
        faithful_next = style in FAITHFUL
