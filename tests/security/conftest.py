"""Fixtures of the security suite (the root conftest gives ``emulator``, ``make_sidecar``, ``sidecar``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """The attacker's and the app's HTTP client (a test module that needs a fresh connection per
    request defines its own)."""
    async with aiohttp.ClientSession() as session:
        yield session
