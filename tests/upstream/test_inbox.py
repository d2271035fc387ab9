"""A lane's inbox: its idle timeout falls at each wait's own deadline, however its one timer was
armed by earlier waits, and a finished inbox is not kept alive by that timer."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from typing import Any

import pytest

from proxy.errors import UpstreamClosed, UpstreamTimeout
from proxy.upstream.inbox import Inbox
from tests.upstream.test_ws import open_socket, settings_for

EVENT = (b'{"type":"response.in_progress"}', {"type": "response.in_progress"})


class _Marker:
    """Held by the inbox alone (as its ``on_drained``): dead once the inbox is freed (an
    inbox has slots, no weak reference)."""

    def __call__(self) -> None:
        pass


def _tracked(inbox: Inbox) -> weakref.ref[_Marker]:
    marker = inbox.on_drained = _Marker()
    return weakref.ref(marker)


def _put_later(inbox: Inbox, delay: float) -> None:
    asyncio.get_running_loop().call_later(delay, inbox.put, *EVENT)


async def _timed_out_after(inbox: Inbox, timeout: float) -> float:
    began = time.perf_counter()
    with pytest.raises(UpstreamTimeout):
        await inbox.burst(timeout)
    return time.perf_counter() - began


async def test_a_later_deadline_times_out_at_its_own_time_not_the_earlier_timers() -> None:
    inbox = Inbox(None)
    _put_later(inbox, 0.05)
    assert len(await inbox.burst(0.15)) == 1  # the timer is armed for 0.15 s after this wait began
    took = await _timed_out_after(inbox, 0.4)  # the earlier timer fires first, early: re-armed
    assert 0.39 <= took < 0.4 + 0.3


async def test_a_shorter_deadline_than_the_armed_timer_is_kept() -> None:
    inbox = Inbox(None)
    _put_later(inbox, 0.01)
    assert len(await inbox.burst(60.0)) == 1
    took = await _timed_out_after(inbox, 0.1)
    assert 0.09 <= took < 0.1 + 0.3


async def test_waits_that_get_events_go_on_timing_out_as_before() -> None:
    inbox = Inbox(None)
    for _ in range(5):
        _put_later(inbox, 0.01)
        assert len(await inbox.get(0.2)) == 2
    took = await _timed_out_after(inbox, 0.2)
    assert 0.19 <= took < 0.2 + 0.3
    # After a timeout the next wait arms its own timer again.
    _put_later(inbox, 0.01)
    assert len(await inbox.burst(0.2)) == 1
    assert 0.19 <= await _timed_out_after(inbox, 0.2) < 0.2 + 0.3


async def test_an_error_is_raised_at_once_and_the_timer_goes_with_it() -> None:
    inbox = Inbox(None)
    _put_later(inbox, 0.01)
    assert len(await inbox.burst(600.0)) == 1
    ref = _tracked(inbox)
    asyncio.get_running_loop().call_later(0.01, inbox.fail, UpstreamClosed("gone"))
    with pytest.raises(UpstreamClosed):
        await inbox.burst(600.0)
    del inbox
    gc.collect()
    assert ref() is None  # no timer holds it for 600 s


async def test_a_cancelled_wait_leaves_no_timer_holding_the_inbox() -> None:
    inbox = Inbox(None)
    ref = _tracked(inbox)
    task = asyncio.create_task(inbox.burst(600.0))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait([task])  # not awaited itself: its traceback would hold the inbox
    assert task.cancelled()
    del inbox, task
    gc.collect()
    assert ref() is None


async def test_a_closed_inbox_is_not_kept_alive_by_its_timer(emulator: Any) -> None:
    """The last wait of a response got its terminal event, so its timer is still armed: closing
    the inbox (the lane's response is over) cancels it, and nothing else holds the inbox."""
    sock = await open_socket(settings_for(emulator.base_url))
    inbox = sock.open_inbox(None)
    ref = _tracked(inbox)
    await sock.send(b'{"type":"response.create","model":"gpt-6.1-sol","input":"hi"}', None)
    types: list[str] = []
    while not types or types[-1] != "response.completed":
        types += [event["type"] for _, event in await inbox.burst(600.0)]
    sock.close_inbox(inbox)
    del inbox
    gc.collect()
    assert ref() is None
    await sock.close()
