"""Emulated OpenAI Responses API (HTTP + WebSocket mode) for tests, benchmarks and demos.

Run it with ``python -m upshift_emulator --listen 127.0.0.1:9100``, or in process::

    async with Emulator() as emu:
        client = AsyncOpenAI(base_url=emu.base_url, api_key="sk-test")

Layout: ``config`` (settings), ``oracle`` (canonical context digests), ``model`` (the scripted
model), ``validation`` + ``engine`` (request → response), ``events`` + ``runner`` (event sequence,
pacing, faults), ``network`` (RTT and connection setup), ``http`` (+ ``sinks``) / ``ws`` (+ ``wslane``, ``wsturn``,
``wsreplies``, ``steering``) / ``extras`` / ``control`` (routes), ``appkeys``, ``server``
(app + :class:`Emulator` API).
See docs/emulator.md.
"""

from __future__ import annotations

from .config import (
    FAST_LATENCY,
    LATENCY_PRESETS,
    REALISTIC_LATENCY,
    ZERO_LATENCY,
    EmulatorConfig,
    LatencyModel,
    load_config_file,
)
from .errors import ApiError
from .faults import FAULT_KINDS, HOLD_ACTIONS, NOT_FOUND_SHAPES, Fault, FaultQueue, Held
from .oracle import canonical_item, context_digest, settings_digest
from .server import Emulator, ThreadedEmulator
from .state import Stats

__all__ = [
    "FAST_LATENCY",
    "FAULT_KINDS",
    "HOLD_ACTIONS",
    "LATENCY_PRESETS",
    "NOT_FOUND_SHAPES",
    "REALISTIC_LATENCY",
    "ZERO_LATENCY",
    "ApiError",
    "Emulator",
    "EmulatorConfig",
    "Fault",
    "FaultQueue",
    "Held",
    "LatencyModel",
    "Stats",
    "ThreadedEmulator",
    "canonical_item",
    "context_digest",
    "load_config_file",
    "settings_digest",
]
