"""Learned socket caps and hold-offs as transcripts: refusals fed in with the clock passed in."""

from __future__ import annotations

from proxy.core.socketcaps import Caps, SocketCap, hold_off_seconds, is_cap_refusal


def test_a_cap_refusal_teaches_the_cap_backs_off_and_allows_one_probe_now_and_then() -> None:
    caps = Caps(probe_seconds=100.0)
    assert caps.allows("id", 5, 0, 0.0) and caps.learned("id") is None
    assert caps.refused("id", 1.0, 429, {}, b"")
    caps.capped("id", 2, 1.0, {}, jitter=0.0)
    assert caps.learned("id") == 2
    assert caps.held_off("id", 1.4) and not caps.held_off("id", 1.6)  # the first backoff: 0.5 s
    caps.capped("id", 2, 2.0, {"retry-after": "3"}, jitter=0.0)
    assert caps.held_off("id", 4.9) and not caps.held_off("id", 5.1)  # retry-after beats the 1 s backoff
    assert caps.allows("id", 1, 0, 6.0)  # below the cap
    assert not caps.allows("id", 2, 0, 6.0)  # at it, before the probe time
    assert caps.allows("id", 2, 0, 102.5)  # one probe above it (100 s after the last refusal) ...
    assert not caps.allows("id", 2, 0, 102.5)  # ... then the next waits cap_probe_seconds again
    caps.opened("id", 3)  # the probe got through: the limit was raised
    assert caps.learned("id") == 3 and caps.caps["id"].refusals == 0


def test_jitter_stretches_our_backoff_only() -> None:
    caps = Caps(probe_seconds=100.0)
    caps.capped("id", 1, 0.0, {}, jitter=0.99)
    assert caps.held_off("id", 0.6) and not caps.held_off("id", 0.63)  # 0.5 s * (1 + 0.25 * 0.99)


def test_other_refusals_hold_off_new_sockets_for_their_time() -> None:
    caps = Caps(probe_seconds=100.0)
    assert not caps.refused("id", 0.0, 401, {}, b"")
    assert caps.held_off("id", 29.0) and not caps.held_off("id", 30.0)
    assert not caps.refused("other", 0.0, None, {}, b"")  # a connect error holds nothing
    assert not caps.held_off("other", 0.0)
    assert is_cap_refusal(400, b'{"code":"websocket_connection_limit_reached"}')
    assert (hold_off_seconds(426, {}), hold_off_seconds(503, {"retry-after": "900"})) == (300.0, 300.0)


def test_the_stricter_of_two_workers_caps_holds() -> None:
    caps = Caps(probe_seconds=100.0)
    caps.capped("id", 4, 0.0, {}, jitter=0.0)
    caps.merge("id", SocketCap(limit=2, until=50.0, refusals=3, probe_at=10.0))
    mine = caps.caps["id"]
    assert (mine.limit, mine.until, mine.refusals, mine.probe_at) == (2, 50.0, 3, 100.0)
