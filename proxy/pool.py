"""Upstream WebSocket sockets, per identity, one response in flight per socket.

httpcore's design: every state change happens in one synchronous step (:meth:`Pool._assign`,
:meth:`Pool.release`, :meth:`Pool._retire`) that also returns or schedules the sockets to close;
the I/O (handshake, close) happens after, and closing runs in its own task so a cancelled
request cannot interrupt it. The default lane caches only its latest response, so a socket
carries at most one conversation head; a socket that closes or is retired takes its head with it
(``HeadTable.discard``).

Choice of socket, in order:
1. the anchor's socket, when the request continues its head and it is idle;
2. an idle socket of the identity that holds no head (the most recently used: warmest);
3. a new socket, if under ``max_sockets_per_identity`` and ``max_sockets_total`` (at the total
   limit, the least recently used idle socket of any identity is closed to make room);
4. at the identity's limit: its least recently used idle socket (that head is lost);
5. nothing: the caller falls back to plain HTTP. Never a wait, never a wrong socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from proxy.config import Settings
from proxy.core.conversation import HeadTable
from proxy.errors import UpstreamRefused, UpstreamUnavailable
from proxy.identity import Identity
from proxy.metrics import SOCKET_AGE_AT_ROTATION, SOCKETS
from proxy.upstream import UpstreamSocket, open_websocket

__all__ = ["Lease", "Pool", "SocketState"]

_HTTP_AFTER_426_SECONDS = 300.0
"""How long an identity uses HTTP after an upgrade answered 426 (pitfall 17: not for good)."""
_HTTP_AFTER_AUTH_REFUSAL_SECONDS = 30.0
"""Hold-off after a 401/403 upgrade refusal without ``retry-after``: a revoked key would
otherwise cost two upstream round trips per request."""
_MAX_HOLD_OFF_SECONDS = 300.0


def hold_off_seconds(status: int, headers: dict[str, str]) -> float:
    """How long an identity uses plain HTTP after its upgrade was refused with ``status``.

    426 means "use HTTP" (5 minutes); a ``retry-after`` is honoured (capped at 5 minutes);
    401/403 hold off 30 s; any other refusal without ``retry-after`` pins nothing.
    """
    if status == 426:
        return _HTTP_AFTER_426_SECONDS
    try:
        retry_after = float(headers.get("retry-after", ""))
    except ValueError:
        retry_after = 0.0
    if retry_after > 0:
        return min(retry_after, _MAX_HOLD_OFF_SECONDS)
    return _HTTP_AFTER_AUTH_REFUSAL_SECONDS if status in (401, 403) else 0.0


_GAUGES = {"open": SOCKETS.labels("open"), "busy": SOCKETS.labels("busy"), "idle": SOCKETS.labels("idle")}


class SocketState(enum.Enum):
    """Where a socket is in its life."""

    CONNECTING = "connecting"
    BUSY = "busy"
    IDLE = "idle"
    CLOSED = "closed"


@dataclass(eq=False, slots=True)
class _Entry:
    key: int
    identity: Identity
    created_at: float
    used_at: float
    state: SocketState = SocketState.CONNECTING
    socket: UpstreamSocket | None = None
    holds_head: bool = False
    watcher: asyncio.Task[None] | None = None


@dataclass(frozen=True, slots=True)
class Lease:
    """One socket lent to one request until :meth:`Pool.release`."""

    entry: _Entry
    anchored: bool
    """The socket is the requested anchor's: a continuation frame may go on it."""
    fresh: bool
    """The socket was opened for this request (empty upstream cache)."""

    @property
    def key(self) -> int:
        """The socket's key: the anchor to begin/record/discard heads under."""
        return self.entry.key

    @property
    def socket(self) -> UpstreamSocket:
        """The connected socket."""
        assert self.entry.socket is not None, "lease used before connect"
        return self.entry.socket


