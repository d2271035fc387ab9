"""The event loops the sidecar runs on (proxy/loop.py): a test that depends on the loop's order
of timers and I/O runs under each, in its own :class:`asyncio.Runner`."""

from __future__ import annotations

import asyncio

import pytest

__all__ = ["LOOP_KINDS", "loop_runner"]

LOOP_KINDS = ["asyncio", "uvloop"]


def loop_runner(loop_kind: str) -> asyncio.Runner:
    """A runner on ``loop_kind`` (the test skips where uvloop is not installed)."""
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()
