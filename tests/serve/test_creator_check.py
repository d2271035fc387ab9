"""What the owner book remembers of the ids it is told: behind an injected key every id; with the
app's own key every id but output items (a few a turn, checked only behind an injected key)."""

from __future__ import annotations

import pytest

from proxy.core.creators import OwnerRegistry
from proxy.core.named_ids import read_request
from proxy.errors import ProxyError
from proxy.reasons import OwnerVerdict
from proxy.serve.creator_check import OwnerBook

IDS = ("resp_1", "file-1", "conv_1", "chatcmpl-1", "msg_1", "rs_1", "fc_1")
ITEMS = {"msg_1", "rs_1", "fc_1"}


@pytest.mark.parametrize("strict", [True, False])
def test_what_is_remembered(strict: bool) -> None:
    book = OwnerBook(OwnerRegistry(4096), strict=strict)
    for object_id in IDS:
        book.note("tenant-a", object_id)
    remembered = {i for i in IDS if book.registry.verdict("tenant-a", i) is OwnerVerdict.OWN}
    assert remembered == (set(IDS) if strict else set(IDS) - ITEMS)
    # Another key's id is refused wherever it is remembered.
    assert book.registry.verdict("tenant-b", "file-1") is OwnerVerdict.FOREIGN


@pytest.mark.parametrize(
    "body",
    [
        b'{"previous_response_id": "resp_x"}',
        b'{"previous_response_id": ""}',
        b'{"conversation": {"id": "conv_x"}}',
        b'{"conversation": ""}',
        b'{"input": [{"type": "item_reference", "id": "msg_x"}]}',
        b'{"tools": [{"type": "file_search", "vector_store_ids": ["vs_x"]}]}',
    ],
)
async def test_a_request_naming_an_id_is_checked(body: bytes) -> None:
    """The handler checks owners only when :attr:`NamedIds.names_any`: each kind of id (an
    empty one too) makes it true, and then the check refuses an id nobody owns behind an
    injected key."""
    named = read_request(body)
    assert named.names_any
    with pytest.raises(ProxyError):
        await OwnerBook(OwnerRegistry(4096), strict=True).check("tenant-a", named)


async def test_a_request_naming_nothing_has_nothing_to_check() -> None:
    """What names no object (a relay frame's ``stream_id`` is none) passes the strictest check
    with an empty registry: skipping the check for it changes no outcome."""
    for body in (b'{"input": [{"role": "user", "content": "hi"}]}', b'{"stream_id": "s1", "input": []}'):
        named = read_request(body)
        assert not named.names_any
        await OwnerBook(OwnerRegistry(4096), strict=True).check("tenant-a", named)
