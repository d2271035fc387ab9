"""The owner registry (bounded, evicting from the heaviest identity) and the id sniffers."""

from __future__ import annotations

import orjson
import pytest

from proxy.core.creators import OwnerRegistry, created_id, member_string
from proxy.core.named_ids import NamedIds, read_request, request_ids
from proxy.errors import InvalidRequest
from proxy.reasons import OwnerVerdict
from proxy.upstream.sniff import IdSniffer


def test_verdicts() -> None:
    owners = OwnerRegistry(10)
    owners.note("alice", "resp_a")
    assert owners.verdict("alice", "resp_a") is OwnerVerdict.OWN
    assert owners.verdict("bob", "resp_a") is OwnerVerdict.FOREIGN
    assert owners.verdict("bob", "resp_x") is OwnerVerdict.UNKNOWN


def test_the_owner_is_the_tenant_and_an_answer_never_takes_an_id_from_its_creator() -> None:
    owners = OwnerRegistry(10)
    alice_one, alice_two, bob = "a" * 16 + "1" * 48, "a" * 16 + "2" * 48, "b" * 16 + "1" * 48
    owners.note(alice_one, "resp_a")  # two identities of one tenant (another query string or project)
    assert owners.verdict(alice_two, "resp_a") is OwnerVerdict.OWN
    assert owners.verdict(bob, "resp_a") is OwnerVerdict.FOREIGN
    owners.adopt(bob, "resp_a")  # seen in an answer of Bob's: the creator keeps it
    assert owners.verdict(alice_one, "resp_a") is OwnerVerdict.OWN
    owners.adopt(bob, "msg_b")
    assert owners.verdict(bob, "msg_b") is OwnerVerdict.OWN and owners.held(bob) == 1


def test_a_flood_of_one_identity_evicts_only_its_own_ids() -> None:
    owners = OwnerRegistry(100)
    for n in range(10):
        owners.note("alice", f"a{n}")
    for n in range(10_000):
        owners.note("mallory", f"m{n}")
    assert len(owners) == 100
    assert all(owners.owner_of(f"a{n}") == "alice" for n in range(10))
    assert owners.held("mallory") == 90 and owners.owner_of("m9999") == "mallory"
    assert owners.owner_of("m0") is None  # the heaviest identity's oldest went first


def test_eviction_evens_out_identities_at_the_bound() -> None:
    owners = OwnerRegistry(30)
    for n in range(100):
        for who in ("a", "b", "c"):
            owners.note(who, f"{who}{n}")
    assert [owners.held(w) for w in "abc"] == [10, 10, 10]
    assert owners.owner_of("a99") == "a" and owners.owner_of("a0") is None


RESPONSE = {"id": "resp_1", "object": "response", "output": [{"id": "msg_1", "type": "message"}]}


@pytest.mark.parametrize("cut", [1, 5, 9, 14, 20, 60, None])
def test_json_sniffer_finds_the_top_level_id_in_any_chunking(cut: int | None) -> None:
    body = orjson.dumps({"object": "response", "metadata": {"id": "nested"}, **RESPONSE})
    sniffer = IdSniffer(sse=False)
    chunks = [body] if cut is None else [body[i : i + cut] for i in range(0, len(body), cut)]
    found = [rid for chunk in chunks if (rid := sniffer.feed(chunk)) is not None]
    assert found == ["resp_1"]


def test_json_sniffer_ignores_an_error_body_and_non_objects() -> None:
    assert IdSniffer(sse=False).feed(b'{"error": {"message": "x", "code": null}}') is None
    sniffer = IdSniffer(sse=False)
    assert sniffer.feed(b"[1, 2]") is None and sniffer.done


def test_sse_sniffer_reads_the_first_event_only() -> None:
    created = orjson.dumps({"type": "response.created", "sequence_number": 0, "response": RESPONSE})
    stream = b"event: response.created\ndata: " + created + b"\n\nevent: x\ndata: {}\n\n"
    sniffer = IdSniffer(sse=True)
    assert [r for i in range(0, len(stream), 7) if (r := sniffer.feed(stream[i : i + 7]))] == ["resp_1"]
    error = IdSniffer(sse=True)
    assert error.feed(b'event: error\ndata: {"type":"error","error":{"id":"no"}}\n\n') is None and error.done


