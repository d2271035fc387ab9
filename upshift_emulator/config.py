"""Emulator settings: frozen dataclasses, presets and an optional YAML/JSON config file.

Every field here is also a command-line flag (see ``__main__``); flags override the file.
The in-process API (`Emulator()`) defaults to :data:`ZERO_LATENCY` so tests stay fast.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

__all__ = [
    "DEFAULT_MODELS",
    "FAST_LATENCY",
    "LATENCY_PRESETS",
    "STREAM_ID_MODES",
    "REALISTIC_LATENCY",
    "ZERO_LATENCY",
    "EmulatorConfig",
    "LatencyModel",
    "load_config_file",
]

MIB: Final = 1024 * 1024

STREAM_ID_MODES: Final = ("lanes", "reject", "close")

DEFAULT_MODELS: Final = (
    "gpt-6.1-sol",
    "gpt-6.1-terra",
    "gpt-6-sol",
    "gpt-5.6-sol",
    "gpt-5.6-terra",
    "gpt-5.5",
    "gpt-5.4",
    "gpt-5.2",
    "gpt-4.1",
    "gpt-4o-mini",
    "text-embedding-3-small",
)


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """How long a response takes. Every figure is 0 (instant) unless set.

    A turn is paced as: ``overhead_ms`` before ``response.created``; then the context that must be
    rebuilt (``rebuild_ms_per_kb`` per KiB of canonical context bytes that did not come from the
    connection cache) plus ``ttft_ms`` before the first output event; then output at
    ``tokens_per_second`` (0 = instant).
    """

    overhead_ms: float = 0.0
    """Fixed cost per request (gateway, auth, validation, scheduling)."""
    rebuild_ms_per_kb: float = 0.0
    """Cost per KiB of context that is not in the connection cache (the whole context over HTTP)."""
    ttft_ms: float = 0.0
    """Time to first token once the context is ready."""
    tokens_per_second: float = 0.0
    """Output speed; 0 means instant."""
    rtt_ms: float = 0.0
    """Network round trip between client and emulator: every client message (HTTP request, WS frame)
    is handled ``rtt_ms/2`` after it arrived and every server message (HTTP response start, WS frame)
    reaches the wire ``rtt_ms/2`` after it was produced (pipelined: a stream shifts, it does not stretch)."""
    connect_ms: float = 0.0
    """TCP + TLS handshake cost of a *new* connection (e.g. 2 x RTT for TCP + TLS 1.3), paid once before
    the first request on it (every WebSocket upgrade on a fresh connection; not kept-alive HTTP requests)."""

    def rebuild_seconds(self, nbytes: int) -> float:
        """Seconds spent rebuilding ``nbytes`` of uncached context."""
        return self.rebuild_ms_per_kb * nbytes / 1024.0 / 1000.0

    def token_seconds(self, tokens: int) -> float:
        """Seconds needed to emit ``tokens`` output tokens."""
        if self.tokens_per_second <= 0:
            return 0.0
        return tokens / self.tokens_per_second


ZERO_LATENCY: Final = LatencyModel()
"""Default for tests: nothing sleeps."""

REALISTIC_LATENCY: Final = LatencyModel(overhead_ms=50.0, rebuild_ms_per_kb=8.0, ttft_ms=450.0, tokens_per_second=65.0)
"""GPT-5-class model (see docs/emulator.md for where each figure comes from)."""

FAST_LATENCY: Final = LatencyModel(overhead_ms=50.0, rebuild_ms_per_kb=8.0, ttft_ms=150.0, tokens_per_second=1000.0)
"""Fast coding model (>1,000 tokens/s): history re-processing dominates even more."""

LATENCY_PRESETS: Final = {"zero": ZERO_LATENCY, "realistic": REALISTIC_LATENCY, "fast": FAST_LATENCY}


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """All emulator settings. Defaults follow protocol.md (§1.2–1.9, §4.2)."""

    latency: LatencyModel = ZERO_LATENCY
    ws_max_age_s: float = 3600.0
    """Connection age after which the next ``response.create`` gets ``websocket_connection_limit_reached``."""
    ws_close_on_age_limit: bool = True
    """Close the socket after the age-limit error (protocol.md §4.2.7)."""
    ws_age_limit_close_code: int = 1000
    ws_idle_timeout_s: float = 0.0
    """Close an idle socket (nothing received, nothing running) after this many seconds; 0 = never."""
    ws_idle_close_code: int = 1001
    ws_max_message_bytes: int = 32 * MIB
    """Largest accepted client frame; bigger ones close the socket with 1009."""
    ws_max_in_flight: int = 16
    ws_max_named_streams: int = 32
    ws_compress: bool = True
    """Accept permessage-deflate when the client offers it."""
    ws_max_connections_per_key: int = 0
    """Open WebSocket connections allowed per key (``Authorization`` identity); the next upgrade gets
    HTTP 429 with ``retry-after``. 0 = unlimited."""
    ws_connection_retry_after_s: float = 1.0
    """``retry-after`` (seconds) on an upgrade refused by ``ws_max_connections_per_key``."""
    ws_stream_ids: str = "lanes"
    """``lanes`` (named ``stream_id`` lanes, the current guide), ``reject`` (a lane-less upstream such as
    xAI or a gateway: a create with ``stream_id`` gets ``unknown_parameter``), or ``close`` (the socket is
    closed with ``ws_reject_close_code`` instead)."""
    ws_reject_close_code: int = 1008
    """Close code used by ``ws_stream_ids: close``."""
    steer_models: tuple[str, ...] = ()
    """Models that support ``response.steer`` (``"*"`` = every model). Others answer
    ``response.steer.failed`` / ``steering_not_supported``."""
    http_obfuscation: bool = True
    """HTTP SSE delta events carry an ``obfuscation`` string unless ``stream_options.include_obfuscation``
    is false (the real API's default)."""
    ws_obfuscation: bool = True
    """WebSocket delta events carry ``obfuscation`` like HTTP SSE ones, unless the create's
    ``stream_options.include_obfuscation`` is false [C: undocumented on WebSocket, protocol.md §7]."""
    encrypted_reasoning_models: tuple[str, ...] = ("gpt-5.6", "gpt-6")
    """Models whose reasoning items carry ``encrypted_content`` by default for stateless requests
    (``store: false``), without ``include`` (protocol.md §7)."""
    safeguard_pause_s: float = 8.0
    """How long a safeguard review pauses a response mid-stream (prompt directive ``safeguard``)."""
    ultrafast_models: tuple[str, ...] = ("gpt-5.6-sol", "gpt-6.1-sol")
    """Models served on ``service_tier: "ultrafast"``; others fall back to ``default``."""
    ultrafast_fallback_every: int = 0
    """Every Nth ultrafast request is served on ``default`` instead (the response says so); 0 = never."""
    ultrafast_rate_limit: int = 0
    """Ultrafast requests allowed per key per minute (a separate limit from the other tiers);
    beyond it a 429 names the ultrafast limit. 0 = no limit."""
    require_keys: tuple[str, ...] = ()
    """Accepted API keys; empty = any non-empty key not starting with ``bad_key_prefix``."""
    bad_key_prefix: str = "sk-bad"
    isolate_keys: bool = True
    """A stored response is only visible to the key that created it (as on the real API)."""
    reject_unknown_params: bool = True
    """400 ``unknown_parameter`` for body fields the API does not know."""
    validate_tool_pairs: bool = True
    """400 for a ``function_call`` without output, or an output without a call (real API)."""
    reply_bytes: int = 120
    """Approximate size of a plain text reply."""
    delta_chars: int = 16
    """Characters per ``output_text.delta`` / ``function_call_arguments.delta``."""
    models: tuple[str, ...] = DEFAULT_MODELS
    background_delay_s: float = 0.05
    """How long a ``background: true`` HTTP response stays queued before it runs."""
    max_records: int = 100_000
    """Oracle records kept (oldest dropped first)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form settings for experiments; unused by the emulator itself."""

    def __post_init__(self) -> None:
        if self.ws_stream_ids not in STREAM_ID_MODES:
            raise ValueError(f"ws_stream_ids must be one of {STREAM_ID_MODES}, not {self.ws_stream_ids!r}")

    def steering(self, model: str | None) -> bool:
        """Whether ``model`` supports ``response.steer``."""
        return "*" in self.steer_models or (model is not None and model in self.steer_models)

    def replace(self, **changes: Any) -> EmulatorConfig:
        """Return a copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def load_config_file(path: str | Path) -> EmulatorConfig:
    """Read a YAML or JSON file: top-level keys are ``EmulatorConfig`` fields, ``latency`` a section.

    An optional ``latency.preset`` (zero | realistic | fast) is applied before the other latency keys.

    Raises:
        ValueError: unknown keys or a malformed file.
    """
    text = Path(path).read_text(encoding="utf-8")
    raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    raw = dict(raw.get("emulator", raw))
    latency_raw = dict(raw.pop("latency", None) or {})
    latency = LATENCY_PRESETS[str(latency_raw.pop("preset", "zero"))]
    known_latency = {f.name for f in dataclasses.fields(LatencyModel)}
    unknown = set(latency_raw) - known_latency
    if unknown:
        raise ValueError(f"{path}: unknown latency keys {sorted(unknown)}")
    latency = dataclasses.replace(latency, **{k: float(v) for k, v in latency_raw.items()})
    known = {f.name for f in dataclasses.fields(EmulatorConfig)} - {"latency"}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    for key in ("require_keys", "models", "steer_models", "encrypted_reasoning_models", "ultrafast_models"):
        if key in raw:
            raw[key] = tuple(raw[key])
    return EmulatorConfig(latency=latency, **raw)
