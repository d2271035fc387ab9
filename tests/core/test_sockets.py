"""The socket book and head custody as transcripts: sockets opened, lanes begun and ended, heads
recorded, let go and kept past a closed socket, the clock passed in."""

from __future__ import annotations

from proxy.core.conversation import HeadTable
from proxy.core.creators import OwnerRegistry
from proxy.core.demux import LaneSupport
from proxy.core.lanes import LaneLimits, LaneProof, LaneState, SocketEvent, SocketState
from proxy.core.sockets import Custody, SocketBook
from tests.core.test_planner import req, response, user


def custody(**limits: object) -> Custody:
    lim = LaneLimits(**limits)  # type: ignore[arg-type]
    heads = HeadTable(max_heads=100, ttl_seconds=3600)
    return Custody(lim, heads, OwnerRegistry.for_heads(100), SocketBook(lim, LaneProof(lim.lanes_per_socket)))


def test_a_socket_opens_begins_and_ends_a_turn_with_its_counts() -> None:
    book = custody().book
    lane = book.open("id", 0.0)
    assert lane.key == (1, None)  # an identity's first socket starts on its default lane
    assert book.socket_counts[SocketState.CONNECTING] == 1 and book.lane_counts[LaneState.IDLE] == 1
    book.begin(lane, 0.0)
    assert book.busy_sockets == 0  # connecting sockets are not counted busy
    sock = book.opened(1, 0.5)
    assert sock is not None and book.busy_sockets == 1 and book.opened(1, 0.6) is None
    assert book.idle_lane(lane.key) is None  # busy
    book.end(sock, lane)
    assert (lane.state, sock.active, book.busy_sockets) == (LaneState.IDLE, 0, 0)
    assert book.idle_lane(lane.key) is lane


def test_a_second_socket_probes_on_a_named_lane_and_stale_sockets_take_no_turn() -> None:
    book = custody(idle_close_seconds=10.0, rotate_after_seconds=100.0).book
    first = book.open("id", 0.0)
    book.opened(first.key[0], 0.0)
    second = book.open("id", 0.0)
    assert second.key == (2, "u1")  # not the identity's first: its first lane is the probe
    book.proof.now = 11.0
    assert book.idle_lane(first.key) is None  # idle for longer than idle_close_seconds


def test_new_lanes_follow_the_proof_and_the_stream_limit() -> None:
    book = custody(lanes_per_socket=4).book
    lane = book.open("id", 0.0)
    sock = book.opened(1, 0.0)
    assert sock is not None
    sock.demux.support = LaneSupport.PROVEN
    assert [book.new_lane(sock) for _ in range(3)][-1] is not None
    assert book.new_lane(sock) is None  # 4 slots, all made
    book.stream_limit(lane.key)
    assert len(book.slot_lanes(sock)) == 3  # the upstream said no more streams on it
    assert book.proof.refused(1.0)
    assert book.slots(sock) == 1  # named lanes off: the default lane only


def test_custody_records_a_head_and_drops_it_on_a_failed_turn() -> None:
    c = custody()
    lane = c.book.open("id", 0.0)
    r = req([user("a")])
    c.finished("id", lane, 1.0, r, response("resp_a"), None)
    assert lane.head and c.heads.has(lane.key) and c.owners.owner_of("resp_a") == "id"
    c.finished("id", lane, 2.0, r, None, None)
    assert not lane.head and not c.heads.has(lane.key)


def test_a_closed_socket_keeps_stored_heads_and_forgets_the_others() -> None:
    c = custody()
    stored = c.book.open("id", 0.0)
    c.book.opened(1, 0.0)
    c.finished("id", stored, 1.0, req([user("a")]), response("resp_a"), None)
    unstored = c.book.open("id", 0.0)
    c.finished("id", unstored, 1.0, req([user("b")], store=False), response("resp_b"), None)
    c.close(c.book.all[1], SocketEvent.LOST)
    c.close(c.book.all[2], SocketEvent.FAILED)
    assert c.heads.has(stored.key) and not c.heads.has(unstored.key)
    assert c.book.all == {} and sum(c.book.lane_counts.values()) == 0


def test_letting_go_detaches_a_stored_head_and_adopt_makes_one_without_a_lane() -> None:
    c = custody()
    lane = c.book.open("id", 0.0)
    c.finished("id", lane, 1.0, req([user("a")]), response("resp_a"), None)
    c.let_go(lane)
    assert not lane.head and not c.heads.has(lane.key) and len(c.heads) == 1  # under a dead key
    c.adopt("id", req([user("b")]), response("resp_b"), 2.0)
    c.adopt("id", req([user("c")], store=False), response("resp_c"), 2.0)  # not stored: no head
    assert len(c.heads) == 2 and c.owners.owner_of("resp_b") == "id"


def test_abandon_drains_retire_closes_once_drained_and_close_all() -> None:
    c = custody()
    lane = c.book.open("id", 0.0)
    sock = c.book.opened(1, 0.0)
    assert sock is not None
    c.book.begin(lane, 0.0)
    c.abandon(lane.key)
    assert lane.state is LaneState.DRAINING
    assert c.retire(1) == [1]  # a draining lane goes with its socket
    other = c.book.open("id", 1.0)
    c.lost(other.key[0])
    assert c.book.all == {} and c.close_all() == []
