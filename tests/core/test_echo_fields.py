"""echo_fields: the paths and digests of field_paths, in its order (the one-pass build)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.headnotes import echo_fields, field_paths, value_digest
from proxy.core.items import projection

ITEMS: list[dict[str, Any]] = [
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "t"}], "encrypted_content": "gA"},
    {"type": "reasoning", "id": "rs_2", "summary": [], "content": []},
    {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": '{"a": [1, 2.0]}'},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x", "annotations": []}]},
    {"type": "message", "role": "assistant", "content": "plain", "phase": "final"},
    {"type": "message", "role": "assistant", "content": ["bare", {}], "weird key!": {"b": 1, "a": None}},
    {"type": "custom", "data\n": 1, "x" * 80: [1, {"y": 2}], "summary": [{"9bad": 1, "ok_key": "v"}]},
]


def _expected(item: dict[str, Any]) -> tuple[tuple[str, ...], bytes]:
    out = [(path, value_digest(value)) for path, value in field_paths(item)]
    if item.get("type") == "reasoning" and item.get("encrypted_content") is not None:
        out.append(("encrypted_content", value_digest(item["encrypted_content"])))
    return tuple(p for p, _ in out), b"".join(d for _, d in out)


@pytest.mark.parametrize("item", ITEMS)
def test_echo_fields_are_field_paths_digested(item: dict[str, Any]) -> None:
    for _ in range(2):  # the second time with its names cached
        assert echo_fields(item) == _expected(item)
        assert echo_fields(item, projection(item)) == _expected(item)


def test_unsafe_names_are_hidden() -> None:
    paths, _ = echo_fields({"type": "custom", "bad key": 1, "x" * 80: 2})
    assert "bad key" not in paths and "x" * 80 not in paths
    assert paths.count("?") == 2
