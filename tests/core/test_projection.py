"""The audit of docs/fidelity.md, as a property: every row of its table is checked at random.

For every item type and every field of the table, an echo of a full upstream item has that
field changed to a random value or removed, and the matcher's verdict must be the table's:

* ``compared``: no match (neither a change nor a removal goes unnoticed);
* ``tolerance NAME``: a change is no match; a removal is no match by default, and a counted
  continuation only with ``matching.tolerate: [NAME]`` (checked through a real ``HeadTable``);
* ``handle``: a changed value names another item (no match), a removed one is fine;
* ``kind``: a changed type is no match; a removed one matches only for a message (rule 7);
* ``compared unless id``: a change is no match, a removal matches only while the echo has the id;
* ``ignored``: a change or removal still matches.

The emulator's oracle (its own canonical form) must agree: a compared field changed or removed
gives another canonical item, an ignored field or a handle the same one. Two rows are not
checked against it (``ORACLE_LENIENT``): it reads the text part kinds as one and a summary as its
texts. The table is read from the doc, so a row added there is tested at once, and a decision
this file does not know fails.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from proxy.core.conversation import HeadTable
from proxy.core.items import echo_matches, fingerprint, phase_dropped
from proxy.reasons import MissReason, Tolerance
from tests.sidecar import ROOT
from upshift_emulator.oracle import canonical_line

DOC = ROOT / "docs" / "fidelity.md"

SAMPLES: dict[str, dict[str, Any]] = {
    "message": {
        "id": "msg_1",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "phase": "commentary",
        "content": [
            {
                "type": "output_text",
                "text": "Checking São Paulo.",
                "annotations": [{"type": "url_citation", "url": "https://example.org/", "start_index": 0,
                                 "end_index": 8, "title": "Weather"}],
                "logprobs": [{"token": "Check", "logprob": -0.25, "bytes": [67], "top_logprobs": []}],
            },
            {"type": "refusal", "refusal": "Not the humidity."},
        ],
        "x_future": {"level": 1},
    },
    "function_call": {
        "id": "fc_1",
        "type": "function_call",
        "status": "completed",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city":"São Paulo","day":1}',
        "namespace": "crm",
        "caller": {"type": "program", "caller_id": "prog_1"},
        "async": False,
        "x_future": [1, 2],
    },
    "custom_tool_call": {
        "id": "ctc_1",
        "type": "custom_tool_call",
        "status": "completed",
        "call_id": "call_2",
        "name": "apply_patch",
        "input": "*** Begin Patch",
        "namespace": "dev",
        "x_future": "y",
    },
    "reasoning": {
        "id": "rs_1",
        "type": "reasoning",
        "status": "completed",
        "summary": [{"type": "summary_text", "text": "Thinking about São Paulo 🌧"}],
        "encrypted_content": "gAAAAB-opaque==",
        "content": [{"type": "reasoning_text", "text": "The user wants the weather."}],
        "x_future": 1,
    },
    "any other type": {
        "id": "ws_1",
        "type": "web_search_call",
        "status": "completed",
        "action": {"type": "search", "query": "weather"},
    },
}  # fmt: skip
"""One upstream output item per type, with every field of the table (non-empty where it matters)."""

FIELD_KEYS = {"(any other field)": "x_future", "(every field but `id`, `status`)": "action"}
DECISIONS = {"compared", "ignored", "handle", "kind", "compared unless id", "tolerance phase", "tolerance reasoning"}
ORACLE_LENIENT = {("message", "content[].type"), ("reasoning", "summary[].type")}
"""Fields the oracle reads more leniently than the matcher (one kind of text part; summary texts only)."""
TEXT_KINDS = ("input_text", "output_text", "text")


def audit_rows() -> list[tuple[str, str, str]]:
    """``(item, field, matcher decision)`` per row of the doc's audit table."""
    text = DOC.read_text()
    table = text[text.index("<!-- audit-table -->") : text.index("<!-- /audit-table -->")]
    rows = []
    for line in table.splitlines()[3:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4:
            continue
        rows.append((cells[0].strip("`"), cells[1].strip("`"), cells[2]))
    return rows


ROWS = audit_rows()


def test_the_table_covers_every_type_and_uses_known_decisions() -> None:
    assert {item for item, _, _ in ROWS} == set(SAMPLES)
    assert {decision for _, _, decision in ROWS} <= DECISIONS
    assert len(ROWS) >= 30


def _locate(item: dict[str, Any], field: str) -> tuple[Any, str]:
    """The container and key of ``field`` in ``item`` (``content[].text``: the first part with it)."""
    field = FIELD_KEYS.get(field, field.strip("`"))
    found = re.fullmatch(r"(\w+)\[\]\.(\w+)", field)
    if found is None:
        return item, field
    parts = item[found.group(1)]
    return next(p for p in parts if found.group(2) in p), found.group(2)


values = st.one_of(
    st.text(min_size=1, max_size=12),
    st.integers(-5, 5),
    st.booleans(),
    st.lists(st.integers(0, 3), min_size=1, max_size=2),
    st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 3), min_size=1, max_size=2),
)
"""Replacement values (never ``None``: that is a removal)."""


