"""The pool's sockets as I/O: opening them (each handshake in a task of its own, so a cancelled
request cannot interrupt a handshake other requests wait for), taking them over, closing them
(in tasks of their own too), noticing when one is lost, and the socket and lane gauges. The
planner says which socket to open or close; :class:`Connector` does it and tells the planner
how it went.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from proxy.config import Settings
from proxy.core.demux import LaneSignal
from proxy.core.lanes import LaneLimits, LaneState, SocketState
from proxy.core.planner import Planner
from proxy.core.sockets import SocketBook
from proxy.errors import UpstreamRefused, UpstreamUnavailable
from proxy.intake.identity import Identity
from proxy.observe.metrics import LANES, SOCKET_CAP, SOCKETS, UPGRADE_REFUSALS
from proxy.upstream.caps import CapFile
from proxy.upstream.handshake import open_websocket
from proxy.upstream.ws import UpstreamSocket

__all__ = ["Connector", "lane_limits"]

log = logging.getLogger(__name__)


_CONNECTORS: weakref.WeakSet[Connector] = weakref.WeakSet()
"""The connectors of this process (tests run several pools): the gauges below add theirs up."""


def _gauge(count: Callable[[SocketBook], int]) -> Callable[[], float]:
    return lambda: float(sum(count(c.planner.book) for c in list(_CONNECTORS)))


def _live(book: SocketBook) -> int:
    return book.socket_counts[SocketState.OPEN] + book.socket_counts[SocketState.RETIRING]


# The socket and lane gauges are read from the planners when scraped: a turn pays
# nothing for them, and a scrape sees the counts as they are.
for _child, _count in (
    (SOCKETS.labels("open"), _live),
    (SOCKETS.labels("busy"), lambda b: b.busy_sockets),
    (SOCKETS.labels("idle"), lambda b: _live(b) - b.busy_sockets),
    (SOCKETS.labels("connecting"), lambda b: b.socket_counts[SocketState.CONNECTING]),
    (LANES.labels("busy"), lambda b: b.lane_counts[LaneState.BUSY]),
    (LANES.labels("idle"), lambda b: b.lane_counts[LaneState.IDLE]),
    (LANES.labels("draining"), lambda b: b.lane_counts[LaneState.DRAINING]),
):
    _child.set_function(_gauge(_count))


def lane_limits(settings: Settings) -> LaneLimits:
    """The planner's limits from the ``pool`` settings (and ``timeouts.connect_seconds``)."""
    p = settings.pool
    return LaneLimits(
        lanes_per_socket=p.lanes_per_socket,
        max_active_per_socket=p.max_active_per_socket,
        max_sockets_per_identity=p.max_sockets_per_identity,
        max_sockets_total=p.max_sockets_total,
        spread_sockets=p.spread_sockets,
        idle_close_seconds=p.idle_close_seconds,
        rotate_after_seconds=p.rotate_after_seconds,
        reseed=p.reseed,
        reseed_bytes=p.reseed_bytes,
        cap_probe_seconds=p.cap_probe_seconds,
        wait_seconds=p.wait_seconds,
        connect_seconds=settings.timeouts.connect_seconds,
        http_continuations=p.http_continuations,
        http_continuation_after_seconds=p.http_continuation_after_seconds,
    )


