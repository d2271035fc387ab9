"""Rotation: sockets closed when idle or aged, and the heads they held re-seeded elsewhere.

The upstream ends a socket after 60 minutes; the sidecar rotates its own first
(``pool.rotate_after_seconds``) and closes idle ones (``pool.idle_close_seconds``). An aged
socket with turns in flight is retired (no new turns; it closes once drained); an aged idle one
is closed, and the ``store: false`` heads it held whose context is kept
(:class:`~proxy.core.reseed.KeptContexts`) are handed back as :class:`~proxy.core.reseed.Reseed`
jobs: the pool rebuilds each on a new lane with a ``generate: false`` create and tells the
planner how it went (``Planner.reseeded``).
"""

from __future__ import annotations

from proxy.core.lanes import SocketEvent, SocketState
from proxy.core.reseed import Reseed, Tick
from proxy.core.sockets import Custody

__all__ = ["rotate"]


def rotate(custody: Custody, now: float) -> Tick:
    """Close idle and aged sockets (re-seeding their kept ``store: false`` heads), retire aged
    busy ones, expire heads."""
    book = custody.book
    lim = book.limits
    done = Tick([], [], [])
    for sock in list(book.all.values()):
        if sock.state is SocketState.CONNECTING:
            continue
        age = now - sock.created_at
        aged = age >= lim.rotate_after_seconds
        if sock.active == 0 and (aged or now - sock.used_at >= lim.idle_close_seconds):
            if aged:
                done.ages.append(age)
                for lane in sock.lanes.values():
                    head = custody.heads.get(lane.key) if lane.head else None
                    kept = custody.kept.get(head.response_id) if head is not None and not head.store else None
                    if kept is not None:
                        custody.reseeding.add(lane.key)
                        done.reseed.append(Reseed(sock.identity, lane.key, kept))
            custody.close(sock, SocketEvent.CLOSE)
            done.close.append(sock.id)
        elif aged:
            book.retire(sock)
    custody.heads.expire(now)
    return done
