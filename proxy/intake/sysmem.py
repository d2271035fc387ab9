"""The process's memory as the gate needs it: the budget's size (the container's cgroup limit, the
idle process's RSS, :func:`effective_settings`) and glibc's allocator (:func:`tune_allocator` at
startup, :func:`trim` when the gate goes idle).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from pathlib import Path
from typing import Any

from proxy.config import Settings
from proxy.core.sizing import CGROUP_FRACTION, DEFAULT_MEMORY_BYTES, Derived, derive

__all__ = ["cgroup_memory_limit", "effective_settings", "process_rss", "trim", "tune_allocator"]

_UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a huge number (9223372036854771712)."""


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max" or not text.isdigit():
        return None
    value = int(text)
    return value if 0 < value < _UNLIMITED else None


def cgroup_memory_limit(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The memory limit of this process's cgroup (the smallest along its path), if any.

    cgroup v2: ``<root>/<path>/memory.max``; v1: ``<root>/memory/<path>/memory.limit_in_bytes``.
    Inside a container the process's own cgroup is usually the mount's root; without a cgroup
    namespace it is the path named in ``/proc/self/cgroup``: both are looked at.
    """
    base = Path(root)
    v2_path, v1_path = "/", "/"
    with contextlib.suppress(OSError):
        for line in Path(self_cgroup).read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                v2_path = path or "/"
            elif "memory" in controllers.split(","):
                v1_path = path or "/"
    found: list[int] = []
    candidates = [(base, v2_path, "memory.max"), (base / "memory", v1_path, "memory.limit_in_bytes")]
    for mount, path, name in candidates:
        current = mount / path.strip("/") if path.strip("/") else mount
        while True:
            value = _read_limit(current / name)
            if value is not None:
                found.append(value)
            if current == mount or mount not in current.parents:
                break
            current = current.parent
    return min(found) if found else None


def process_rss() -> int:
    """This process's resident set size in bytes (0 if unknown)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def effective_settings(settings: Settings, *, baseline: int | None = None) -> tuple[Settings, Derived]:
    """``settings`` with ``limits.memory_bytes``, ``limits.max_body_bytes`` and
    ``matching.hot_prefix_bytes`` filled in where they were 0 (derived), and the derivation.

    Args:
        settings: As loaded.
        baseline: RSS of the idle process (default: measured now).
    """
    limits = settings.limits
    memory = limits.memory_bytes
    if memory == 0:
        cgroup = cgroup_memory_limit()
        memory = int(cgroup * CGROUP_FRACTION) if cgroup is not None else DEFAULT_MEMORY_BYTES
    # The budget is the container's: with several worker processes each gets its share.
    memory //= max(getattr(settings, "workers", 1), 1)
    idle = process_rss() if baseline is None else baseline
    derived = derive(memory, idle)
    new_limits = dataclasses.replace(
        limits,
        memory_bytes=memory,
        max_body_bytes=limits.max_body_bytes or derived.max_body_bytes,
    )
    matching = dataclasses.replace(
        settings.matching, hot_prefix_bytes=settings.matching.hot_prefix_bytes or derived.hot_prefix_bytes
    )
    return dataclasses.replace(settings, limits=new_limits, matching=matching), derived


# -- glibc -----------------------------------------------------------------------------------------

_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 256 * 1024
_libc: Any = None


def _glibc() -> Any:
    global _libc
    if _libc is None:
        _libc = False
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            _libc = libc
    return _libc or None


def tune_allocator() -> bool:
    """Pin glibc's mmap threshold (large buffers get their own mapping, returned on free,
    instead of the dynamic threshold moving them into the heap). False when not glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))


def trim() -> bool:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim(0)``)."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))