def _same_json(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        try:
            return bool(json.loads(a) == json.loads(b))
        except ValueError:
            return a == b
    return orjson.dumps(a, option=orjson.OPT_SORT_KEYS) == orjson.dumps(b, option=orjson.OPT_SORT_KEYS)


def _oracle_same(stored: dict[str, Any], echo: dict[str, Any]) -> bool:
    return canonical_line(stored) == canonical_line(echo)  # bytes: in Python, True == 1


def _table(tolerate: frozenset[Tolerance]) -> HeadTable:
    return HeadTable(max_heads=8, ttl_seconds=1e9, tolerate=tolerate)


def _through_table(output: list[dict[str, Any]], echo: list[dict[str, Any]], tolerate: frozenset[Tolerance]) -> Any:
    """A head whose output is ``output``; the next request echoes ``echo``: the lookup."""
    heads = _table(tolerate)
    first = [{"role": "user", "content": "go"}]
    req = heads.parse("me", orjson.dumps({"model": "m", "input": first}))
    heads.record("me", "s", req, {"id": "resp_1", "output": output}, 0.0)
    body = {"model": "m", "input": [*first, *echo, {"role": "user", "content": "next"}]}
    return heads.lookup("me", heads.parse("me", orjson.dumps(body)), 1.0)


@pytest.mark.parametrize(("item", "field", "decision"), ROWS, ids=[f"{i}:{f}" for i, f, _ in ROWS])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_changed_or_removed_field_gets_the_tables_verdict(
    item: str, field: str, decision: str, data: st.DataObject
) -> None:
    if field == "(the whole item)":
        return  # the whole item: test_a_left_out_reasoning_item_is_a_tolerance
    stored = SAMPLES[item]
    fp = fingerprint(stored)
    assert echo_matches(fp, copy.deepcopy(stored))  # the verbatim echo matches
    remove = data.draw(st.booleans(), label="remove")
    echo = copy.deepcopy(stored)
    holder, key = _locate(echo, field)
    if remove:
        del holder[key]
    else:
        value = data.draw(values, label="value")
        assume(not _same_json(value, holder[key]))
        if (item, field) == ("message", "content[].type"):
            assume(value not in TEXT_KINDS)
        holder[key] = value
    matched, tolerated = echo_matches(fp, echo), phase_dropped(fp, echo)
    oracle_same = _oracle_same(stored, echo)
    lenient = (item, field) in ORACLE_LENIENT
    if decision == "ignored":
        assert matched and oracle_same
    elif decision == "handle":
        assert matched == remove
        assert oracle_same  # the model does not see the handle
    elif decision == "kind":
        assert matched == (remove and item == "message")
        assert oracle_same == matched
    elif decision == "compared unless id":
        assert matched == remove  # the echo still names the item by its id
        if not remove:
            assert not oracle_same
    elif decision == "compared":
        assert not matched and not tolerated
        assert lenient or not oracle_same
    elif decision.startswith("tolerance "):
        assert not matched and not oracle_same
        assert tolerated == remove
        if remove:
            tolerance = Tolerance(decision.removeprefix("tolerance "))
            strict = _through_table([stored], [echo], frozenset())
            assert strict.match is None and strict.reason == MissReason.DROPPED_PHASE and strict.dropped_phase == 1
            relaxed = _through_table([stored], [echo], frozenset({tolerance}))
            assert relaxed.match is not None and relaxed.dropped_phase == 1  # continued, and counted
    else:
        raise AssertionError(f"unknown decision {decision!r}")


def test_a_reasoning_item_without_its_encrypted_content_or_id_is_no_match() -> None:
    stored = SAMPLES["reasoning"]
    echo = {k: v for k, v in stored.items() if k not in ("encrypted_content", "id")}
    assert not echo_matches(fingerprint(stored), echo)


def test_a_left_out_reasoning_item_is_a_tolerance() -> None:
    assert ("reasoning", "(the whole item)", "tolerance reasoning") in ROWS
    reasoning, message = SAMPLES["reasoning"], SAMPLES["message"]
    strict = _through_table([reasoning, message], [message], frozenset())
    assert strict.match is None and strict.reason == MissReason.DROPPED_REASONING and strict.dropped_reasoning == 1
    relaxed = _through_table([reasoning, message], [message], frozenset({Tolerance.REASONING}))
    assert relaxed.match is not None and relaxed.dropped_reasoning == 1
    phaseless = {k: v for k, v in message.items() if k != "phase"}
    both = _through_table([reasoning, message], [phaseless], frozenset(Tolerance))
    assert both.match is not None and (both.dropped_reasoning, both.dropped_phase) == (1, 1)


def test_string_content_is_one_text_part_only() -> None:
    """``{"role": "assistant", "content": text}`` equals one part with that text, not two."""
    one = {"role": "assistant", "content": [{"type": "output_text", "text": "ab", "annotations": []}]}
    two = {"role": "assistant", "content": [{"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]}
    echo = {"role": "assistant", "content": "ab"}
    assert echo_matches(fingerprint(one), echo) and _oracle_same(one, echo)
    assert not echo_matches(fingerprint(two), echo) and not _oracle_same(two, echo)
