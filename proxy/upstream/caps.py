"""The learned socket caps, shared by the workers of one machine.

A worker whose upgrade was refused with 429 writes what its planner learned
(:class:`~proxy.core.socketcaps.SocketCap`: the cap, ``retry-after`` + backoff, the next probe) to
one small JSON file; every worker merges the file into its planner on its housekeeping pass
(the stricter value wins), so the workers of a machine do not each hammer the cap in turn.

The file lives in a directory only this user may enter (``pool.cap_state_dir``; default
``$XDG_RUNTIME_DIR/upshift``, else ``/tmp/upshift-<uid>``): created 0700, and refused if it is
someone else's or open to others (a shared ``/tmp`` is a place an attacker can pre-create).
Without a usable directory (a read-only root filesystem without a writable ``/tmp``) the caps
are not shared, which one log line says; the process starts and learns its caps alone.
Identities appear only as their digests. Writes are atomic (a temporary file renamed over the
old one, under ``flock``). Times are ``CLOCK_MONOTONIC``, which all processes of a machine share.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
from pathlib import Path

import orjson

from proxy.core.planner import Planner
from proxy.core.socketcaps import SocketCap

__all__ = ["CapFile", "default_dir"]

log = logging.getLogger(__name__)

_NAME = "socket-caps.json"


def default_dir() -> Path:
    """``$XDG_RUNTIME_DIR/upshift``, else ``/tmp/upshift-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "upshift"
    return Path(tempfile.gettempdir()) / f"upshift-{os.getuid()}"


def _private_dir(path: Path) -> bool:
    """Create ``path`` 0700 if missing; True if it is ours and closed to others."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=False)
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        log.warning("socket caps are not shared: %s is not a private directory of this user", path)
        return False
    return True


class CapFile:
    """Reads and writes the shared caps of one machine.

    Args:
        directory: ``pool.cap_state_dir``; empty: :func:`default_dir`; ``off``: not shared.
    """

    def __init__(self, directory: str) -> None:
        self.path: Path | None = None
        self._mtime = 0
        if directory == "off":
            return
        try:
            # A read-only root filesystem may leave no writable temporary directory at all
            # (``gettempdir`` then raises): the caps are then this process's own.
            base = Path(directory) if directory else default_dir()
            ok = _private_dir(base)
        except OSError as exc:
            log.warning("socket caps are not shared: %s", exc)
            return
        if ok:
            self.path = base / _NAME

    def _read(self) -> dict[str, SocketCap]:
        assert self.path is not None
        try:
            data = orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}
        caps: dict[str, SocketCap] = {}
        if not isinstance(data, dict):
            return caps
        for digest, row in data.items():
            if not isinstance(row, dict):
                continue
            try:
                limit = row.get("limit")
                caps[str(digest)] = SocketCap(
                    limit=int(limit) if limit is not None else None,
                    until=float(row.get("until", 0.0)),
                    refusals=int(row.get("refusals", 0)),
                    probe_at=float(row.get("probe_at", 0.0)),
                )
            except (TypeError, ValueError):
                continue
        return caps

    def merge_into(self, planner: Planner, now: float) -> None:
        """Merge the file into ``planner`` if it changed since the last look (entries whose
        probe time has passed are stale: a probe would be allowed anyway)."""
        if self.path is None:
            return
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        for digest, cap in self._read().items():
            if cap.probe_at > now:
                planner.upgrades.merge(digest, cap)

    def publish(self, planner: Planner, digest: str, now: float) -> None:
        """Write what ``planner`` knows of ``digest``'s cap (merged with the file's)."""
        if self.path is None:
            return
        mine = planner.caps.get(digest)
        if mine is None:
            return
        try:
            with open(self.path.with_suffix(".lock"), "a+b") as lock:
                os.fchmod(lock.fileno(), 0o600)
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
                caps = {d: c for d, c in self._read().items() if c.probe_at > now}  # stale ones go
                theirs = caps.get(digest)
                if theirs is not None:
                    planner.upgrades.merge(digest, theirs)
                caps[digest] = planner.caps[digest]
                rows = {
                    d: {"limit": c.limit, "until": c.until, "refusals": c.refusals, "probe_at": c.probe_at}
                    for d, c in caps.items()
                }
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".caps-")
                with os.fdopen(fd, "wb") as out:
                    out.write(orjson.dumps(rows))
                os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not share the learned socket cap: %s", exc)
