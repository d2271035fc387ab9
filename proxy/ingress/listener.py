"""An API listener fit for a network: a header deadline and a bound on open connections.

aiohttp has no header-read timeout: a client that opens a connection and sends half a request
line holds it until the keep-alive timeout (an hour by default). Once the API port is
reachable by other Pods (a gateway, replicas, peers), that is a cheap way to exhaust it. So:

* a connection must deliver a request's complete headers within
  ``listener.header_timeout_seconds`` of opening, and so must every later request on it
  (counted from its first byte); otherwise it is closed;
* an idle keep-alive connection is closed after ``listener.keepalive_seconds``;
* at most ``listener.max_connections`` are open; one more gets a ``503`` OpenAI-shaped answer
  (with ``x-upshift-refused``) and is closed at once, before anything of it is read.

The protocol is aiohttp's own ``RequestHandler``; only the timer and the count are added, plus
the byte accounting a connection handoff between workers needs (:mod:`proxy.ingress.handoff`): how many
bytes the connection delivered, and where the current request's head ended, so that a handler
can tell that nothing of a next (pipelined) request has been read yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import stat
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server as LowServer

from proxy import contracts
from proxy.config import ListenerSettings
from proxy.kernel import AcceptDrain, received_ago, tcp_socket
from proxy.observe.metrics import LISTENER_CLOSED, LISTENER_CONNECTIONS
from proxy.reasons import ListenerClose

__all__ = ["Guard", "GuardedHandler", "HardenedTCPSite", "HardenedUnixSite", "protocol_factory"]

_HEAD_SCAN = 64 * 1024
"""A request head not complete within this many bytes is not tracked (no handoff for it)."""

_STALL_SECONDS = 1.0
"""A connection in its headers this long may be closed to admit a new one at the limit."""

_REFUSAL_BODY = (
    b'{"error":{"message":"The sidecar has too many open connections; retry shortly.",'
    b'"type":"server_error","param":null,"code":"too_many_connections"}}'
)
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nx-should-retry: true\r\nx-upshift-refused: max_connections\r\n"
    b"Content-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY
)


class Guard:
    """Open-connection count and limits shared by the sites of one listener.

    At ``max_connections`` a new connection first makes room: the least recently
    active idle keep-alive connection is closed, else the one stalled longest in its headers
    (for at least :data:`_STALL_SECONDS`, or half the header deadline when that is shorter).
    A connection with a request in progress is never reaped (its body has its own deadline);
    only when none can go is the new one refused.
    """

    def __init__(self, settings: ListenerSettings) -> None:
        self.max_connections = settings.max_connections
        self.header_timeout = settings.header_timeout_seconds
        self.open = 0
        self.connections: dict[GuardedHandler, None] = {}
        """Open connections, least recently active first."""

    def touch(self, handler: GuardedHandler) -> None:
        connections = self.connections
        if handler in connections:
            del connections[handler]
            connections[handler] = None

    def make_room(self, now: float) -> bool:
        """Close one idle or stalled connection to admit a new one; whether one was closed."""
        stall = min(_STALL_SECONDS, self.header_timeout / 2) if self.header_timeout > 0 else _STALL_SECONDS
        stalled: GuardedHandler | None = None
        for handler in self.connections:
            if handler.reapable_idle():
                return self._reap(handler, ListenerClose.REAPED_IDLE)
            if stalled is None and handler.stalled_since(now) >= stall:
                stalled = handler
        return stalled is not None and self._reap(stalled, ListenerClose.REAPED_STALLED)

    def _reap(self, handler: GuardedHandler, why: ListenerClose) -> bool:
        del self.connections[handler]
        LISTENER_CLOSED.labels(why).inc()
        handler.force_close()
        return True


class GuardedHandler(RequestHandler):
    """aiohttp's protocol for one connection, with the listener's deadline, count and the byte
    accounting a handoff needs (:mod:`proxy.ingress.handoff`)."""

    __slots__ = (
        "_guard",
        "_head",
        "_head_start",
        "_last_payload",
        "_armed_at",
        "_header_timer",
        "_refused",
        "_sock",
        "adopted",
        "arrived",
        "head_end",
        "private",
        "received",
        "request_line",
    )

    def __init__(self, guard: Guard, manager: LowServer, *, adopted: bool = False, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._header_timer: asyncio.TimerHandle | None = None
        self._armed_at = 0.0
        self._refused = False
        self.adopted = adopted
        """Handed over by another worker (its first request came with it): admitted past
        ``max_connections`` (the connection left the other worker's count) and, for that first
        request, never handed on (:mod:`proxy.ingress.handoff`)."""
        self.private = False
        """The connection came in on a unix socket (a worker's private listener, :mod:`proxy.ingress.cluster`)."""
        self.received = 0
        """Bytes this connection delivered so far."""
        self.head_end = -1
        """Offset (in ``received``) where the current request's head ended; -1: not known."""
        self.request_line = b""
        """The current request's first line, as received."""
        self.arrived = 0.0
        """``time.perf_counter()`` when the kernel received the current request's bytes (as
        :func:`proxy.kernel.received_ago` tells when they are first read): where the sidecar's own time
        for it starts (:mod:`proxy.ingress.reception`). Time the bytes spent in the kernel
        waiting for the loop (a busy loop, a connection in the accept queue) is the sidecar's."""
        self._sock: Any = None
        self._head: bytearray | None = None
        self._head_start = 0
        self._last_payload: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        full = guard.open >= guard.max_connections and not self.adopted
        if full and not guard.make_room(contracts.handler_loop(self).time()):
            self._refused = True
            LISTENER_CLOSED.labels(ListenerClose.MAX_CONNECTIONS).inc()
            assert isinstance(transport, asyncio.Transport)
            transport.write(_REFUSAL)
            transport.close()
            return
        guard.open += 1
        guard.connections[self] = None
        LISTENER_CONNECTIONS.inc()
        # Once per connection (a syscall under uvloop), not per request.
        self.private = isinstance(transport.get_extra_info("sockname"), str | bytes)
        if not self.private:
            self._sock = tcp_socket(transport)
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._guard.open -= 1
        self._guard.connections.pop(self, None)
        LISTENER_CONNECTIONS.dec()
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        # The first byte of a later request on a kept-alive connection starts its deadline.
        starts = False
        if data:
            self._guard.touch(self)
            starts = self._header_timer is None and self._between_requests()
            # Bytes after the last request's body are a new request's (on Python 3.11 the handler
            # task starts a loop turn after its message is dequeued: no handler state says it).
            last = self._last_payload
            self._account(data, last is None or last.is_eof())
        before = contracts.handler_request_count(self)
        super().data_received(data)
        queued = contracts.handler_queued(self)
        if queued:
            self._last_payload = contracts.handler_last_payload(self)
        # Complete headers make a message (queued for the handler loop, which counts requests
        # later): the deadline is met. A timer left armed would fire on the idle moment after
        # this request and close the connection just as the client reuses it.
        if queued or contracts.handler_request_count(self) != before or contracts.handler_upgraded(self):
            self._disarm()
        elif starts:
            # Armed only now, at the same loop time: a request whose head came whole in its first
            # read (the usual case) costs no timer (one created and cancelled per request).
            self._arm()

    def _account(self, data: bytes, idle: bool) -> None:
        """Count ``data`` and find the end of the head of the request it starts or continues."""
        start = self.received
        self.received += len(data)
        head = self._head
        if head is None:
            if not idle:
                return  # a body (or a pipelined request: ``holds_only`` then says no)
            self._head_start, self.head_end, self.request_line = start, -1, b""
            self.arrived = time.perf_counter() - received_ago(self._sock)
            end = data.find(b"\r\n\r\n")  # the first bytes of a request: usually its whole head
            if end < 0:
                self._head = bytearray(data[:_HEAD_SCAN])
                return
            head_bytes: bytes | bytearray = data
        else:
            seen = len(head)
            head += data[: _HEAD_SCAN - seen]
            end = head.find(b"\r\n\r\n", max(seen - 3, 0))
            if end < 0:
                if len(head) >= _HEAD_SCAN:
                    self._head = None  # not tracked: head_end stays -1
                return
            head_bytes, self._head = head, None
        self.head_end = self._head_start + end + 4
        self.request_line = bytes(head_bytes[: head_bytes.find(b"\r\n")])

    def holds_only(self, content_length: int) -> bool:
        """Whether everything this connection delivered is the current request (a tracked head
        plus ``content_length`` bytes of body) and aiohttp holds nothing of a next one."""
        return (
            self.head_end >= 0
            and self.received == self.head_end + content_length
            and contracts.handler_holds_nothing_more(self)
        )

    def reapable_idle(self) -> bool:
        """An idle keep-alive connection: no request in progress, none begun."""
        return (
            self._header_timer is None
            and self._head is None
            and self._between_requests()
            and not contracts.handler_upgraded(self)
        )

    def stalled_since(self, now: float) -> float:
        """Seconds this connection has been waiting for a request's complete headers (0: not)."""
        if self._header_timer is None or not self._between_requests():
            return 0.0
        return now - self._armed_at

    def _between_requests(self) -> bool:
        return not contracts.handler_in_progress(self) and not contracts.handler_queued(self)

    def _arm(self) -> None:
        if self._header_timer is None and self._guard.header_timeout > 0:
            loop = contracts.handler_loop(self)
            self._armed_at = loop.time()
            self._header_timer = loop.call_later(self._guard.header_timeout, self._header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._between_requests():
            LISTENER_CLOSED.labels(ListenerClose.HEADER_TIMEOUT).inc()
            self.force_close()


def protocol_factory(runner: web.BaseRunner, guard: Guard, *, adopted: bool = False) -> Callable[[], GuardedHandler]:
    """The protocol factory of the listener sites of ``runner`` (``adopted``: for connections
    handed over by another worker, :mod:`proxy.ingress.handoff`)."""
    server = runner.server
    assert server is not None, "runner.setup() not called"

    def make() -> GuardedHandler:
        return GuardedHandler(guard, server, adopted=adopted, **contracts.handler_arguments(server))

    return make


_factory = protocol_factory


class HardenedTCPSite(web.BaseSite):
    """A TCP site whose connections go through :class:`Guard` (optionally ``SO_REUSEPORT``)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: Guard,
        *,
        reuse_port: bool = False,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, backlog=1024)
        self.host, self.port, self.reuse_port, self.tls = host, port, reuse_port, tls
        self.guard = guard
        self._drain: AcceptDrain | None = None

    @property
    def name(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        factory = _factory(contracts.site_runner(self), self.guard)
        server = await loop.create_server(
            factory,
            self.host,
            self.port,
            backlog=contracts.site_backlog(self),
            reuse_port=self.reuse_port or None,
            ssl=self.tls,
        )
        contracts.site_listening(self, server)
        if server.sockets:
            self.port = server.sockets[0].getsockname()[1]
            # The loop accepts one connection per turn; a burst waits in the kernel otherwise.
            self._drain = AcceptDrain(server.sockets[0], factory, self.tls)

    async def stop(self) -> None:
        if self._drain is not None:
            self._drain.close()
        await super().stop()


class HardenedUnixSite(web.BaseSite):
    """A unix-socket site (a filesystem path, never an abstract name) through :class:`Guard`."""

    def __init__(self, runner: web.BaseRunner, path: str, guard: Guard) -> None:
        super().__init__(runner, backlog=1024)
        self.path = path
        self.guard = guard
        self._drain: AcceptDrain | None = None

    @property
    def name(self) -> str:
        return f"http://unix:{self.path}:"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        factory = _factory(contracts.site_runner(self), self.guard)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # left by this worker's previous life (the directory is ours alone)
        server = await loop.create_unix_server(factory, self.path, backlog=contracts.site_backlog(self))
        contracts.site_listening(self, server)
        if server.sockets:
            # Other workers' forwards and handoffs arrive in bursts too: the whole queue each turn.
            self._drain = AcceptDrain(server.sockets[0], factory)

    async def stop(self) -> None:
        if self._drain is not None:
            self._drain.close()
        await super().stop()
