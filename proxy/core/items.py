"""Item canonicalisation and echo matching (client-echo.md §4).

Two questions are asked of items, and they get different answers on purpose:

* *Is this the same input item the app sent last time?* Clients re-send their earlier input
  unchanged (client-echo.md §1.2), so :func:`item_key` compares everything, after the generic
  rules 1-4 (parsed values, ``null`` = absent, ``async_`` = ``async``, client-added keys
  stripped, string content = one text part).
* *Is this the client's echo of an output item the upstream produced?* Every client rebuilds
  echoed output in its own shape, so :func:`fingerprint` keeps a per-type projection of the
  upstream item (a whitelist, rule 5) and :func:`echo_matches` compares an echo against it.

Everything here is pure: parsed JSON values in, digests and booleans out. Digests are
truncated SHA-256 over canonical JSON; a head keeps digests, never the text itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "OutputFingerprint",
    "canonical",
    "digest",
    "echo_matches",
    "fingerprint",
    "input_view",
    "item_key",
]

_CLIENT_KEYS = frozenset({"internal_chat_message_metadata_passthrough", "parsed_arguments"})
"""Keys some clients add to items they echo (client-echo.md rule 4)."""

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1


def digest(data: bytes) -> bytes:
    """A 16-byte digest of ``data``."""
    return hashlib.sha256(data).digest()[:16]


def canonical(value: Any) -> Any:
    """Apply rules 1-4 to a parsed JSON value.

    Dict key order is irrelevant (digests sort keys); ``null`` values are dropped; an integral
    float equals its int (``-3.0`` == ``-3``); ``async_`` is ``async``; client-added keys go.
    """
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if item is None or key in _CLIENT_KEYS:
                continue
            if key == "async_":
                key = "async"
                if "async" in value and value["async"] is not None and value["async"] != item:
                    # Both present and disagreeing: keep the conflict visible, so it never
                    # equals a clean item.
                    out["async_conflict"] = canonical(item)
                    continue
            # Strings (most leaves) are their own canonical form: no call for them.
            out[key] = item if item.__class__ is str else canonical(item)
        return out
    if isinstance(value, list):
        return [item if item.__class__ is str else canonical(item) for item in value]
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return int(value)
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value < _INT_MIN or value > _INT_MAX:
            return {"$bigint": str(value)}
        return value
    return value


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _message_parts(item: Mapping[str, Any]) -> Any:
    """A message's content as a list of parts (string content = one text part)."""
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        return [{"type": kind, "text": content}]
    return content


def input_view(item: Any) -> Any:
    """An input item as the *prefix* comparison sees it (all fields, rules 1-4 and 7)."""
    value = canonical(item)
    if isinstance(value, dict) and "role" in value and value.get("type", "message") == "message":
        value["type"] = "message"
        parts = _message_parts(value)
        if isinstance(parts, list):
            value["content"] = [
                {k: v for k, v in p.items() if k != "parsed"} if isinstance(p, dict) else p for p in parts
            ]
    return value


def item_key(item: Mapping[str, Any]) -> bytes:
    """Digest of an input item for the *prefix* comparison: :func:`input_view`, digested."""
    return digest(_dumps(input_view(item)))


@dataclass(frozen=True, slots=True)
class OutputFingerprint:
    """The per-type projection of one upstream output item, kept as digests.

    Attributes:
        kind: ``message``, ``function_call``, ``custom_tool_call``, ``reasoning`` or ``other``.
        id: The item's id, compared only when the echo carries one.
        main: Digest of the fields every echo must reproduce for this kind.
        alt: A second acceptable form: the concatenated text of a message (for echoes that
            send ``content`` as a string), or ``None``.
        optional: ``(field, digest)`` pairs compared only when the echo has the field
            (message ``phase`` and per-part ``annotations``).
    """

    kind: str
    id: str | None
    main: bytes
    alt: bytes | None = None
    optional: tuple[tuple[str, bytes], ...] = ()


