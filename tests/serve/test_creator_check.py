"""What the owner book remembers of the ids it is told: behind an injected key every id; with the
app's own key every id but output items (a few a turn, checked only behind an injected key)."""

from __future__ import annotations

import pytest

from proxy.core.creators import OwnerRegistry
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