class Connector:
    """Open and close the planner's sockets.

    Args:
        settings: ``pool`` timers and sizes, ``timeouts.connect_seconds``.
        planner: Told every handshake's outcome and every loss.
        caps: The learned caps shared with the other workers of this machine.
        clock: Monotonic clock.
        changed: Called when a socket opened, failed or closed (every turn waiting in the pool plans again).
        on_signal: Called with what a socket's demux learned about ``stream_id``.
    """

    def __init__(
        self,
        settings: Settings,
        planner: Planner,
        caps: CapFile,
        clock: Callable[[], float],
        changed: Callable[[], None],
        on_signal: Callable[[LaneSignal], None],
    ) -> None:
        self.settings = settings
        self.planner = planner
        self.caps = caps
        self._clock = clock
        self._changed = changed
        self._on_signal = on_signal
        self.socks: dict[int, UpstreamSocket] = {}
        """The open sockets by id."""
        self.ready: dict[int, asyncio.Future[None]] = {}
        """Handshakes under way by socket id: done when the socket is usable, or failed."""
        self.tasks: set[asyncio.Task[None]] = set()
        self.opening: set[asyncio.Task[None]] = set()
        self.closed = False
        self.close_code = 1000
        """Close code for sockets retired from now on (1001 once the sidecar drains)."""
        _CONNECTORS.add(self)

    def start_open(self, sid: int, identity: Identity) -> None:
        """Open socket ``sid`` of ``identity`` in a task of its own (:attr:`ready` says when)."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "not retrieved"
        self.ready[sid] = ready
        task = asyncio.get_running_loop().create_task(self._open(sid, identity, ready))
        self.opening.add(task)
        task.add_done_callback(self.opening.discard)

    async def _open(self, sid: int, identity: Identity, ready: asyncio.Future[None]) -> None:
        try:
            ws = await open_websocket(identity.ws_url, identity.headers, self.settings)
        except BaseException as exc:
            refused = isinstance(exc, UpstreamRefused)
            status = exc.http_status if isinstance(exc, UpstreamRefused) else None
            headers = exc.headers if isinstance(exc, UpstreamRefused) else {}
            payload = exc.payload if isinstance(exc, UpstreamRefused) else b""
            planned = self.planner.socket(sid)
            capped = self.planner.open_failed(
                sid, self._clock(), status=status, headers=headers, payload=payload, jitter=random.random()
            )
            if refused:
                UPGRADE_REFUSALS.labels("cap" if capped else "other").inc()
            if capped and planned is not None:
                self.caps.publish(self.planner, planned.identity, self._clock())
                self.publish_cap(planned.identity)
            error = exc if isinstance(exc, UpstreamUnavailable) else UpstreamUnavailable("Connecting was cancelled.")
            ready.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            self.ready.pop(sid, None)
            self._changed()
        now = self._clock()
        record = self.planner.socket(sid)
        try:
            sock = UpstreamSocket(
                sid,
                ws,
                now,
                demux=record.demux if record is not None else None,
                on_closed=self._lost,
                on_signal=self._on_signal,
                ping_interval=self.settings.pool.ping_interval_seconds,
                ping_timeout=self.settings.pool.ping_timeout_seconds,
                fragment_bytes=self.settings.pool.fragment_bytes,
            )
        except Exception as exc:  # a library change the contracts did not foresee: never a hang
            log.exception("taking the upstream socket over failed")
            with contextlib.suppress(Exception):
                ws.transport.abort()
            self.planner.open_failed(sid, now, status=None, headers={})
            ready.set_exception(UpstreamUnavailable(f"The upstream socket could not be used: {exc}"))
            self._changed()
            return
        if self.closed or record is None:  # the pool closed meanwhile
            self.socks[sid] = sock
            self.close_soon([sid], 1001)
            ready.set_exception(UpstreamUnavailable("The sidecar is shutting down."))
            return
        self.socks[sid] = sock
        self.planner.opened(sid, now)
        ready.set_result(None)
        self.publish_cap(record.identity)

    def publish_cap(self, identity: str) -> None:
        """Set the socket-cap gauge when ``identity`` has a learned cap."""
        if self.planner.learned_cap(identity) is not None:
            SOCKET_CAP.set(min(c.limit for c in self.planner.caps.values() if c.limit is not None))

    def _lost(self, sock: UpstreamSocket) -> None:
        """The reader saw the connection end: every lane of it ends too."""
        if self.socks.get(sock.key) is sock:
            del self.socks[sock.key]
        self.planner.custody.lost(sock.key)
        self._changed()

    def close_soon(self, ids: list[int] | tuple[int, ...], code: int | None = None) -> None:
        """Close sockets in their own tasks: a cancelled request cannot interrupt the cleanup."""
        code = code or self.close_code
        for sid in ids:
            sock = self.socks.pop(sid, None)
            if sock is None:
                continue
            self.spawn(sock.close(code))

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task of its own, which :meth:`close` waits for."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self, code: int) -> None:
        """Stop every handshake, close every socket and wait for the closes."""
        self.closed = True
        for task in list(self.opening):
            task.cancel()
        await asyncio.gather(*self.opening, return_exceptions=True)
        self.planner.custody.close_all()
        self.close_soon(list(self.socks), code)
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
