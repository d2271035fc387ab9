"""Ports for servers that must be named before they start: replicas that list each other, a
process given ``--listen``, an address where nothing listens.

A port the kernel hands out for port 0 comes from its ephemeral range, the range it also takes
outgoing connections' local ports from. Released and bound again a moment later, it can meanwhile
have become the local end of some other connection (the bind fails: address in use), and a port
picked as "nothing listens here" may no longer refuse. These ports come from below that range
(Linux: ``/proc/sys/net/ipv4/ip_local_port_range``), where the kernel never places a connection's
local end, and each is checked free on every host it is for. Elsewhere, port 0's answer.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

__all__ = ["free_port", "free_ports"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
"""Below this, ports of services a machine may run (databases, the admin port 9090, ...)."""
_TRIES = 1_000


def _listen_range() -> range:
    """Ports below the kernel's ephemeral range (empty where it cannot be read)."""
    try:
        low = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(_LOWEST, low) if low - _LOWEST >= 1_000 else range(0)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bindable(port: int, hosts: Sequence[str]) -> bool:
    socks: list[socket.socket] = []
    try:
        for host in hosts:
            sock = socket.socket(_family(host))
            socks.append(sock)
            sock.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()


def free_ports(count: int, hosts: Sequence[str] = ("127.0.0.1",)) -> list[int]:
    """``count`` distinct ports, each free right now on every one of ``hosts``."""
    candidates = _listen_range()
    pick = random.Random()  # seeded from the OS: processes started together pick apart
    ports: list[int] = []
    for _ in range(_TRIES):
        port = pick.choice(candidates) if candidates else _ephemeral(hosts[0])
        if port not in ports and _bindable(port, hosts):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports on {list(hosts)}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port free right now on ``host``."""
    return free_ports(1, (host,))[0]


def _ephemeral(host: str) -> int:
    """The kernel's own choice on ``host``."""
    with socket.socket(_family(host)) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
