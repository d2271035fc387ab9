"""What is kept to explain a miss, as a :class:`~proxy.core.conversation.HeadTable` records its
heads: digests of each head's input items (:func:`item_digests`) and of its output's echoed fields
(:func:`echo_fields`), and the explainer's notes (:class:`HeadNotes`): one digest per setting for
each distinct settings digest (LRU, shared by every head with those settings), and where each
head's input ends. Only digests, never a value. The table tells it as it records and lets go
of heads (it is the table's listener); it imports nothing of the table, so the table's calls go
down to it. Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import orjson

from proxy.core.fields import NON_SETTINGS_FIELDS
from proxy.core.items import canonical, projection
from proxy.core.request import ParsedRequest

__all__ = [
    "DIGEST",
    "EchoFields",
    "HeadNotes",
    "SettingsFields",
    "echo_fields",
    "end_key",
    "field_paths",
    "item_digests",
    "schema_name",
    "settings_fields",
    "value_digest",
]

DIGEST = 8
"""Bytes kept per item or field digest (collisions only ever hide a difference, 2**-64)."""

EchoFields = tuple[tuple[str, ...], bytes]
"""One output item's projection: its field paths (a shared tuple) and their 8-byte digests,
concatenated in the same order."""
SettingsFields = tuple[tuple[str, bytes], ...]
"""``(setting name, 8-byte digest)`` of a request's settings, in body order."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
"""A key or type shown in an explanation must look like a schema name, never free text."""


def value_digest(value: Any) -> bytes:
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).digest()[:DIGEST]


def schema_name(name: Any) -> str | None:
    return name if isinstance(name, str) and _NAME.match(name) else None


def item_digests(keys: Sequence[bytes]) -> bytes:
    """The per-item digests a head keeps: the first :data:`DIGEST` bytes of each item key."""
    return b"".join(k[:DIGEST] for k in keys)


def settings_fields(fields: Mapping[str, Any]) -> SettingsFields:
    """One digest per setting, with the equivalences of the settings digest (rules 1-2, 8)."""
    out = []
    for name, value in fields.items():
        if name in NON_SETTINGS_FIELDS or value is None:
            continue
        value = canonical(value)
        if name == "include" and isinstance(value, list):
            value = sorted(set(orjson.dumps(v).decode() for v in value))
        out.append((name, value_digest(value)))
    return tuple(out)


_LISTS = ("content", "summary")
"""Fields whose elements are named one by one (``content[0].text``, ``summary[1].text``)."""


def field_paths(item: Mapping[str, Any], seen: dict[str, Any] | None = None) -> list[tuple[str, Any]]:
    """:func:`~proxy.core.items.projection` (``seen``, when the caller has it), one entry per
    field path."""
    out: list[tuple[str, Any]] = []
    for key, value in (projection(item) if seen is None else seen).items():
        name = schema_name(key) or "?"
        if key not in _LISTS or not isinstance(value, list) or not value:
            out.append((name, value))
            continue
        for index, part in enumerate(value):
            if isinstance(part, dict) and part:
                out.extend((f"{name}[{index}].{schema_name(k) or '?'}", v) for k, v in part.items())
            else:
                out.append((f"{name}[{index}]", part))
    return out


_PATHS: dict[tuple[str, ...], tuple[str, ...]] = {}
"""Path tuples shared by every head (a message with one part always has the same paths)."""
_MAX_PATHS = 4096


def _shared(paths: tuple[str, ...]) -> tuple[str, ...]:
    known = _PATHS.get(paths)
    if known is not None:
        return known
    if len(_PATHS) < _MAX_PATHS:
        _PATHS[paths] = paths
    return paths


_SAFE_NAMES: dict[Any, str] = {}
"""Keys already passed through :func:`schema_name` (``"?"`` for one that is not a schema name):
output items use a handful of keys, so a head's record runs no regex for them."""
_MAX_SAFE_NAMES = 4096


def _safe_name(key: Any) -> str:
    name = _SAFE_NAMES.get(key)
    if name is None:
        name = schema_name(key) or "?"
        if len(_SAFE_NAMES) < _MAX_SAFE_NAMES and isinstance(key, str) and len(key) <= 64:
            _SAFE_NAMES[key] = name
    return name


