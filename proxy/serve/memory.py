"""The memory gate: the async shell around :class:`proxy.core.budget.Budget`.

Every ``POST /v1/responses`` holds a :class:`Lease` (``async with gate.lease(length)``) from
before its body is read until its answer is written. Entering the lease reserves
``Content-Length`` × :data:`~proxy.core.budget.AMPLIFICATION`; when that does not fit, the
body is simply not read yet (the app's TCP connection backs up) and the request waits in one
FIFO queue, woken when memory frees, for at most ``limits.memory_wait_seconds`` (then 429 with
``retry-after``). A request that cannot fit even into an empty budget is answered 503 with
``retry-after`` at once. Kept bodies (the heads' byte-comparison copies) give way first.
Chunked bodies reserve as they are read. Once the frame is handed to the upstream socket the
lease shrinks to the body itself (needed for a replay and for the next turn's prefix check).

When the last lease ends, the gate asks glibc to hand freed memory back to the OS
(``malloc_trim``), so RSS after a burst falls back towards idle. At startup it also pins glibc's
mmap threshold, so large buffers (bodies, frames) are mapped and unmapped on their own instead
of fragmenting the heap.

The budget itself (``limits.memory_bytes``) defaults to a share of the container's cgroup
memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), else 1 GiB;
:func:`effective_settings` fills in the limits derived from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
from collections.abc import Hashable, Sized
from pathlib import Path
from types import TracebackType
from typing import Any

from proxy.config import Settings
from proxy.core.budget import (
    AMPLIFICATION,
    CGROUP_FRACTION,
    DEFAULT_MEMORY_BYTES,
    HEAD_COST,
    MIN_RESERVATION,
    Budget,
    Derived,
    Effects,
    Kind,
    Ticket,
    Verdict,
    derive,
)
from proxy.core.conversation import PrefixCache
from proxy.core.reasons import ErrorCode, MemoryRefusal
from proxy.errors import ProxyError
from proxy.ops.metrics import MEMORY_BUDGET, MEMORY_BYTES, MEMORY_REFUSALS, MEMORY_WAITING, MEMORY_WAITS

__all__ = [
    "BodyBuffer",
    "Lease",
    "MemoryBusy",
    "MemoryGate",
    "MemoryRefused",
    "MemoryTooLarge",
    "cgroup_memory_limit",
    "effective_settings",
    "process_rss",
    "tune_allocator",
]

log = logging.getLogger(__name__)

_UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a huge number (9223372036854771712)."""
_GROW_STEP = 1024 * 1024
"""A chunked body's reservation grows by at least this much at a time."""
_BUFFERED = 256 * 1024
"""What a waiting connection's read buffers hold of its body before reading pauses (the API
listener's aiohttp read buffer is 16 KiB, proxy/server.py; measured: a connection waiting with
a 4 MB body adds ~124 KiB of RSS, 756 KiB with aiohttp's default 64 KiB buffer)."""
_TRIM_DELAY = 0.25
"""Seconds the gate must stay idle before memory is handed back to the OS."""


class MemoryRefused(ProxyError):
    """A request the memory budget cannot take (nothing was read or forwarded)."""

    retryable = True
    retry_after = 1

    def headers(self, request_id: str) -> dict[str, str]:
        """The answer's headers: ``retry-after`` (every OpenAI SDK honours it)."""
        return {"x-request-id": request_id, "retry-after": str(self.retry_after), "x-should-retry": "true"}


class MemoryBusy(MemoryRefused):
    """The request waited ``limits.memory_wait_seconds`` for memory."""

    status = 429
    code = ErrorCode.MEMORY_BUSY
    type = "rate_limit_error"


class MemoryTooLarge(MemoryRefused):
    """The request would not fit even into an empty budget."""

    status = 503
    code = ErrorCode.MEMORY_TOO_LARGE
    retry_after = 5


# -- the budget's size ---------------------------------------------------------------------------


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


# -- one buffer per body ----------------------------------------------------------------------------


def _bytes_api() -> tuple[Any, Any] | None:
    with contextlib.suppress(AttributeError, OSError):
        api = ctypes.pythonapi
        new, address = api.PyBytes_FromStringAndSize, api.PyBytes_AsString
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_ssize_t]
        address.restype, address.argtypes = ctypes.c_void_p, [ctypes.py_object]
        return new, address
    return None


_BYTES_API = _bytes_api()
_DIRECT_ABOVE = 64 * 1024
"""Bodies at least this large are read straight into their final ``bytes`` object."""


