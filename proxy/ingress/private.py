"""Private sockets nobody else can reach.

The workers of one machine talk over unix sockets (API forwards, handoffs, the supervisor's
probes and scrapes). They are filesystem sockets in a runtime directory of mode 0700 that the
supervisor creates (never abstract names, which every process of the network namespace can
see, connect to and squat), so a process of another user can neither bind nor connect to one.

Every *client* of a private socket also checks who listens before it sends a descriptor or a
byte (``SO_PEERCRED``): the same uid, and a process this one knows (itself, its supervisor's
workers). A check that cannot be made (no ``SO_PEERCRED`` outside Linux) leaves the
directory's mode as the guard.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PeerRefused", "Trust", "check_peer", "peer_credentials", "runtime_dir"]

_CREDS = struct.Struct("3i")


class PeerRefused(OSError):
    """The process listening on a private socket is not one of ours."""


def runtime_dir() -> str:
    """A fresh directory of mode 0700 for this supervisor's private sockets
    (under ``$XDG_RUNTIME_DIR`` when it is set, else the system's temporary directory)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or None
    if base is not None and not os.path.isdir(base):
        base = None
    folder = tempfile.mkdtemp(prefix="upshift-", dir=base)  # created 0700, owned by this uid
    info = os.lstat(folder)
    if stat.S_IMODE(info.st_mode) != 0o700 or info.st_uid != os.getuid():  # pragma: no cover - defensive
        raise PermissionError(f"runtime directory {folder} is not private")
    return folder


def peer_credentials(sock: Any) -> tuple[int, int] | None:
    """``(pid, uid)`` of the process on the other end of a connected unix socket
    (``None`` where the platform cannot say)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    # A duplicate: uvloop hands out a pseudo-socket; its descriptor is the real one.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(sock.fileno())) as dup:
        pid, uid, _ = _CREDS.unpack(dup.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
    return pid, uid


def _parent(pid: int) -> int:
    """The parent pid of ``pid`` (Linux ``/proc``), -1 if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read()
    except OSError:
        return -1
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after the last ")".
    fields = text[text.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else -1


@dataclass(frozen=True, slots=True)
class Trust:
    """Which processes may be on the other end of this process's private sockets.

    Args:
        supervisor: Pid of the supervisor whose workers are trusted (its children), 0: none.
        pids: Further pids trusted outright (a supervisor's own workers, by pid).
    """

    supervisor: int = 0
    pids: Callable[[], frozenset[int]] | None = None

    def allows(self, pid: int, uid: int) -> bool:
        if uid != os.getuid():
            return False
        if pid == os.getpid() or (self.supervisor and pid == self.supervisor):
            return True
        if self.pids is not None and pid in self.pids():
            return True
        return bool(self.supervisor) and _parent(pid) == self.supervisor


def check_peer(sock: Any, trust: Trust) -> None:
    """Raise :class:`PeerRefused` unless the process on the other end of ``sock`` is trusted."""
    creds = peer_credentials(sock)
    if creds is None:
        return
    pid, uid = creds
    if not trust.allows(pid, uid):
        raise PeerRefused(f"private socket held by pid {pid} uid {uid}, not one of ours")
