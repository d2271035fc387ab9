"""In-memory state shared by both transports: the response store, oracle records and counters.

Per-connection lane caches live with their connection (``ws.py``); everything here is global to
one emulator instance and cleared by :meth:`EmulatorState.reset`.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import EmulatorConfig, LatencyModel
from .errors import ultrafast_rate_limited
from .oracle import Segment

__all__ = ["ConnectionStats", "Conversation", "EmulatorState", "KeyStats", "ResponseRecord", "Stats", "identity_of"]

JSON = Any


def identity_of(authorization: str | None) -> str:
    """A short, non-reversible identity for an ``Authorization`` header (never the secret)."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()[:16]


@dataclass(slots=True)
class ResponseRecord:
    """A finished (or background) response and the chain a continuation would inherit."""

    id: str
    owner: str
    response: dict[str, JSON]
    """The public response object."""
    output: list[JSON]
    context: Segment
    """The effective context the response was generated from."""
    chain: Segment
    """``context`` + ``output``: what ``previous_response_id`` = this id resolves to."""
    input_items: list[JSON]
    store: bool


@dataclass(slots=True)
class Conversation:
    """A ``conversation`` object (HTTP): its items are prepended to each request's input."""

    id: str
    owner: str
    chain: Segment
    created_at: int = field(default_factory=lambda: int(time.time()))


@dataclass(slots=True)
class ConnectionStats:
    """Counters for one WebSocket connection (identity is a hash, never the key)."""

    identity: str
    opened_at: float
    open: bool = True
    close_code: int | None = None
    requests: int = 0
    continuations: int = 0
    cache_hits: int = 0
    hydrations: int = 0
    misses: int = 0
    errors: int = 0
    bytes_received: int = 0
    frames_received: int = 0
    named_streams: int = 0
    in_flight: int = 0
    max_in_flight: int = 0


@dataclass(slots=True)
class KeyStats:
    """WebSocket connections of one key (identity hash): the per-key cap's counters."""

    open: int = 0
    peak_open: int = 0
    """Most connections this key had open at once."""
    opened: int = 0
    refused: int = 0
    """Upgrades refused with 429 by ``ws_max_connections_per_key``."""
    refused_at: list[float] = field(default_factory=list)
    """Monotonic times of those refusals (tests check ``retry-after`` was honoured)."""
    attempts_at: list[float] = field(default_factory=list)
    """Monotonic times of every upgrade attempt of this key (accepted or refused)."""


def _per_transport() -> dict[str, int]:
    return {"http": 0, "ws": 0}


@dataclass(slots=True)
class Stats:
    """Every counter tests read. ``snapshot()`` gives a plain dict (also served on ``/_emulator/stats``)."""

    requests: dict[str, int] = field(default_factory=_per_transport)
    responses: dict[str, int] = field(default_factory=lambda: {"completed": 0, "incomplete": 0, "failed": 0})
    errors: dict[str, int] = field(default_factory=_per_transport)
    continuations: dict[str, int] = field(default_factory=_per_transport)
    cache_hits: int = 0
    hydrations: dict[str, int] = field(default_factory=_per_transport)
    misses: dict[str, int] = field(default_factory=_per_transport)
    generate_false: int = 0
    bytes_received: dict[str, int] = field(default_factory=_per_transport)
    ws_frames_received: int = 0
    ws_connections: dict[str, int] = field(
        default_factory=lambda: {"opened": 0, "open": 0, "closed": 0, "refused": 0, "refused_cap": 0}
    )
    """``refused`` counts every refused upgrade (faults and the cap); ``refused_cap`` the cap's only."""
    keys: dict[str, KeyStats] = field(default_factory=dict)
    """Per identity hash: open / peak_open / opened / refused WebSocket connections."""
    network: dict[str, int] = field(
        default_factory=lambda: {"new_connections": 0, "connect_delays": 0, "inbound_delays": 0, "outbound_delays": 0}
    )
    """Network model: TCP connections seen, handshake delays paid, messages delayed by RTT/2 each way."""
    steers: dict[str, int] = field(default_factory=dict)
    """``response.steer`` replies by outcome (``accepted``, ``pending``, ``failed:<code>``) and ``successors``."""
    faults_fired: dict[str, int] = field(default_factory=dict)
    input_items: dict[str, int] = field(default_factory=dict)
    """Per response id: how many input items the request carried (the delta, not the context)."""
    other_requests: dict[str, int] = field(default_factory=dict)
    connections: dict[str, ConnectionStats] = field(default_factory=dict)
    tiers: dict[str, int] = field(default_factory=dict)
    """Responses by ``<asked>-><served>`` service tier (``ultrafast->default`` is a fallback)."""

    def key(self, identity: str) -> KeyStats:
        """The per-key counters of ``identity`` (created on first use)."""
        found = self.keys.get(identity)
        if found is None:
            found = self.keys[identity] = KeyStats()
        return found

    def count(self, table: dict[str, int], name: str) -> None:
        """Add one to ``table[name]``."""
        table[name] = table.get(name, 0) + 1

    def fault_fired(self, kind: str) -> None:
        """Count one fired fault of ``kind``."""
        self.faults_fired[kind] = self.faults_fired.get(kind, 0) + 1

    def other(self, name: str) -> None:
        """Count a request to a non-Responses endpoint."""
        self.other_requests[name] = self.other_requests.get(name, 0) + 1

    def snapshot(self) -> dict[str, JSON]:
        """A deep, JSON-ready copy."""
        return asdict(self)