class Pool:
    """Upstream sockets of every identity.

    Args:
        settings: ``pool`` limits and timers, ``ws_url``, ``timeouts.connect_seconds``.
        heads: The head table; retired sockets discard their heads there.
        clock: Monotonic clock (tests pass a fake one).
        spare: Keep one head-free idle socket per identity warm (opened in the background once
            every idle socket holds a head), so a new conversation does not wait for a handshake.
    """

    def __init__(
        self,
        settings: Settings,
        heads: HeadTable,
        *,
        clock: Callable[[], float] = time.monotonic,
        spare: bool = False,
    ) -> None:
        self.spare = spare
        self._warming: dict[Identity, asyncio.Task[None]] = {}
        self.settings = settings
        self.heads = heads
        self._clock = clock
        self._keys = itertools.count(1)
        self._entries: dict[int, _Entry] = {}
        self._idle: dict[Identity, OrderedDict[int, _Entry]] = {}
        self._counts: dict[Identity, int] = {}
        self._http_until: dict[Identity, float] = {}
        self._swept: dict[Identity, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._housekeeper: asyncio.Task[None] | None = None
        self._closed = False
        self.close_code = 1000
        """Close code for sockets retired from now on (1001 once the sidecar drains)."""

    def __repr__(self) -> str:
        states = {s: 0 for s in SocketState}
        for entry in self._entries.values():
            states[entry.state] += 1
        return (
            f"<Pool [Sockets: {states[SocketState.BUSY]} busy, {states[SocketState.IDLE]} idle, "
            f"{states[SocketState.CONNECTING]} connecting | Identities: {len(self._counts)}]>"
        )

    def count(self, state: SocketState | None = None, identity: Identity | None = None) -> int:
        """Sockets in ``state`` (all if ``None``), of ``identity`` (all if ``None``)."""
        return sum(
            1
            for e in self._entries.values()
            if (state is None or e.state is state) and (identity is None or e.identity == identity)
        )

    # -- predicates ------------------------------------------------------------------------

    def _usable(self, entry: _Entry, now: float) -> bool:
        pool = self.settings.pool
        return (
            entry.socket is not None
            and not entry.socket.closed
            and now - entry.created_at < pool.rotate_after_seconds
            and now - entry.used_at < pool.idle_close_seconds
        )

    def is_idle(self, anchor: Hashable) -> bool:
        """Whether ``anchor``'s socket can take a continuation now (``HeadTable.lookup`` asks)."""
        entry = self._entries.get(anchor) if isinstance(anchor, int) else None
        return entry is not None and entry.state is SocketState.IDLE and self._usable(entry, self._clock())

    def prefers_http(self, identity: Identity) -> bool:
        """Whether the upstream recently refused this identity's upgrade (see
        :func:`hold_off_seconds`): then its requests use plain HTTP."""
        until = self._http_until.get(identity)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._http_until[identity]
        return False

    # -- the synchronous steps ---------------------------------------------------------------

    def _move(self, entry: _Entry, state: SocketState) -> None:
        """Change state and keep ``SOCKETS{state}`` exact (deltas: several pools may share it)."""
        old = entry.state
        if old in (SocketState.BUSY, SocketState.IDLE):
            _GAUGES[old.value].dec()
            if state not in (SocketState.BUSY, SocketState.IDLE):
                _GAUGES["open"].dec()
        elif state in (SocketState.BUSY, SocketState.IDLE):
            _GAUGES["open"].inc()
        if state in (SocketState.BUSY, SocketState.IDLE):
            _GAUGES[state.value].inc()
        entry.state = state

    def _take(self, entry: _Entry) -> None:
        idle = self._idle[entry.identity]
        del idle[entry.key]
        if not idle:
            del self._idle[entry.identity]
        self._move(entry, SocketState.BUSY)

    def _retire(self, entry: _Entry) -> _Entry:
        """Forget ``entry`` and its head; the caller closes its socket (I/O comes after)."""
        if entry.state is SocketState.IDLE:
            self._take(entry)
        del self._entries[entry.key]
        count = self._counts[entry.identity] - 1
        if count:
            self._counts[entry.identity] = count
        else:
            del self._counts[entry.identity]
        self._move(entry, SocketState.CLOSED)
        self.heads.discard(entry.key)
        return entry

    def _lru_idle(self) -> _Entry | None:
        oldest: _Entry | None = None
        for idle in self._idle.values():
            first = next(iter(idle.values()))
            if oldest is None or first.used_at < oldest.used_at:
                oldest = first
        return oldest

    def _assign(
        self, identity: Identity, anchor: Hashable | None, fresh: bool, now: float
    ) -> tuple[Lease | None, list[_Entry]]:
        """Pick or reserve a socket. Synchronous: no other request interleaves."""
        pool = self.settings.pool
        to_close: list[_Entry] = []
        # Sweep expired idle sockets at most once a second per identity (not per request: with
        # hundreds of conversations per key that scan would cost more than the request).
        if now - self._swept.get(identity, -1.0) >= 1.0:
            self._swept[identity] = now
            idle_now = list(self._idle.get(identity, {}).values())
            to_close = [self._retire(e) for e in idle_now if not self._usable(e, now)]
        wanted = self._entries.get(anchor) if isinstance(anchor, int) and not fresh else None
        if wanted is not None and wanted.state is SocketState.IDLE and not self._usable(wanted, now):
            to_close.append(self._retire(wanted))
            wanted = None
        if wanted is not None and wanted.identity == identity and wanted.state is SocketState.IDLE:
            self._take(wanted)
            return Lease(wanted, anchored=True, fresh=False), to_close
        idle = self._idle.get(identity)
        if idle and not fresh:
            for candidate in reversed(idle.values()):
                if not candidate.holds_head:
                    if not self._usable(candidate, now):
                        to_close.append(self._retire(candidate))
                        break  # the dict changed; a new socket is opened below if allowed
                    self._take(candidate)
                    return Lease(candidate, anchored=False, fresh=False), to_close
        if self._counts.get(identity, 0) >= pool.max_sockets_per_identity:
            if not idle:
                return None, to_close
            victim = next(iter(idle.values()))
            if not fresh and self._usable(victim, now):
                self._take(victim)
                return Lease(victim, anchored=False, fresh=False), to_close
            to_close.append(self._retire(victim))
        elif len(self._entries) >= pool.max_sockets_total:
            oldest = self._lru_idle()
            if oldest is None:
                return None, to_close
            to_close.append(self._retire(oldest))
        entry = _Entry(next(self._keys), identity, created_at=now, used_at=now)
        self._entries[entry.key] = entry
        self._counts[identity] = self._counts.get(identity, 0) + 1
        return Lease(entry, anchored=False, fresh=True), to_close

    def release(self, lease: Lease, *, reusable: bool, head: bool = False) -> None:
        """Give a socket back. Synchronous, so it is safe in ``finally`` and on cancellation.

        Args:
            lease: From :meth:`acquire`.
            reusable: The response reached its terminal event and the socket is healthy.
                Otherwise the socket is closed (never hand a socket with an unfinished
                response to another request) and its head discarded.
            head: ``HeadTable.record`` was called for this socket.
        """
        entry = lease.entry
        if entry.state is not SocketState.BUSY:
            return  # retired meanwhile (pool closing, connect failure)
        now = self._clock()
        sock = entry.socket
        age = now - entry.created_at
        if reusable and not self._closed and sock is not None and not sock.closed:
            if age < self.settings.pool.rotate_after_seconds:
                entry.used_at = now
                entry.holds_head = head
                self._move(entry, SocketState.IDLE)
                self._idle.setdefault(entry.identity, OrderedDict())[entry.key] = entry
                if head and self.spare:
                    self._warm(entry.identity, now)
                return
            SOCKET_AGE_AT_ROTATION.observe(age)
        self._close_soon([self._retire(entry)])

    # -- I/O ---------------------------------------------------------------------------------

    async def acquire(self, identity: Identity, anchor: Hashable | None = None, *, fresh: bool = False) -> Lease | None:
        """Lend a socket of ``identity``; ``None`` means "use HTTP" (limits reached).

        Args:
            identity: The caller's identity; sockets never cross identities.
            anchor: The socket the request would continue on (or the app's own chain's).
            fresh: Insist on a new socket (a replay after a close or the age limit).

        Raises:
            UpstreamUnavailable: a needed new socket could not be opened (``UpstreamRefused``
                for a non-101 answer; after a 426, :meth:`prefers_http` is true for a while).
        """
        now = self._clock()
        lease, to_close = self._assign(identity, anchor, fresh, now)
        self._close_soon(to_close)
        if lease is None or not lease.fresh:
            return lease
        entry = lease.entry
        try:
            ws = await open_websocket(identity.ws_url, identity.headers, self.settings)
        except BaseException as exc:
            if entry.state is SocketState.CONNECTING:
                self._retire(entry)
            hold_off = hold_off_seconds(exc.http_status, exc.headers) if isinstance(exc, UpstreamRefused) else 0.0
            if hold_off > 0:
                self._http_until[identity] = self._clock() + hold_off
            raise
        entry.socket = UpstreamSocket(entry.key, ws, self._clock())
        entry.created_at = entry.used_at = entry.socket.created_at
        if entry.state is not SocketState.CONNECTING:  # the pool closed meanwhile
            self._close_soon([entry], 1001)
            raise UpstreamUnavailable("The sidecar is shutting down.")
        self._move(entry, SocketState.BUSY)
        entry.watcher = asyncio.get_running_loop().create_task(self._watch(entry))
        return lease

    def _warm(self, identity: Identity, now: float) -> None:
        """Open a spare socket for ``identity`` in the background if it has no head-free one."""
        pool = self.settings.pool
        if self._closed or identity in self._warming or self.prefers_http(identity):
            return
        if any(not e.holds_head for e in self._idle.get(identity, {}).values()):
            return
        if self._counts.get(identity, 0) >= pool.max_sockets_per_identity:
            return
        if len(self._entries) >= pool.max_sockets_total:
            return
        entry = _Entry(next(self._keys), identity, created_at=now, used_at=now)
        self._entries[entry.key] = entry
        self._counts[identity] = self._counts.get(identity, 0) + 1
        self._warming[identity] = asyncio.get_running_loop().create_task(self._open_spare(entry))

    async def _open_spare(self, entry: _Entry) -> None:
        try:
            ws = await open_websocket(entry.identity.ws_url, entry.identity.headers, self.settings)
        except BaseException:
            # A spare is an optimisation: a failure only means the next request connects itself.
            if entry.state is SocketState.CONNECTING:
                self._retire(entry)
            return
        finally:
            self._warming.pop(entry.identity, None)
        sock = UpstreamSocket(entry.key, ws, self._clock())
        entry.socket = sock
        if entry.state is not SocketState.CONNECTING:  # the pool closed meanwhile
            self._close_soon([entry])
            return
        entry.created_at = entry.used_at = sock.created_at
        self._move(entry, SocketState.IDLE)
        self._idle.setdefault(entry.identity, OrderedDict())[entry.key] = entry
        entry.watcher = asyncio.get_running_loop().create_task(self._watch(entry))

    async def _watch(self, entry: _Entry) -> None:
        """Retire an idle socket the upstream closes (its head goes with it)."""
        assert entry.socket is not None
        await entry.socket.wait_closed()
        if entry.state is SocketState.IDLE:
            self._retire(entry)

    def _close_soon(self, entries: list[_Entry], code: int | None = None) -> None:
        """Close sockets in their own tasks: a cancelled request cannot interrupt the cleanup."""
        code = code or self.close_code
        for entry in entries:
            if entry.watcher is not None:
                entry.watcher.cancel()
            if entry.socket is not None:
                task = asyncio.get_running_loop().create_task(entry.socket.close(code))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def start(self) -> None:
        """Start housekeeping: idle close, rotation of idle sockets, head expiry."""
        if self._housekeeper is None:
            self._housekeeper = asyncio.get_running_loop().create_task(self._housekeep())

    async def _housekeep(self) -> None:
        pool = self.settings.pool
        interval = min(max(min(pool.idle_close_seconds, pool.rotate_after_seconds) / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            now = self._clock()
            stale = [e for idle in self._idle.values() for e in idle.values() if not self._usable(e, now)]
            for entry in stale:
                if now - entry.created_at >= pool.rotate_after_seconds:
                    SOCKET_AGE_AT_ROTATION.observe(now - entry.created_at)
            self._close_soon([self._retire(e) for e in stale])
            self.heads.expire(now)

    async def close(self, code: int = 1001) -> None:
        """Close every socket (1001: going away) and stop housekeeping."""
        self._closed = True
        for task in list(self._warming.values()):
            task.cancel()
        await asyncio.gather(*self._warming.values(), return_exceptions=True)
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        self._close_soon([self._retire(e) for e in list(self._entries.values())], code)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
