"""Typed aiohttp application and request keys shared by the route modules."""

from __future__ import annotations

import asyncio
from typing import Final

from aiohttp import web

from .faults import FaultQueue
from .state import EmulatorState

__all__ = ["FAULTS", "OWNER", "REGISTRY", "STARTED", "STATE", "Registry"]

STATE: Final = web.AppKey("emulator_state", EmulatorState)
FAULTS: Final = web.AppKey("emulator_faults", FaultQueue)


class Registry:
    """Things to clean up at shutdown."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        """Background-mode generations."""
        self.sockets: set[web.WebSocketResponse] = set()
        """Open WebSocket connections (closed with 1001 on shutdown)."""


REGISTRY: Final = web.AppKey("emulator_registry", Registry)
OWNER: Final = web.RequestKey("emulator_owner", str)
"""Request key: identity hash of the caller's ``Authorization`` header."""
STARTED: Final = web.RequestKey("emulator_started", float)
"""Request key: ``time.monotonic()`` when the request arrived."""
