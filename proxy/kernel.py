"""When the kernel received a connection's latest bytes: where a clock of the sidecar's own
time starts (a request's bytes) or the upstream's time ends (a response's last bytes).

Bytes can wait in the kernel for the event loop (a busy loop, a connection still in the accept
queue); that wait is the sidecar's, but a clock read when the loop gets to the bytes does not
see it. Linux says how long ago a TCP socket received its latest data segment
(``tcpi_last_data_recv`` of ``TCP_INFO``, one ``getsockopt``, about a microsecond). Elsewhere,
and for unix sockets, the age is 0: the clock starts at the read.

New connections wait in the kernel too: libuv (under uvloop) accepts one connection per turn
of the event loop (libuv pull request 3696), so under load, with turns of tens of
milliseconds, a burst of a few hundred new connections waited in the listener's accept queue
for seconds (300 conversations arriving together: the last were accepted 4 s after their
bytes arrived, while the loop's lag stayed under 0.15 s). :class:`AcceptDrain` empties the
queue at each turn instead.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Any

__all__ = ["AcceptDrain", "received_ago", "tcp_socket"]

log = logging.getLogger(__name__)

_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None)
_TCP_INFO_BYTES = 104
_LAST_DATA_RECV = struct.Struct("=I")
"""``tcpi_last_data_recv`` (at byte 52 of ``struct tcp_info``): milliseconds since the kernel
received the connection's latest data segment."""
_OFFSET = 52
KERNEL_TICK_MS = 4
"""The kernel counts that age in scheduler ticks (4 ms at the common ``HZ=250``): one reading
is within a tick of the truth either way, and right on average (the two ticks' phases are
independent of the bytes' arrival), so a clock summed over many requests is not skewed."""


def tcp_socket(transport: Any) -> Any:
    """The TCP socket under ``transport`` for :func:`received_ago`, or ``None`` (not TCP, not
    Linux, no socket)."""
    if _TCP_INFO is None or transport is None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    return sock


def received_ago(sock: Any) -> float:
    """Seconds since the kernel received the latest data on ``sock`` (from :func:`tcp_socket`;
    within :data:`KERNEL_TICK_MS`), 0 when it cannot tell. The latest segment's age: no more
    than the age of any earlier byte."""
    if sock is None:
        return 0.0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, ValueError):
        return 0.0
    if len(info) < _OFFSET + 4:
        return 0.0
    ms: int = _LAST_DATA_RECV.unpack_from(info, _OFFSET)[0]
    return ms / 1000.0


ACCEPT_BATCH = 512
"""Most connections :class:`AcceptDrain` accepts in one turn of the loop (then the next turn)."""


class AcceptDrain:
    """Accepts every connection waiting on a listening socket at each turn of the loop, beside
    the loop's own server (which accepts one per turn): the same protocol factory, so the
    connections are alike whichever accepted them; the kernel gives each to one of the two.

    Args:
        listener: The server's listening socket (``server.sockets[0]``; a duplicate of its
            descriptor is watched: closing the drain never closes the server's).
        factory: The server's protocol factory.
        tls: The server's TLS context, if any.
    """

    def __init__(
        self, listener: Any, factory: Callable[[], asyncio.Protocol], tls: ssl.SSLContext | None = None
    ) -> None:
        self._loop = asyncio.get_running_loop()
        # A duplicate descriptor of the same socket (the loop's server may hand out a stand-in
        # object, uvloop's PseudoSocket, that cannot be accepted on itself).
        self._sock = socket.fromfd(listener.fileno(), listener.family, listener.type)
        self._sock.setblocking(False)
        self._tcp = self._sock.family in (socket.AF_INET, socket.AF_INET6)
        self._factory = factory
        self._tls = tls
        self._tasks: set[asyncio.Task[None]] = set()
        self.accepted = 0
        """Connections this drain accepted (the server's own accepts are not counted)."""
        self._loop.add_reader(self._sock.fileno(), self._ready)

    def _ready(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the server's own accept reports it
                log.debug("accepting a waiting connection failed: %s", exc)
                return
            self.accepted += 1
            conn.setblocking(False)
            if self._tcp:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._adopt(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn, ssl=self._tls)
        except Exception as exc:  # noqa: BLE001 - the client went away meanwhile, a failed TLS handshake
            log.debug("a waiting connection could not be taken: %s", exc)
            conn.close()

    def close(self) -> None:
        """Stop accepting (before the server closes: the duplicate would keep the port open)."""
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
