"""Placement against its plain model: the same random walks (heads taken, ended, abandoned, let
go; sockets opened, lost, stream-limited; named lanes refused; the clock moving) run through
:meth:`Placement.free_lane` and through the straightforward two-pass version of it below (every
socket's free slot, then the least recently used idle lane as the victim), and every placement
and the state after it must be the same."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from proxy.core.demux import LaneSupport
from proxy.core.lanes import Lane, LaneState, Socket, SocketState, lane_name
from proxy.core.placement import Placed, Placement
from proxy.core.socketcaps import Caps
from tests.core.test_planner import req, response, user
from tests.core.test_sockets import custody


class Model:
    """The two-pass placement, written for clarity rather than speed, around a :class:`Placement`
    of its own (its helpers and state; not a subclass: the compiled build compiles Placement,
    and an interpreted class cannot inherit from a compiled one)."""

    def __init__(self, pl: Placement) -> None:
        self.pl, self.book, self.custody, self.limits = pl, pl.book, pl.custody, pl.limits

    @property
    def slow_start(self) -> bool:
        return self.pl.slow_start

    def model_slots(self, sock: Socket) -> list[Lane]:
        return [sock.lanes[n] for n in map(lane_name, range(self.book.slots(sock))) if n in sock.lanes]

    def model_free_slot(self, sock: Socket) -> Lane | None:
        for lane in self.model_slots(sock):
            if lane.state is LaneState.IDLE and not self.custody.holds(lane):
                return lane
        return self.book.new_lane(sock)

    def free_lane(self, identity: str, now: float, may_open: bool, close: list[int]) -> Placed | None:
        lim, book = self.limits, self.book
        mine = book.of(identity).values()
        socks = [
            s
            for s in mine
            if s.live and not book.stale(s, now) and s.active < lim.max_active_per_socket and not s.exclusive
        ]
        socks.sort(key=lambda s: (s.state is not SocketState.OPEN, s.active, -s.used_at))
        spread = len(mine) < lim.spread_sockets and not any(s.active == 0 for s in mine)
        if may_open and spread and self.pl._can_open(identity, now, close):
            opened = [s for s in socks if s.state is SocketState.OPEN]
            lane = self.model_free_slot(opened[0]) if opened else None
            if lane is None:
                return book.open(identity, now), True, None
            return lane, False, book.open(identity, now, reserve=False).key[0]
        for sock in socks:
            lane = self.model_free_slot(sock)
            if lane is not None:
                return lane, False, None
        self.pl.slow_start = False
        if may_open and self.pl._can_open(identity, now, close):
            return book.open(identity, now), True, None
        if self.pl.growing(identity):
            return None
        victim: Lane | None = None
        for sock in socks:
            if sock.state is not SocketState.OPEN:
                continue
            for lane in self.model_slots(sock):
                if lane.state is LaneState.IDLE and (victim is None or lane.used_at < victim.used_at):
                    victim = lane
        if victim is None:
            return None
        self.custody.let_go(victim)
        return victim, False, None


def state(pl: Placement | Model) -> list[object]:
    """Everything a placement decides or changes, comparable across the two."""
    book = pl.book
    socks = [
        (
            s.id,
            s.identity,
            s.state,
            s.active,
            s.used_at,
            [(n, ln.state, ln.head, ln.used_at) for n, ln in s.lanes.items()],
        )
        for s in book.all.values()
    ]
    heads = sorted((str(a), h.response_id) for a, h in pl.custody.heads.recent(1000))
    return [socks, heads, pl.slow_start, book.busy_sockets]


def walk(pl: Placement | Model, seed: int, steps: int) -> list[object]:
    """A random walk of ``steps`` steps; returns what every step decided and the state after it."""
    rng = random.Random(seed)
    book, seen, now = pl.book, [], 0.0
    for i in range(steps):
        now += rng.choice((0.0, 0.0, 0.0, 0.1, 1.0, 7.0))
        book.proof.now = now
        busy = [ln for s in book.all.values() for ln in s.lanes.values() if ln.state is not LaneState.IDLE]
        roll = rng.random()
        if roll < 0.45:
            close: list[int] = []
            found = pl.free_lane(rng.choice("ab"), now, rng.random() < 0.8, close)
            if found is not None:
                lane, opened, spare = found
                book.begin(lane, now)
                for sid in ([lane.key[0]] if opened else []) + ([spare] if spare is not None else []):
                    if rng.random() < 0.8:
                        sock = book.opened(sid, now)
                        if sock is not None and rng.random() < 0.7:
                            sock.demux.support = LaneSupport.PROVEN
            seen.append(("take", found and (found[0].key, found[1], found[2]), close))
        elif roll < 0.75 and busy:
            lane = rng.choice(busy)
            sock = book.all[lane.key[0]]
            book.end(sock, lane)
            lane.used_at = now
            rid = f"resp_{i}"
            stored = rng.random() < 0.5
            done = (req([user(rid)], store=stored), response(rid)) if rng.random() < 0.8 else (None, None)
            pl.custody.finished(sock.identity, lane, now, *done, None)
        elif roll < 0.8 and busy:
            pl.custody.abandon(rng.choice(busy).key)
        elif roll < 0.85 and book.all:
            pl.custody.lost(rng.choice(sorted(book.all)))
        elif roll < 0.9 and busy:
            book.stream_limit(rng.choice(busy).key)
        elif roll < 0.92:
            book.proof.refused(now)
        seen.append(state(pl))
    return seen


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_free_lane_places_every_head_where_the_two_pass_model_does(seed: int, lanes: int) -> None:
    limits = {
        "lanes_per_socket": lanes,
        "max_active_per_socket": 3,
        "max_sockets_per_identity": 3,
        "max_sockets_total": 5,
        "spread_sockets": 2,
        "idle_close_seconds": 20.0,
        "rotate_after_seconds": 60.0,
    }
    fast, plain = custody(**limits), custody(**limits)
    got = walk(Placement(fast, Caps(600.0), Counter()), seed, 150)
    want = walk(Model(Placement(plain, Caps(600.0), Counter())), seed, 150)
    assert got == want
    assert any(s[0] == "take" and s[1] is not None and not s[1][1] for s in got if isinstance(s, tuple))


def test_a_sockets_active_count_is_its_busy_and_draining_lanes() -> None:
    """Placement skips a socket whose every slot is made and whose ``active`` equals its lane
    count: that holds because ``active`` counts exactly the lanes BUSY or DRAINING."""
    c = custody(lanes_per_socket=4)
    rng = random.Random(7)
    for now in range(300):
        lanes = [ln for s in c.book.all.values() for ln in s.lanes.values()]
        idle = [ln for ln in lanes if ln.state is LaneState.IDLE]
        busy = [ln for ln in lanes if ln.state is LaneState.BUSY]
        roll = rng.random()
        if roll < 0.2 or not lanes:
            sock = c.book.open("id", float(now))
            c.book.opened(sock.key[0], float(now))
        elif roll < 0.5 and c.book.all:
            sock = c.book.all[rng.choice(sorted(c.book.all))]
            new = c.book.new_lane(sock)
            target = new if new is not None else (rng.choice(idle) if idle else None)
            if target is not None and target.state is LaneState.IDLE:
                c.book.begin(target, float(now))
        elif roll < 0.7 and busy:
            c.abandon(rng.choice(busy).key)
        elif roll < 0.95:
            active = [ln for ln in lanes if ln.state is not LaneState.IDLE]
            if active:
                lane = rng.choice(active)
                c.book.end(c.book.all[lane.key[0]], lane)
        elif c.book.all:
            c.lost(rng.choice(sorted(c.book.all)))
        for sock in c.book.all.values():
            counted = sum(ln.state in (LaneState.BUSY, LaneState.DRAINING) for ln in sock.lanes.values())
            assert sock.active == counted
