"""What the memory budget is sized by: what each holder costs (a request per body byte, a
connection, a head), the budget's default and its share of a container, and the limits derived
from it (:func:`derive`). Sans-I/O: the shell measures (:mod:`proxy.intake.sysmem`), this computes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "AMPLIFICATION",
    "BASELINE_SLACK",
    "CGROUP_FRACTION",
    "DEFAULT_MEMORY_BYTES",
    "Derived",
    "HEADER_ROOM",
    "HEAD_COST",
    "KEYLESS_SHARE",
    "Kind",
    "MIN_RESERVATION",
    "STEP",
    "derive",
]

AMPLIFICATION = 4
"""Bytes reserved per body byte while a request is received, parsed and sent: the body, the
parsed items (about 1x for tool outputs), the frame, and the send buffers of the WebSocket
library (masked copy). Measured peak per in-flight byte, see bench/memory.py."""

MIN_RESERVATION = 128 * 1024
"""Added to every request's reservation: its connection's buffers and objects, held even
while it waits (bench: 200 connections at once cost ~25 MiB beyond their bodies)."""

STEP = 1024 * 1024
"""Body bytes a reading ticket may hold ahead of what arrived: the bounded step it
pays for before the bytes are read, and the unit it grows by."""

HEADER_ROOM = 64 * 1024
"""Left free by the derived body limit for the request's headers, which count too."""

KEYLESS_SHARE = 8
"""Requests without a credential share ``1 / KEYLESS_SHARE`` of the capacity: what they hold and
what their bodies still promise together (one keyless body alone may take more: an app behind an
injected key that sends no placeholder still gets its large bodies through)."""

HEAD_COST = 24 * 1024
"""Bytes per conversation head, its upstream socket included (bench: ~23 KB)."""

DEFAULT_MEMORY_BYTES = 1024 * 1024 * 1024
"""The budget when no container limit is found (1 GiB)."""

CGROUP_FRACTION = 0.85
"""Share of the container's memory limit the sidecar budgets for itself (the rest: the
kernel's socket buffers, allocator slack, the probes)."""

BASELINE_SLACK = 0.15
"""Share of the budget left unassigned on top of the idle process: the read buffers of connections
that arrive while the budget is taken (~0.15 MiB each, in memory before any handler runs) and
allocator fragmentation (bench: 200 connections at once)."""


class Kind(enum.StrEnum):
    """What the budget's bytes are held by (metric label values)."""

    IN_FLIGHT = "in_flight"
    KEPT = "kept_bodies"
    HEADS = "heads"
    BASELINE = "baseline"


@dataclass(frozen=True, slots=True)
class Derived:
    """Limits derived from the budget (when not set explicitly)."""

    memory_bytes: int
    capacity: int
    """What requests, kept bodies and heads share: the budget minus the idle process."""
    max_body_bytes: int
    """The largest body that fits an empty budget (at most 64 MiB)."""
    hot_prefix_bytes: int
    """Half the capacity: kept bodies give way to requests anyway."""


def derive(memory_bytes: int, baseline: int) -> Derived:
    """The capacity and the default size limits for a budget of ``memory_bytes`` (RSS) when the
    idle process takes ``baseline`` bytes."""
    slack = int(memory_bytes * BASELINE_SLACK)
    # A process already larger than its budget (a test runner hosting sidecars) still gets a
    # quarter of it rather than nothing.
    capacity = max(memory_bytes - baseline - slack, memory_bytes // 4)
    return Derived(
        memory_bytes=memory_bytes,
        capacity=capacity,
        max_body_bytes=min(64 * 1024 * 1024, (capacity - MIN_RESERVATION - HEADER_ROOM) // AMPLIFICATION),
        hot_prefix_bytes=capacity // 2,
    )