def echo_fields(item: Mapping[str, Any], seen: dict[str, Any] | None = None) -> EchoFields:
    """What a head keeps of one upstream output item to name the field an echo changed
    (``seen``: its :func:`~proxy.core.items.projection`, when the caller has it).

    The paths and digests of :func:`field_paths`, in its order, built in one pass (a head's
    record runs this for every output item)."""
    paths: list[str] = []
    digests: list[bytes] = []
    for key, value in (projection(item) if seen is None else seen).items():
        name = _safe_name(key)
        if key not in _LISTS or not isinstance(value, list) or not value:
            paths.append(name)
            digests.append(value_digest(value))
            continue
        for index, part in enumerate(value):
            if isinstance(part, dict) and part:
                for k, v in part.items():
                    paths.append(f"{name}[{index}].{_safe_name(k)}")
                    digests.append(value_digest(v))
            else:
                paths.append(f"{name}[{index}]")
                digests.append(value_digest(part))
    if item.get("type") == "reasoning" and item.get("encrypted_content") is not None:
        paths.append("encrypted_content")
        digests.append(value_digest(item["encrypted_content"]))
    return _shared(tuple(paths)), b"".join(digests)


class _Head(Protocol):
    """What the notes read of a head (:class:`proxy.core.heads.Head`), and its echo fields they
    set."""

    identity: str
    anchor: Hashable
    response_id: str
    settings: bytes
    n_input: int
    items: bytes | None
    echo: tuple[EchoFields, ...]


class _Source(Protocol):
    """What a head was recorded from (:class:`proxy.core.heads.Recorded`)."""

    @property
    def req(self) -> ParsedRequest: ...
    @property
    def items(self) -> list[dict[str, Any]]: ...
    @property
    def seen(self) -> list[dict[str, Any]]: ...


class HeadNotes:
    """The explainer's notes on a head table's heads."""

    MAX_SETTINGS_FIELDS = 1024
    """Distinct settings whose per-setting digests are kept (LRU)."""

    def __init__(self) -> None:
        self.settings_fields: OrderedDict[bytes, SettingsFields] = OrderedDict()
        """Per settings digest, one digest per setting (LRU, shared by heads)."""
        self.ends: dict[tuple[str, int, bytes], tuple[int, Hashable, str]] = {}
        """``(identity, input length, last input item's digest)`` → the serial, anchor and
        response id of the latest head recorded with it: where a busy key's heads are found by
        a miss without scanning them (an edited early item leaves the head's last input item
        where it was). Never the head itself: a head the table let go is not kept alive here,
        and its entry goes with it (:meth:`discarded`), so there are never more entries than
        heads in the table (a conversation's turns leave one, not one each)."""
        self.serial = 0
        """Heads recorded so far (a miss looks only at those recorded before it)."""

    def recorded(self, head: _Head, source: _Source) -> None:
        """``head`` was recorded from the full history ``source.req``: give it the echo fields
        of its output items (:func:`echo_fields`, from their projections ``source.seen``), keep
        its settings' digests and index it by how its input ends."""
        head.echo = tuple(echo_fields(i, s) for i, s in zip(source.items, source.seen, strict=True))
        self.serial += 1
        key = end_key(head)
        if key is not None:
            self.ends[key] = (self.serial, head.anchor, head.response_id)
        digest = head.settings
        if digest in self.settings_fields:
            self.settings_fields.move_to_end(digest)
            return
        self.settings_fields[digest] = settings_fields(source.req.fields)
        while len(self.settings_fields) > self.MAX_SETTINGS_FIELDS:
            self.settings_fields.popitem(last=False)

    def discarded(self, head: _Head) -> None:
        """``head`` left the table (replaced, expired, evicted, its socket closed or its
        anchor rekeyed): its entry in the index goes, unless a later head ending alike, under
        another anchor, took the entry over."""
        key = end_key(head)
        if key is not None:
            entry = self.ends.get(key)
            if entry is not None and entry[1] == head.anchor:
                del self.ends[key]


def end_key(head: _Head) -> tuple[str, int, bytes] | None:
    """Where :attr:`HeadNotes.ends` files ``head``: its identity, input length and last input
    item's digest (``None`` without item digests)."""
    n, items = head.n_input, head.items
    if n > 0 and items is not None and len(items) == n * DIGEST:
        return head.identity, n, items[-DIGEST:]
    return None
