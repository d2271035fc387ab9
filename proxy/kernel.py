"""When the kernel received a connection's latest bytes: where a clock of the sidecar's own
time starts (a request's bytes) or the upstream's time ends (a response's last bytes).

Bytes can wait in the kernel for the event loop (a busy loop, a connection still in the accept
queue); that wait is the sidecar's, but a clock read when the loop gets to the bytes does not
see it. Linux says how long ago a TCP socket received its latest data segment
(``tcpi_last_data_recv`` of ``TCP_INFO``, one ``getsockopt``, about a microsecond). Elsewhere,
and for unix sockets, the age is 0: the clock starts at the read.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

__all__ = ["received_ago", "tcp_socket"]

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
