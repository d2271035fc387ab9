"""Fidelity oracle: canonical form and digest of the context a response was generated from.

This is the emulator's **own** implementation of client-echo.md §4; it deliberately imports
nothing from the sidecar, so one bug cannot hide in both.

Canonical item: everything the model sees, as a value (absent differs from present), and
nothing it cannot see (the audit table of docs/fidelity.md):

- every type: ``id`` and ``status`` left out (a handle and a record of generation), except
  where noted; any field not named here is kept as it is.
- ``message`` (or no ``type`` but a ``role``): ``role``, ``content`` parts, ``phase`` when
  present (``"commentary"`` is not ``None``), any other field. Text parts
  (``input_text``/``output_text``/``text``, string content) become ``{"type": "text", "text"}``
  plus their ``annotations`` when not empty; ``logprobs`` and ``parsed`` go. So ``"content":
  "hi"`` equals ``[{"type": "input_text", "text": "hi"}]``, but two parts are not their
  concatenation (how the model sees two parts is not documented).
- ``function_call``: ``arguments`` parsed as JSON (blank = ``{}``); ``call_id``, ``name``,
  ``namespace``, ``caller`` and the rest as they are.
- ``function_call_output``: ``call_id``, ``output`` (and any other field).
- ``reasoning``: ``summary`` texts, ``content`` when not empty, ``encrypted_content`` (or
  ``id`` when there is none: the upstream reads the item from its store).
- ``compaction``: ``encrypted_content``; ``program``: ``call_id``, ``code``, ``fingerprint``;
  ``program_output``: ``call_id``, ``result``, ``status`` (the program's terminal status); any other
  type (``item_reference`` aside): exact.
- content parts: ``prompt_cache_breakpoint`` left out (a caching hint, protocol.md §7: the model
  does not read it).

What the model reads of a context (:func:`visible`, protocol.md §7): a ``compaction`` item stands
for everything before it, so only the latest one and what follows it are read; under
``reasoning.context: current_turn`` reasoning items before the last user message (earlier user
turns) are not read either.

Everywhere: parsed (not bytes), ``null`` = absent, ``async_`` = ``async``, client-added keys stripped,
numbers by value. ``item_reference`` items are resolved by the caller before canonicalisation.

Digest: sha256 over the canonical JSON lines (sorted keys, compact, one ``\\n`` after each item),
so a chain's digest can be extended item by item (:class:`Segment`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

import orjson

__all__ = [
    "Segment",
    "canonical_item",
    "canonical_line",
    "clean",
    "context_digest",
    "normalize_input",
    "settings_digest",
    "visible",
]

JSON = Any
CLIENT_KEYS: Final = frozenset({"internal_chat_message_metadata_passthrough", "parsed_arguments"})
TEXT_PART_TYPES: Final = frozenset({"input_text", "output_text", "text"})
_UNREAD_PART: Final = frozenset({"type", "text", "logprobs", "parsed", "prompt_cache_breakpoint"})
"""Keys of a text part the model does not read as such (``type``/``text`` are rebuilt)."""
_MAX_SAFE_INT: Final = 2**53
_MAX_JSON_INT: Final = 2**63


def clean(value: JSON) -> JSON:
    """Rules 1–4: drop ``null`` keys, ``async_`` → ``async``, strip client keys, numbers by value."""
    if isinstance(value, dict):
        out: dict[str, JSON] = {}
        for key, item in value.items():
            if item is None or key in CLIENT_KEYS:
                continue
            out["async" if key == "async_" else key] = clean(item)
        return out
    if isinstance(value, list):
        return [clean(item) for item in value]
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < _MAX_SAFE_INT:
        return int(value)
    if isinstance(value, int) and abs(value) >= _MAX_JSON_INT:
        return {"$bigint": str(value)}
    return value


def normalize_input(value: JSON) -> list[JSON]:
    """Rule 7: ``"str"`` → one user message; ``None`` → no items; a list stays a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    return [value]


def _parts(content: JSON) -> list[JSON]:
    raw = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    parts: list[JSON] = []
    for part in raw if isinstance(raw, list) else [raw]:
        if not isinstance(part, dict):
            parts.append(part)
            continue
        kind = part.get("type")
        if (isinstance(kind, str) and kind in TEXT_PART_TYPES) or (kind is None and "text" in part):
            text: JSON = {"type": "text", "text": str(part.get("text", ""))}
            rest = {k: v for k, v in part.items() if k not in _UNREAD_PART}
            if rest.get("annotations") == []:
                del rest["annotations"]
            parts.append({**rest, **text})
        elif kind == "refusal":
            parts.append({"type": "refusal", "refusal": part.get("refusal", "")})
        elif kind == "input_image":
            keep = {k: part[k] for k in ("image_url", "file_id") if k in part}
            parts.append({"type": "input_image", "detail": part.get("detail", "auto"), **keep})
        elif kind == "input_file":
            keep = {k: part[k] for k in ("file_id", "file_data", "file_url", "filename") if k in part}
            parts.append({"type": "input_file", **keep})
        else:
            unread = ("annotations", "logprobs", "parsed", "prompt_cache_breakpoint")
            parts.append({k: v for k, v in part.items() if k not in unread})
    return parts


