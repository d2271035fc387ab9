"""Small shared pieces of WebSocket mode: a lane, the "socket is gone" signal, the ``stream_id`` rule."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any, Final

from .state import ResponseRecord

__all__ = ["STREAM_ID", "Gone", "Lane", "admission_facts", "request_facts"]

JSON = Any
STREAM_ID: Final = re.compile(r"^[A-Za-z0-9_.-]{1,256}$")
"""protocol.md §1.4: 1-256 letters, digits, ``_``, ``-``, ``.``."""


@dataclass(slots=True)
class Lane:
    """One FIFO lane (``key`` None = the default lane) and its cached latest response."""

    key: str | None
    queue: asyncio.Queue[tuple[dict[str, JSON], int]] = field(default_factory=asyncio.Queue)
    latest: ResponseRecord | None = None
    task: asyncio.Task[None] | None = None
    busy: bool = False


class Gone(Exception):
    """The socket is closed; stop the worker."""


def admission_facts(event: dict[str, JSON]) -> dict[str, JSON]:
    """Fault ``match`` facts known when a create arrives (before its lane runs it)."""
    prev = event.get("previous_response_id")
    stream_id = event.get("stream_id")
    return {
        "previous_response_id_present": prev is not None,
        "previous_response_id": prev,
        "stream_id": stream_id if isinstance(stream_id, str) else None,
        "store": event.get("store") is not False,
        "generate": event.get("generate") is not False,
        "model": event.get("model"),
    }


def request_facts(body: dict[str, JSON], stream_id: str | None, connection_id: str) -> dict[str, JSON]:
    """Fault ``match`` facts of a create as its lane runs it."""
    return {**admission_facts({**body, "stream_id": stream_id}), "connection_id": connection_id}