class EmulatorState:
    """The store, oracle records, conversations and stats of one emulator."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.latency: LatencyModel = config.latency
        """Current latency model (replaceable at run time via ``/_emulator/latency``)."""
        self.stats = Stats()
        self.store: dict[str, ResponseRecord] = {}
        self.items: dict[str, tuple[str, JSON]] = {}
        """Stored output item id → (owner, item), for ``item_reference`` and reasoning by id."""
        self.records: OrderedDict[str, dict[str, JSON]] = OrderedDict()
        self.conversations: dict[str, Conversation] = {}
        self.transports: dict[int, Any] = {}
        """TCP connections already charged ``connect_ms`` (``network.py``)."""
        self._ultrafast: dict[str, deque[float]] = {}
        self._ultrafast_seen = 0
        self.recording: deque[dict[str, JSON]] | None = None
        """Received requests (``start_recording``): ``{"transport", "body"}`` per create/steer frame or body."""

    def serve_tier(self, owner: str, body: JSON) -> str:
        """The service tier a create is served on (protocol.md §7), counted in ``stats.tiers``.

        ``ultrafast`` is served only to ``config.ultrafast_models`` and falls back to ``default``
        every ``config.ultrafast_fallback_every``-th request; its own per-key rate limit
        (``config.ultrafast_rate_limit`` a minute) answers 429 apart from the other tiers'.

        Raises:
            ApiError: 429 past the ultrafast limit.
        """
        asked = body.get("service_tier") if isinstance(body, dict) else None
        asked = asked if isinstance(asked, str) else "auto"
        served = "default" if asked == "auto" else asked
        if asked == "ultrafast":
            config = self.config
            if config.ultrafast_rate_limit > 0:
                now = time.monotonic()
                window = self._ultrafast.setdefault(owner, deque())
                while window and now - window[0] >= 60.0:
                    window.popleft()
                if len(window) >= config.ultrafast_rate_limit:
                    self.stats.count(self.stats.tiers, "ultrafast:429")
                    raise ultrafast_rate_limited(config.ultrafast_rate_limit)
                window.append(now)
            self._ultrafast_seen += 1
            every = config.ultrafast_fallback_every
            if not str(body.get("model") or "").startswith(config.ultrafast_models) or (
                every > 0 and self._ultrafast_seen % every == 0
            ):
                served = "default"
        self.stats.count(self.stats.tiers, f"{asked}->{served}")
        return served

    def start_recording(self, limit: int = 1000) -> deque[dict[str, JSON]]:
        """Keep the last ``limit`` received ``/v1/responses`` bodies and WebSocket client frames (parsed)."""
        self.recording = deque(maxlen=limit)
        return self.recording

    def received(self, transport: str, body: JSON) -> None:
        """Record one received request when recording is on."""
        if self.recording is not None:
            self.recording.append({"transport": transport, "body": body})

    def reset(self) -> None:
        """Forget everything except open connections' own caches; zero all counters."""
        open_connections = {k: v for k, v in self.stats.connections.items() if v.open}
        self.stats = Stats()
        self.stats.connections.update(open_connections)
        self.stats.ws_connections["open"] = len(open_connections)
        for conn in open_connections.values():
            key = self.stats.key(conn.identity)
            key.open += 1
            key.peak_open = max(key.peak_open, key.open)
        self.store.clear()
        self.items.clear()
        self.records.clear()
        self.conversations.clear()
        self._ultrafast.clear()
        self._ultrafast_seen = 0

    def put(self, record: ResponseRecord) -> None:
        """Keep a ``store: true`` response (and index its output items)."""
        self.store[record.id] = record
        for item in record.output:
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                self.items[item["id"]] = (record.owner, item)

    def get(self, response_id: str, owner: str) -> ResponseRecord | None:
        """A stored response visible to ``owner``."""
        record = self.store.get(response_id)
        if record is None or (self.config.isolate_keys and record.owner != owner):
            return None
        return record

    def delete(self, response_id: str, owner: str) -> bool:
        """Remove a stored response; False if it was not visible to ``owner``."""
        if self.get(response_id, owner) is None:
            return False
        del self.store[response_id]
        return True

    def item(self, item_id: str, owner: str) -> JSON | None:
        """A stored output item by id, as emitted."""
        entry = self.items.get(item_id)
        if entry is None or (self.config.isolate_keys and entry[0] != owner):
            return None
        return entry[1]

    def record(self, response_id: str, data: dict[str, JSON]) -> None:
        """Keep an oracle record (bounded; oldest dropped first)."""
        self.records[response_id] = data
        self.records.move_to_end(response_id)
        while len(self.records) > self.config.max_records:
            self.records.popitem(last=False)
