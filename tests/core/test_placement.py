"""Placement as transcripts: where new heads go as sockets open, fill and run out, and when a
socket may open; the clock passed in."""

from __future__ import annotations

from collections import Counter

from proxy.core.demux import LaneSupport
from proxy.core.lanes import Lane, LaneState, SocketState
from proxy.core.placement import SLOW_START, Placed, Placement
from proxy.core.socketcaps import Caps
from tests.core.test_planner import req, response, user
from tests.core.test_sockets import custody


def placement(**limits: object) -> Placement:
    c = custody(**limits)
    return Placement(c, Caps(c.book.limits.cap_probe_seconds), Counter())


def take(pl: Placement, identity: str, now: float, close: list[int] | None = None) -> Placed | None:
    """A new head's lane, reserved (as the planner does); an opened socket opens and proves lanes."""
    found = pl.free_lane(identity, now, True, close if close is not None else [])
    if found is not None:
        lane, opened, spare = found
        pl.book.begin(lane, now)
        for sid in ([lane.key[0]] if opened else []) + ([spare] if spare is not None else []):
            sock = pl.book.opened(sid, now)
            assert sock is not None
            sock.demux.support = LaneSupport.PROVEN
    return found


def end(pl: Placement, lane: Lane, rid: str, now: float) -> None:
    sock = pl.book.all[lane.key[0]]
    pl.book.end(sock, lane)
    pl.custody.finished(sock.identity, lane, now, req([user(rid)]), response(rid), None)


def test_new_heads_spread_over_sockets_then_share_their_lanes() -> None:
    pl = placement(spread_sockets=2)
    first = take(pl, "id", 0.0)
    assert first is not None and first[:2] == (pl.book.all[1].lanes[None], True)
    second = take(pl, "id", 0.0)  # a free lane now, and a spare socket opened meanwhile
    assert second is not None and (second[0].key, second[1], second[2]) == ((1, "u1"), False, 2)
    third = take(pl, "id", 0.0)
    assert third is not None and third[0].key == (2, None) and not third[1]  # the least busy socket


def test_at_every_limit_a_head_is_let_go_and_while_growing_none_is() -> None:
    pl = placement(lanes_per_socket=1, max_sockets_per_identity=1, spread_sockets=1)
    first = take(pl, "id", 0.0)
    assert first is not None
    end(pl, first[0], "resp_a", 1.0)
    evicted = take(pl, "id", 2.0)  # no lane without a head, no socket more: the LRU head goes
    assert evicted is not None and evicted[0] is first[0] and not evicted[0].head
    assert len(pl.custody.heads) == 1  # stored: detached, still continuable
    assert take(pl, "id", 2.0) is None  # busy: nothing to evict
    assert not pl.growing("id")


def test_the_slow_start_holds_handshakes_back() -> None:
    pl = placement(spread_sockets=32)
    found = []
    for _ in range(SLOW_START + 2):
        f = pl.free_lane("id", 0.0, True, [])
        if f is not None:
            pl.book.begin(f[0], 0.0)  # reserved: a handshake's only lane
        found.append(f)
    assert [f is not None and f[1] for f in found] == [True] * SLOW_START + [False] * 2
    assert pl.slow_start and pl.growing("id")
    assert pl.book.socket_counts[SocketState.CONNECTING] == SLOW_START


def test_the_total_limit_closes_the_lru_idle_socket_of_the_tenant_holding_most() -> None:
    pl = placement(max_sockets_total=2, spread_sockets=1)
    a = take(pl, "key-a", 0.0)
    b = take(pl, "key-b", 1.0)
    assert a is not None and b is not None
    end(pl, a[0], "resp_a", 2.0)
    end(pl, b[0], "resp_b", 3.0)
    close: list[int] = []
    c = take(pl, "key-c", 4.0, close)
    assert c is not None and c[1] and close == [a[0].key[0]]  # a's socket: the least recently used
    assert pl.book.lane_counts[LaneState.IDLE] == 1  # b's lane; c's is busy


def test_a_held_off_identity_opens_nothing_and_outside_sockets_count() -> None:
    pl = placement(max_sockets_total=1)
    assert not pl.caps.refused("id", 0.0, 403, {}, b"")
    assert pl.free_lane("id", 1.0, True, []) is None
    pl.outside["relay"] += 1  # a WebSocket relay session holds the only socket allowed
    assert pl.free_lane("other", 1.0, True, []) is None


def test_a_socket_opened_on_its_probe_lane_takes_new_heads_on_its_default_lane_once_lanes_are_refused() -> None:
    pl = placement(max_sockets_per_identity=2, spread_sockets=1)
    first = take(pl, "id", 0.0)
    assert first is not None and first[0].key == (1, None)
    end(pl, first[0], "resp_a", 0.5)
    pl.book.proof.now = 1.0
    probe = pl.book.open("id", 1.0)  # the identity's second socket opens on its probe lane
    assert probe.key == (2, "u1")
    pl.book.begin(probe, 1.0)
    pl.book.opened(2, 1.0)
    assert pl.book.proof.refused(1.5)  # the upstream refused the stream_id: default lanes only
    pl.book.end(pl.book.all[2], probe)
    pl.custody.finished("id", probe, 1.5, None, None, None)  # no head came of it
    found = take(pl, "id", 2.0)  # socket 2's default lane, not socket 1's head let go
    assert found is not None and found[0].key == (2, None) and not found[1]
    assert pl.custody.heads.has((1, None))
    second = take(pl, "id", 2.0)  # the sockets' one lane each taken: socket 1's head goes now
    assert second is not None and second[0].key == (1, None) and not second[0].head
    assert take(pl, "id", 2.0) is None
