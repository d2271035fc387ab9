"""Fair shares: a noisy tenant evicts its own heads, sockets and kept bodies first.

Small limits on a real sidecar process (the emulator upstream): 8 heads, 4 upstream sockets in
all, one lane a socket, ``store: false`` (a head is continuable only where it lives). Alice keeps
two conversations going; Bob opens 40 (ten times his fair share of 4 heads) between her turns.
With one global LRU, Bob's flood would take Alice's heads and sockets and her later turns would
go out in full; the heaviest identity gives up its own first, so hers stay continued.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import pytest

from tests.reliability.helpers import Conversation
from tests.security.support import ALICE, BOB, start_process
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

pytestmark = pytest.mark.timeout(120)

LIMITS = {
    "UPSHIFT_MATCHING_MAX_HEADS": "8",
    "UPSHIFT_POOL_MAX_SOCKETS_TOTAL": "4",
    "UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY": "4",
    "UPSHIFT_POOL_LANES_PER_SOCKET": "1",
}


async def test_a_tenant_opening_ten_times_its_share_leaves_anothers_heads_hot(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    proc = await start_process(spawn, emulator.base_url, env=LIMITS)
    async with aiohttp.ClientSession() as http:
        alice = [Conversation(http, proc.base_url, emulator, key=ALICE, name=f"alice-{i}") for i in range(2)]
        for conv in alice:
            assert (await conv.turn())["continuation"] is False
        for round_ in range(3):
            # Bob: 40 new conversations over the three rounds' gaps (10× a share of 4 heads).
            for i in range(14 if round_ < 2 else 12):
                bob = Conversation(http, proc.base_url, emulator, key=BOB, name=f"bob-{round_}-{i}")
                assert (await bob.turn())["continuation"] is False
            # Alice's later turns are still continued: her heads and sockets were kept.
            for conv in alice:
                record = await conv.turn()
                assert record["continuation"] is True, (round_, conv.name, record)
        # The control: Bob's own most recent conversation continues too (he lost only his oldest).
        assert (await bob.turn())["continuation"] is True