def test_sniffer_gives_up_at_its_limit() -> None:
    sniffer = IdSniffer(sse=False, limit=64)
    assert sniffer.feed(b'{"output": "' + b"x" * 100 + b'", "id": "resp_late"}') is None and sniffer.done


def test_member_string_never_takes_a_nested_or_escaped_key() -> None:
    assert member_string(b'{"a": {"id": "no"}, "b": ["id", {"id": "no"}], "id": "yes"}', ("id",)) == "yes"
    assert member_string(b'{"a": "\\"id\\": \\"no\\"", "x": 1}', ("id",)) is None
    assert member_string(b'{"response": {"output": [{"id": "no"}], "id": "yes"}}', ("response", "id")) == "yes"


def test_relay_frames() -> None:
    created = orjson.dumps({"type": "response.created", "response": RESPONSE}).decode()
    assert created_id(created) == "resp_1"
    assert created_id(orjson.dumps({"type": "response.output_text.delta", "delta": "id"}).decode()) is None
    frame = orjson.dumps({"type": "response.create", "previous_response_id": "resp_9", "stream_id": "s"})
    assert read_request(frame) == NamedIds(previous_response_id="resp_9", stream_id="s")
    assert read_request(b'{"type": "response.create", "input": []}') == NamedIds()
    assert read_request(b'{"type": "response.create", "previous_response_id": null}') == NamedIds()
    with pytest.raises(ValueError):
        read_request(b'"previous_response_id"')


def test_ids_are_read_as_any_parser_reads_them() -> None:
    escaped = b'{"previous\\u005fresponse_id": "resp_A", "conversation": {"id": "conv_1"},'
    escaped += b' "input": [{"type": "item\\u005freference", "id": "msg_1"}, {"type": "message", "id": "msg_2"}]}'
    assert read_request(escaped) == NamedIds("resp_A", "conv_1", ("msg_1",))
    for repeated in (
        b'{"previous_response_id": "resp_A", "previous\\u005fresponse_id": "resp_B"}',
        b'{"conversation": {"id": "conv_1", "\\u0069d": "conv_2"}}',
        b'{"input": [{"type": "message", "content": "x", "type": "item_reference", "id": "msg_1"}]}',
    ):
        with pytest.raises(InvalidRequest, match="repeats the key"):
            read_request(repeated)
    # A repeated key no id is read from is the upstream's to judge.
    assert read_request(b'{"metadata": {"a": "1", "a": "2"}, "store": true, "store": false}') == NamedIds()


def test_after_a_fast_parse_only_the_new_bytes_are_searched_and_a_repeat_across_them_is_found() -> None:
    prefix = b'{"previous_response_id": "resp_A", "input": [{"role": "user", "content": "hi"}'
    fields = {"previous_response_id": "resp_A", "input": [], "store": False}
    assert request_ids(fields, [], prefix + b'], "store": false}', len(prefix)).previous_response_id == "resp_A"
    again = prefix + b'], "previous_response_id": "resp_B"}'
    with pytest.raises(InvalidRequest, match="previous_response_id"):
        request_ids({"previous_response_id": "resp_B", "input": []}, [], again, len(prefix))
    new = b', {"type": "item_reference", "id": "msg_1", "id": "msg_2"}]}'
    with pytest.raises(InvalidRequest, match="'id'"):
        request_ids(fields, [{"type": "item_reference", "id": "msg_2"}], prefix + new, len(prefix))


def test_files_and_vector_stores_named_in_a_body_are_read_and_their_keys_not_repeated() -> None:
    body = {
        "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}],
        "tools": [{"type": "file_search", "vector_store_ids": ["vs_1", "vs_2"]}],
    }
    named = read_request(orjson.dumps(body))
    assert (named.files, named.vector_stores) == (("file-1",), ("vs_1", "vs_2"))
    escaped = b'{"input": [{"role": "user", "content": [{"type": "input_file", "file\\u005fid": "file-2"}]}]}'
    assert read_request(escaped).files == ("file-2",)
    for repeated in (
        b'{"input": [{"role": "user", "content": [{"file_id": "file-1", "file_id": "file-2"}]}]}',
        b'{"input": [{"role": "user", "content": [{"file_id": "file-1"}], "content": "hi"}]}',
        b'{"tools": [{"vector_store_ids": ["vs_1"]}], "tools": []}',
    ):
        with pytest.raises(InvalidRequest, match="repeats the key"):
            read_request(repeated)