def _args_value(arguments: Any) -> Any:
    """Function-call arguments as parsed JSON (blank = ``{}``); raw text if not JSON."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):
        try:
            return canonical(orjson.loads(arguments))
        except orjson.JSONDecodeError:
            return {"$raw": arguments}
    return {"$raw": canonical(arguments)}


def _message_main(role: Any, parts: list[Any]) -> bytes:
    projected = []
    for part in parts:
        if not isinstance(part, dict):
            projected.append({"$bad": canonical(part)})
            continue
        kind = part.get("type")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        projected.append({"type": kind, "text": text})
    return digest(_dumps({"role": role, "parts": projected}))


def _summary_texts(summary: Any) -> list[Any]:
    if not isinstance(summary, list):
        return [] if summary is None else [{"$bad": canonical(summary)}]
    return [s.get("text") if isinstance(s, dict) else {"$bad": canonical(s)} for s in summary]


def _kind(item: Mapping[str, Any]) -> str:
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"
    return kind if isinstance(kind, str) else "other"


def _str_id(item: Mapping[str, Any]) -> str | None:
    value = item.get("id")
    return value if isinstance(value, str) else None


def fingerprint(item: Mapping[str, Any]) -> OutputFingerprint:
    """Project an upstream output item (as in ``response.output``) for echo matching."""
    kind = _kind(item)
    item_id = _str_id(item)
    if kind == "message":
        parts = _message_parts(item)
        if not isinstance(parts, list):
            parts = [parts]
        alt = None
        if all(isinstance(p, dict) and p.get("type") == "output_text" for p in parts):
            text = "".join(str(p.get("text", "")) for p in parts)
            alt = _message_main(item.get("role"), [{"type": "output_text", "text": text}])
        optional: list[tuple[str, bytes]] = []
        if item.get("phase") is not None:
            optional.append(("phase", digest(_dumps(item["phase"]))))
        for index, part in enumerate(parts):
            if isinstance(part, dict):
                notes = part.get("annotations")
                optional.append((f"annotations.{index}", digest(_dumps(canonical(notes or [])))))
        return OutputFingerprint(kind, item_id, _message_main(item.get("role"), parts), alt, tuple(optional))
    if kind == "function_call":
        main = {"call_id": item.get("call_id"), "name": item.get("name")}
        main["arguments"] = _args_value(item.get("arguments"))
        return OutputFingerprint(kind, item_id, digest(_dumps(main)))
    if kind == "custom_tool_call":
        main = {k: canonical(item.get(k)) for k in ("call_id", "name", "input")}
        return OutputFingerprint(kind, item_id, digest(_dumps(main)))
    if kind == "reasoning":
        enc = item.get("encrypted_content")
        return OutputFingerprint(
            kind,
            item_id,
            digest(_dumps(_summary_texts(item.get("summary")))),
            digest(_dumps(enc)) if enc is not None else None,
        )
    rest = canonical(item)
    if isinstance(rest, dict):
        rest.pop("status", None)
        rest.pop("id", None)
    return OutputFingerprint(kind, item_id, digest(_dumps(rest)))


def _is_reference(echo: Mapping[str, Any]) -> bool:
    kind = echo.get("type")
    if kind == "item_reference":
        return True
    # ``{"id": X}`` alone is the short form of an item reference.
    return kind is None and "role" not in echo and set(echo) - {"type"} == {"id"}


def echo_matches(fp: OutputFingerprint, echo: Any) -> bool:
    """Whether ``echo`` (an item the app sent) is an echo of the output item behind ``fp``."""
    if not isinstance(echo, dict):
        return False
    echo_id = echo.get("id")
    if _is_reference(echo):
        return fp.id is not None and echo_id == fp.id
    if echo_id is not None and echo_id != fp.id:
        return False
    if _kind(echo) != fp.kind:
        return False
    if fp.kind == "message":
        return _message_echo_matches(fp, echo)
    if fp.kind == "reasoning":
        return _reasoning_echo_matches(fp, echo)
    if fp.kind == "function_call":
        main = {"call_id": echo.get("call_id"), "name": echo.get("name")}
        main["arguments"] = _args_value(echo.get("arguments"))
        return digest(_dumps(main)) == fp.main
    if fp.kind == "custom_tool_call":
        main = {k: canonical(echo.get(k)) for k in ("call_id", "name", "input")}
        return digest(_dumps(main)) == fp.main
    rest = canonical(echo)
    rest.pop("status", None)
    rest.pop("id", None)
    return digest(_dumps(rest)) == fp.main


def _message_echo_matches(fp: OutputFingerprint, echo: Mapping[str, Any]) -> bool:
    content = echo.get("content")
    if isinstance(content, str):
        if fp.alt is None:
            return False
        main = _message_main(echo.get("role"), [{"type": "output_text", "text": content}])
        if main != fp.alt:
            return False
    else:
        parts = content if isinstance(content, list) else [content]
        if _message_main(echo.get("role"), parts) != fp.main:
            return False
        for index, part in enumerate(parts):
            notes = part.get("annotations") if isinstance(part, dict) else None
            if notes is not None and not _optional_equal(fp, f"annotations.{index}", notes):
                return False
    phase = echo.get("phase")
    return phase is None or _optional_equal(fp, "phase", phase)


def _optional_equal(fp: OutputFingerprint, name: str, value: Any) -> bool:
    for field, want in fp.optional:
        if field == name:
            return digest(_dumps(canonical(value))) == want
    # The upstream item has no such field: the echo added one.
    return False


def _reasoning_echo_matches(fp: OutputFingerprint, echo: Mapping[str, Any]) -> bool:
    if digest(_dumps(_summary_texts(echo.get("summary")))) != fp.main:
        return False
    enc = echo.get("encrypted_content")
    if enc is not None:
        return digest(_dumps(enc)) == fp.alt
    # No encrypted content in the echo: acceptable only when the upstream item had none
    # either, or when the echo names the item by id (the upstream resolves it from its store).
    return fp.alt is None or (echo.get("id") is not None and echo.get("id") == fp.id)
