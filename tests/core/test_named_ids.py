"""Which object ids a body names (every kind, by key and prefix), and which an answer shows created."""

from __future__ import annotations

import orjson
import pytest

from proxy.core.named_ids import NamedIds, answer_ids, members, object_route, read_request
from proxy.errors import InvalidRequest
from proxy.reasons import ObjectKind


def test_every_id_below_the_top_level_is_read_with_its_kind_and_param() -> None:
    body = {
        "model": "m",
        "input": [
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "file-1"}]},
            {"type": "item_reference", "id": "msg_1"},
        ],
        "tools": [
            {"type": "code_interpreter", "container": {"type": "auto", "file_ids": ["file-2"]}},
            {"type": "code_interpreter", "container": "cntr_1"},
            {"type": "file_search", "vector_store_ids": ["vs_1"]},
        ],
        "metadata": {"file_id": "file-in-metadata"},
    }
    named = read_request(orjson.dumps(body))
    assert named.items == ("msg_1",)
    assert sorted(named.objects) == sorted(
        [
            ("files", "file-1", "input"),
            ("files", "file-2", "tools"),
            ("containers", "cntr_1", "tools"),
            ("vector_stores", "vs_1", "tools"),
        ]
    )


def test_the_prefix_decides_the_kind_and_other_routes_bodies_are_read_the_same_way() -> None:
    named = read_request(b'{"file_id": "vs_disguised", "file_ids": ["file-a", "resp_b"], "input_file_id": "x"}')
    assert named.objects == (
        ("vector_stores", "vs_disguised", "file_id"),
        ("files", "file-a", "file_ids"),
        ("responses", "resp_b", "file_ids"),
        ("files", "x", "input_file_id"),
    )
    assert read_request(b'{"training_file": "file-t"}').files == ("file-t",)


def test_words_in_text_name_nothing_and_a_top_level_id_alone_is_not_walked() -> None:
    text = "the container of the conversation holds a file_id and an item_reference"
    body = {"model": "m", "previous_response_id": "resp_1", "input": [{"role": "user", "content": text}]}
    assert read_request(orjson.dumps(body)) == NamedIds("resp_1")


def test_once_a_body_names_an_id_below_its_top_level_no_object_may_repeat_a_key() -> None:
    for repeated in (
        b'{"x": {"file_id": "file-a"}, "x": {}}',
        b'{"input": [{"type": "item_reference", "id": "msg_a"}], "input": []}',
        b'{"tools": [{"type": "code_interpreter", "container": "cntr_a"}], "tools": []}',
    ):
        with pytest.raises(InvalidRequest, match="repeats the key"):
            read_request(repeated)


def test_answers_under_an_owned_object_name_what_they_created() -> None:
    items = object_route("POST", "/v1/conversations/conv_1/items")
    assert items is not None and items.kind is ObjectKind.CONVERSATIONS and items.tail == ("items",)
    answer = {"object": "list", "data": [{"id": "msg_1"}, {"id": "msg_2"}]}
    assert list(members(answer, answer_ids(items, "POST"))) == ["msg_1", "msg_2"]
    complete = object_route("POST", "/v1/uploads/upload_1/complete")
    assert complete is not None
    assert list(members({"id": "upload_1", "file": {"id": "file-9"}}, answer_ids(complete, "POST"))) == ["file-9"]
    batch = object_route("GET", "/v1/batches/batch_1")
    assert batch is not None
    done = {"id": "batch_1", "output_file_id": "file-o", "error_file_id": None}
    assert list(members(done, answer_ids(batch, "GET"))) == ["file-o"]
    content = object_route("GET", "/v1/files/file-1/content")
    assert content is not None and answer_ids(content, "GET") == ()  # a file's content names nothing
