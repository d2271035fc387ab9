"""One accepted create resolved against its chain (:class:`Turn`), and ids."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from .config import EmulatorConfig
from .oracle import Segment, clean, normalize_input
from .validation import check_tool_pairs, resolve_input

__all__ = ["Turn", "new_id", "prepare"]

JSON = Any


def new_id(prefix: str, nbytes: int = 24) -> str:
    """``<prefix>_<hex>``: unique, random (content stays deterministic)."""
    return f"{prefix}_{secrets.token_hex(nbytes)}"


@dataclass(slots=True)
class Turn:
    """One accepted create, resolved against its chain."""

    id: str
    body: dict[str, JSON]
    transport: str
    owner: str
    base: Segment
    """The inherited chain (previous response, conversation, or empty)."""
    context: Segment
    """``base`` + the new input: what the model sees."""
    new_items: list[JSON]
    input_bytes: int
    previous_response_id: str | None = None
    cached: bool = False
    """``base`` came from this connection's cache (WS hit)."""
    hydrated: bool = False
    """``base`` was loaded from the store."""
    connection_id: str | None = None
    stream_id: str | None = None
    conversation_id: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def store(self) -> bool:
        """``store`` defaults to true."""
        return self.body.get("store") is not False

    @property
    def generate(self) -> bool:
        """``generate: false`` is a warm-up (WS only); ``prompt_cache_options.prewarm`` forces it (§6)."""
        options = self.body.get("prompt_cache_options")
        if isinstance(options, dict) and options.get("prewarm") is True:
            return False
        return self.body.get("generate") is not False

    @property
    def cached_bytes(self) -> int:
        """Canonical context bytes that came from the connection cache."""
        return self.base.nbytes if self.cached else 0

    @property
    def rebuild_bytes(self) -> int:
        """Canonical context bytes that must be (re)processed."""
        return self.context.nbytes - self.cached_bytes

    @property
    def settings_bytes(self) -> int:
        """Bytes of the non-inherited settings (instructions + tools) counted as input."""
        extra = {"instructions": self.body.get("instructions"), "tools": self.body.get("tools")}
        return len(orjson.dumps(clean(extra)))


def prepare(
    body: dict[str, JSON],
    *,
    config: EmulatorConfig,
    transport: str,
    owner: str,
    base: Segment,
    lookup_item: Callable[[str], JSON | None],
    input_bytes: int,
    **extra: Any,
) -> Turn:
    """Resolve the new input against ``base``; raises :class:`ApiError` like the real API would."""
    store = body.get("store") is not False
    items = resolve_input(normalize_input(body.get("input")), store=store, lookup=lookup_item)
    context = base.extend(items)
    if config.validate_tool_pairs:
        check_tool_pairs(context.to_list())
    return Turn(
        id=new_id("resp"),
        body=body,
        transport=transport,
        owner=owner,
        base=base,
        context=context,
        new_items=items,
        input_bytes=input_bytes,
        previous_response_id=body.get("previous_response_id"),
        **extra,
    )
