"""Rotation as a transcript: sockets age and idle with the clock passed in."""

from __future__ import annotations

from proxy.core.lanes import SocketState
from proxy.core.rotation import rotate
from tests.core.test_planner import req, response, user
from tests.core.test_sockets import custody


def test_idle_and_aged_sockets_close_busy_aged_ones_retire_and_kept_heads_are_reseeded() -> None:
    c = custody(idle_close_seconds=80.0, rotate_after_seconds=100.0, reseed=True)
    book = c.book
    kept, busy, idle = (book.open(f"id{i}", 0.0) for i in range(3))
    for lane in (kept, busy, idle):
        book.opened(lane.key[0], 0.0)
    unstored = req([user("a")], store=False)
    c.finished("id0", kept, 0.0, unstored, response("resp_k", {"type": "message"}), None)
    book.begin(busy, 60.0)
    book.begin(idle, 60.0)
    sock = book.all[idle.key[0]]
    book.end(sock, idle)
    sock.used_at = -30.0  # last used long ago
    tick = rotate(c, 60.0)
    assert tick.close == [idle.key[0]] and tick.ages == [] and tick.reseed == []  # idle only
    tick = rotate(c, 100.0)
    assert tick.close == [kept.key[0]] and tick.ages == [100.0]
    assert [(job.identity, job.anchor) for job in tick.reseed] == [("id0", kept.key)]
    assert c.heads.has(kept.key)  # kept for its re-seed, though not stored
    assert book.all[busy.key[0]].state is SocketState.RETIRING
    c.reseeded(kept.key, None, None)  # the re-seed failed: the head goes
    assert not c.heads.has(kept.key) and len(c.kept) == 0