class BodyBuffer:
    """A body of known length read into one buffer: the final ``bytes`` object itself.

    Uses the C API's documented way to build a bytes object piecewise
    (``PyBytes_FromStringAndSize(NULL, n)``, then fill ``PyBytes_AsString``) while no one else
    holds it, so the body is never in memory twice (chunks + joined, or bytearray + bytes).
    Elsewhere (no ``ctypes.pythonapi``, small bodies): a bytearray, copied once at the end.
    """

    def __init__(self, length: int) -> None:
        self.length = length
        self.filled = 0
        self._bytes: bytes | None = None
        self._address = 0
        self._array: bytearray | None = None
        if _BYTES_API is not None and length >= _DIRECT_ABOVE:
            new, address = _BYTES_API
            self._bytes = new(None, length)
            self._address = address(self._bytes)
        else:
            self._array = bytearray(length)

    @property
    def missing(self) -> int:
        return self.length - self.filled

    @property
    def full(self) -> bool:
        return self.filled >= self.length

    def write(self, chunk: bytes) -> None:
        """Append ``chunk`` (at most :attr:`missing` bytes)."""
        size = len(chunk)
        if size > self.missing:
            raise ValueError("more bytes than the declared length")
        if self._array is not None:
            self._array[self.filled : self.filled + size] = chunk
        else:
            ctypes.memmove(self._address + self.filled, chunk, size)
        self.filled += size

    def value(self) -> bytes:
        """The body (only once it is full)."""
        if not self.full:
            raise ValueError("the body is not complete")
        if self._bytes is not None:
            body, self._bytes = self._bytes, None
            return body
        assert self._array is not None
        body = bytes(self._array)
        self._array = None
        return body


# -- the gate --------------------------------------------------------------------------------------


class MemoryGate:
    """Admits requests into the memory budget; wakes waiters FIFO as memory frees.

    Args:
        derived: The budget (see :func:`effective_settings`).
        prefixes: The prefix cache whose kept bodies draw from the budget (its keeper is set here).
        heads: What counts the heads (``len``), each costing ``HEAD_COST``.
        wait_seconds: Longest wait for memory before a 429.
    """

    def __init__(
        self,
        derived: Derived,
        prefixes: PrefixCache | None,
        *,
        heads: Sized | None = None,
        wait_seconds: float,
        max_body_bytes: int = 0,
    ) -> None:
        self.derived = derived
        self.max_body_bytes = max_body_bytes
        """Bodies declared larger are not reserved for: the reader refuses them (413) unread."""
        self.budget = Budget(derived.capacity)
        self.prefixes = prefixes
        self.heads = heads
        self.wait_seconds = wait_seconds
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self._trim: asyncio.TimerHandle | None = None
        if prefixes is not None:
            prefixes.keeper = self
        MEMORY_BUDGET.set(derived.memory_bytes)
        MEMORY_BYTES.labels(Kind.BASELINE).set(derived.memory_bytes - derived.capacity)
        self._publish()

    def __repr__(self) -> str:
        return f"<MemoryGate {self.budget!r}>"

    def lease(self, length: int | None) -> Lease:
        """A lease for one request whose body declares ``length`` bytes (``None``: chunked)."""
        if length is not None and self.max_body_bytes and length > self.max_body_bytes:
            length = 0  # a 413, answered before anything is read
        return Lease(self, length)

    # -- PrefixCache keeper ----------------------------------------------------------------

    def keep(self, anchor: Hashable, size: int) -> bool:
        """May a head keep its body (``size`` bytes)? Only into free memory."""
        return self.budget.keep(anchor, size)

    def cooled(self, anchor: Hashable) -> None:
        """A head let its body go."""
        self._apply(self.budget.unkeep(anchor))

    # -- internals -------------------------------------------------------------------------

    async def _acquire(self, want: int, buffered: int = 0) -> Ticket:
        if self.heads is not None:
            self._apply(self.budget.set_heads(len(self.heads) * HEAD_COST))
        ticket, out = self.budget.ask(want, buffered)
        self._apply(out)
        if ticket.verdict is Verdict.TOO_LARGE:
            MEMORY_REFUSALS.labels(MemoryRefusal.TOO_LARGE).inc()
            raise MemoryTooLarge(
                f"The request needs about {want} bytes of memory, more than the sidecar's memory budget "
                f"can ever hold ({self.budget.capacity - self.budget.heads} bytes free when idle)."
            )
        if ticket.verdict is Verdict.GRANTED:
            return ticket
        MEMORY_WAITS.inc()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = future
        try:
            await asyncio.wait_for(future, self.wait_seconds)
        except TimeoutError:
            self._apply(self.budget.release(ticket))  # granted in the same instant: given back
            MEMORY_REFUSALS.labels(MemoryRefusal.WAIT_TIMEOUT).inc()
            raise MemoryBusy(
                f"The sidecar's memory budget stayed taken for {self.wait_seconds:g} s; retry the request."
            ) from None
        except BaseException:
            self._apply(self.budget.release(ticket))  # the app went away while waiting
            raise
        finally:
            self._waiters.pop(ticket, None)
        if not _granted(ticket):  # woken to be refused: the heads grew meanwhile
            MEMORY_REFUSALS.labels(MemoryRefusal.TOO_LARGE).inc()
            raise MemoryTooLarge("The request no longer fits the sidecar's memory budget.")
        return ticket

    def _apply(self, out: Effects) -> None:
        """Wake granted waiters and drop the kept bodies the budget gave away."""
        if out.evict and self.prefixes is not None:
            for anchor in out.evict:
                self.prefixes.cool(anchor)
        for ticket in out.granted:
            future = self._waiters.get(ticket)
            if future is not None and not future.done():
                future.set_result(None)
        if self.budget.idle:
            self._schedule_trim()

    def _schedule_trim(self) -> None:
        if self._trim is not None:
            return
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            self._trim = loop.call_later(_TRIM_DELAY, self._trim_if_idle)

    def _trim_if_idle(self) -> None:
        self._trim = None
        if self.budget.idle:
            trim()

    def _publish(self) -> None:
        """Point the budget gauges at this gate: they are read at scrape time, so a request
        costs no gauge update (the newest gate of a process is the one its metrics show)."""
        b = self.budget
        MEMORY_BYTES.labels(Kind.IN_FLIGHT).set_function(lambda: b.in_flight)
        MEMORY_BYTES.labels(Kind.KEPT).set_function(lambda: b.kept)
        MEMORY_BYTES.labels(Kind.HEADS).set_function(lambda: b.heads)
        MEMORY_WAITING.set_function(lambda: b.waiting)