def _arguments(raw: JSON) -> JSON:
    if not isinstance(raw, str):
        return raw if raw is not None else {}
    if not raw.strip():
        return {}
    try:
        return clean(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return raw


def _summary_texts(summary: JSON) -> list[str]:
    if not isinstance(summary, list):
        return []
    return [str(s.get("text", "")) if isinstance(s, dict) else str(s) for s in summary]


_KNOWN: Final = {
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "custom_tool_call",
    "custom_tool_call_output",
}
"""Types whose ``id`` and ``status`` the model does not see (other types stay exact)."""


def canonical_item(item: JSON) -> JSON:
    """The canonical form of one input or output item: what the model sees of it."""
    item = clean(item)
    if not isinstance(item, dict):
        return item
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    if isinstance(kind, str) and kind in _KNOWN:
        out: dict[str, JSON] = {k: v for k, v in item.items() if k not in ("id", "status")}
        out["type"] = kind
    if kind == "message":
        out["role"] = item.get("role")
        out["content"] = _parts(item.get("content"))
        return out
    if kind == "function_call":
        out["call_id"], out["name"] = item.get("call_id"), item.get("name")
        out["arguments"] = _arguments(item.get("arguments"))
        return out
    if kind == "function_call_output":
        output = item.get("output", "")
        out["call_id"] = item.get("call_id")
        out["output"] = output if isinstance(output, str) else _parts(output)
        return out
    if kind == "reasoning":
        out["summary"] = _summary_texts(item.get("summary"))
        if not out.get("content"):
            out.pop("content", None)
        if "encrypted_content" not in item and "id" in item:
            out["id"] = item["id"]
        return out
    if kind in ("custom_tool_call", "custom_tool_call_output"):
        out["call_id"] = item.get("call_id")
        return out
    if kind == "compaction":
        return {"type": kind, "encrypted_content": item.get("encrypted_content")}
    if kind == "program":
        return {k: v for k, v in item.items() if k not in ("id", "status")}
    if kind == "program_output":
        return {k: v for k, v in item.items() if k != "id"}
    return item


def visible(items: Sequence[JSON], reasoning_context: str = "all_turns") -> list[JSON]:
    """What the model reads of a canonical context (protocol.md §7).

    A ``compaction`` item stands for everything before it: the latest one and what follows are
    read. Under ``reasoning_context == "current_turn"`` reasoning items before the last user
    message (they belong to earlier user turns) are not read; under ``all_turns`` they are.
    """
    start = 0
    last_user = -1
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        if not isinstance(item, dict):
            continue
        if last_user < 0 and item.get("type") == "message" and item.get("role") == "user":
            last_user = index
        if item.get("type") == "compaction":
            start = index
            break
    if reasoning_context != "current_turn" or last_user <= start:
        return list(items[start:])
    return [
        item
        for index, item in enumerate(items[start:], start)
        if index >= last_user or not (isinstance(item, dict) and item.get("type") == "reasoning")
    ]


def canonical_line(item: JSON) -> bytes:
    """Sorted-key compact JSON of the canonical item, plus a newline."""
    return orjson.dumps(canonical_item(item), option=orjson.OPT_SORT_KEYS) + b"\n"


class Segment:
    """An immutable, shareable piece of a context chain with its running digest.

    ``root().extend(a).extend(b)`` has the same digest as ``root().extend(a + b)``; children share
    their parent's items, so a long chain costs O(new items) per turn.
    """

    __slots__ = ("parent", "items", "count", "nbytes", "digest", "_hasher")

    def __init__(self, parent: Segment | None, items: tuple[JSON, ...], hasher: Any, count: int, nbytes: int):
        self.parent = parent
        self.items = items
        """Canonical items added by this segment."""
        self.count = count
        """Items in the whole chain up to and including this segment."""
        self.nbytes = nbytes
        """Canonical bytes of the whole chain."""
        self._hasher = hasher
        self.digest: str = hasher.hexdigest()

    @classmethod
    def root(cls) -> Segment:
        """The empty context."""
        return cls(None, (), hashlib.sha256(), 0, 0)

    def extend(self, raw_items: Iterable[JSON]) -> Segment:
        """A new segment with ``raw_items`` (canonicalised here) appended."""
        hasher = self._hasher.copy()
        items: list[JSON] = []
        nbytes = self.nbytes
        for raw in raw_items:
            canon = canonical_item(raw)
            line = orjson.dumps(canon, option=orjson.OPT_SORT_KEYS) + b"\n"
            hasher.update(line)
            nbytes += len(line)
            items.append(canon)
        if not items:
            return self
        return Segment(self, tuple(items), hasher, self.count + len(items), nbytes)

    def iter_reversed(self) -> Iterator[JSON]:
        """Canonical items from the newest back to the first."""
        seg: Segment | None = self
        while seg is not None:
            yield from reversed(seg.items)
            seg = seg.parent

    def to_list(self) -> list[JSON]:
        """All canonical items, oldest first."""
        out = list(self.iter_reversed())
        out.reverse()
        return out


def context_digest(raw_items: Sequence[JSON], reasoning_context: str = "all_turns") -> str:
    """Digest of what the model reads of a whole context given as raw items (:func:`visible`;
    for tests and tools)."""
    canon = [canonical_item(item) for item in raw_items]
    return Segment.root().extend(visible(canon, reasoning_context)).digest


def settings_digest(instructions: JSON, tools: JSON) -> str:
    """Digest of the per-request settings that are not inherited: ``instructions`` and ``tools``."""
    if isinstance(instructions, list):
        instr: JSON = [canonical_item(item) for item in instructions]
    else:
        instr = clean(instructions)
    canon = {"instructions": instr, "tools": clean(tools) or []}
    return hashlib.sha256(orjson.dumps(canon, option=orjson.OPT_SORT_KEYS)).hexdigest()
