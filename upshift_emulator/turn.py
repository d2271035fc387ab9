"""One accepted create resolved against its chain (:class:`Turn`), and ids."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from .config import EmulatorConfig
from .oracle import Segment, clean, normalize_input, visible
from .validation import check_tool_pairs, resolve_input

__all__ = ["REASONING_CONTEXTS", "Turn", "effective_reasoning_context", "new_id", "prepare"]

JSON = Any


REASONING_CONTEXTS = ("auto", "all_turns", "current_turn")
_CURRENT_TURN_MODELS = ("gpt-5", "gpt-4", "o1", "o3", "o4")  # family prefixes, not model ids
"""Model families whose ``auto`` is ``current_turn`` (the SDK's ``Reasoning.context``: "the gpt-5.6
model family defaults to all_turns; earlier models default to current_turn")."""
_ALL_TURNS_FROM = (5, 6)


def effective_reasoning_context(body: dict[str, JSON]) -> str:
    """``reasoning.context`` as applied: ``all_turns`` or ``current_turn``; ``auto`` (or absent) is
    the model's default: ``all_turns`` from GPT-5.6 on, ``current_turn`` before."""
    reasoning = body.get("reasoning")
    asked = reasoning.get("context") if isinstance(reasoning, dict) else None
    if asked in ("all_turns", "current_turn"):
        return str(asked)
    model = str(body.get("model") or "")
    if not model.startswith(_CURRENT_TURN_MODELS):
        return "all_turns"
    if model.startswith("gpt-5."):
        minor = model[6:].split("-", 1)[0].split(".", 1)[0]
        if minor.isdigit() and (5, int(minor)) >= _ALL_TURNS_FROM:
            return "all_turns"
    return "current_turn"


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
    service_tier: str = "default"
    """The tier actually served (``EmulatorState.serve_tier``)."""
    reasoning_context: str = "all_turns"
    """The effective ``reasoning.context`` (:func:`effective_reasoning_context`)."""
    _read: Segment | None = None

    @property
    def read(self) -> Segment:
        """What the model reads of :attr:`context` (:func:`~.oracle.visible`): the context itself
        unless a compaction item or ``reasoning.context: current_turn`` hides part of it."""
        if self._read is None:
            items = self.context.to_list()
            seen = visible(items, self.reasoning_context)
            self._read = self.context if len(seen) == len(items) else Segment.root().extend(seen)
        return self._read

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
        reasoning_context=effective_reasoning_context(body),
        **extra,
    )