def _granted(ticket: Ticket) -> bool:
    return ticket.verdict is Verdict.GRANTED


class Lease:
    """One request's memory, held from before its body is read until its answer is written.

    ``async with gate.lease(length) as lease`` waits for memory (or raises
    :class:`MemoryRefused`); leaving the block returns it on every path (completion, error,
    cancellation, the app going away).
    """

    def __init__(self, gate: MemoryGate, length: int | None) -> None:
        self.gate = gate
        self.length = length
        self.body = 0
        """Bytes of body read so far."""
        self._ticket: Ticket | None = None

    @property
    def held(self) -> int:
        """Bytes this request holds in the budget now."""
        return self._ticket.want if self._ticket is not None else 0

    async def __aenter__(self) -> Lease:
        want = AMPLIFICATION * (self.length or 0) + MIN_RESERVATION
        # While it waits, the start of the body is in the server's read buffers already.
        buffered = min(self.length if self.length is not None else _BUFFERED, _BUFFERED) + MIN_RESERVATION
        self._ticket = await self.gate._acquire(want, buffered)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._ticket is not None:
            ticket, self._ticket = self._ticket, None
            self.gate._apply(self.gate.budget.release(ticket))

    async def grow(self, size: int) -> None:
        """The body read so far is ``size`` bytes (chunked): make sure its share is reserved,
        waiting for memory like a new request if it is not free now (the rest of the body stays
        unread meanwhile)."""
        self.body = size
        ticket = self._ticket
        assert ticket is not None, "grow outside the lease"
        need = AMPLIFICATION * size + MIN_RESERVATION - ticket.want
        if need <= 0:
            return
        more = max(need, _GROW_STEP)
        gate = self.gate
        ok, out = gate.budget.grow(ticket, more)
        gate._apply(out)
        if ok:
            return
        gate.budget.merge(ticket, await gate._acquire(more))

    def read(self, size: int) -> None:
        """The whole body is read (``size`` bytes)."""
        self.body = size

    def sent(self) -> None:
        """The frame went to the upstream socket: from now on the request holds its body only."""
        if self._ticket is not None:
            self.gate._apply(self.gate.budget.settle(self._ticket, self.body + MIN_RESERVATION))
