"""Item canonicalisation and echo matching (client-echo.md §4).

Two questions are asked of items, and they get different answers on purpose:

* *Is this the same input item the app sent last time?* Clients re-send their earlier input
  unchanged (client-echo.md §1.2), so :func:`item_key` compares everything, after the generic
  rules 1-4 (parsed values, ``null`` = absent, ``async_`` = ``async``, client-added keys
  stripped, string content = one text part).
* *Is this the client's echo of an output item the upstream produced?* Every client rebuilds
  echoed output in its own shape, so :func:`fingerprint` keeps the upstream item's
  :func:`projection`: every field the model sees, compared as a value, and only the fields it
  cannot see left out (the field-by-field audit: docs/fidelity.md). An absent
  field differs from a present one: a ``phase``-less echo of a ``commentary`` message is
  another message. :func:`echo_matches` compares an echo against it; :func:`phase_dropped`
  says whether the echo is that message minus its ``phase`` (``matching.tolerate: [phase]``).

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
    "phase_dropped",
    "projection",
]

_CLIENT_KEYS = frozenset({"internal_chat_message_metadata_passthrough", "parsed_arguments"})
"""Keys some clients add to items they echo (client-echo.md rule 4)."""

_UNREAD_PART_KEYS = frozenset({"parsed", "prompt_cache_breakpoint"})
"""Keys of an input content part left out of the prefix comparison: ``parsed`` is a client's own
(rule 4), ``prompt_cache_breakpoint`` a caching hint the model does not read (docs/fidelity.md):
clients that move one breakpoint to the newest message change an old item in that key only."""

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
                {k: v for k, v in p.items() if k not in _UNREAD_PART_KEYS} if isinstance(p, dict) else p for p in parts
            ]
    return value


def item_key(item: Mapping[str, Any]) -> bytes:
    """Digest of an input item for the *prefix* comparison: :func:`input_view`, digested."""
    return digest(_dumps(input_view(item)))


@dataclass(frozen=True, slots=True)
class OutputFingerprint:
    """The projection of one upstream output item, kept as digests.

    Attributes:
        kind: ``message``, ``function_call``, ``custom_tool_call``, ``reasoning`` or ``other``.
        id: The item's id, compared only when the echo carries one.
        main: Digest of :func:`projection`: what every echo must reproduce.
        alt: A reasoning item's ``encrypted_content`` digest, or ``None``.
        phaseless: For a message with a ``phase``, the digest of its projection without it
            (an echo that dropped the phase, accepted only as a tolerance); else ``None``.
    """

    kind: str
    id: str | None
    main: bytes
    alt: bytes | None = None
    phaseless: bytes | None = None


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


def _kind(item: Mapping[str, Any]) -> str:
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"
    return kind if isinstance(kind, str) else "other"


def _str_id(item: Mapping[str, Any]) -> str | None:
    value = item.get("id")
    return value if isinstance(value, str) else None


_UNSEEN = ("id", "status", "type")
"""Fields of every item the model does not read: ``id`` is a handle (compared on its own, when
the echo has it), ``status`` a record of generation (the OpenAPI description: "populated when
items are returned via API"), ``type`` the kind (compared on its own)."""
_UNSEEN_PART = ("logprobs", "parsed", "prompt_cache_breakpoint")
"""Fields of a content part the model does not read: ``logprobs`` are the sampler's report on
the text, ``parsed`` a client's own (rule 4), ``prompt_cache_breakpoint`` a caching hint."""


def _part(part: Any) -> Any:
    if not isinstance(part, dict):
        return {"$bad": part}
    out = {k: v for k, v in part.items() if k not in _UNSEEN_PART}
    if out.get("annotations") == []:
        del out["annotations"]  # an empty list of annotations is none
    return out


def projection(item: Mapping[str, Any]) -> dict[str, Any]:
    """What the model sees of an item, by kind, after rules 1-4 (the audit table of
    docs/fidelity.md). Symmetric: an upstream item and its echo are projected alike.

    * every field but ``id``, ``status`` and ``type`` (compared apart), as a value: ``phase``,
      ``annotations``, ``namespace``, ``caller``, reasoning ``content`` and any field this
      code does not know are compared, absent differing from present;
    * message: string ``content`` = one text part (``output_text`` for the assistant);
      per part, ``logprobs`` and ``parsed`` left out, empty ``annotations`` = none;
    * function_call: ``arguments`` as parsed JSON (blank = ``{}``);
    * reasoning: ``encrypted_content`` left to :func:`echo_matches` (an echo may name the item
      by id instead); an empty ``content`` = none.
    """
    value = canonical(item)
    if not isinstance(value, dict):
        return {"$bad": value}
    kind = _kind(item)
    out = {k: v for k, v in value.items() if k not in _UNSEEN}
    if kind == "message":
        parts = _message_parts(value)
        out["content"] = [_part(p) for p in (parts if isinstance(parts, list) else [parts])]
    elif kind == "function_call":
        out["arguments"] = _args_value(value.get("arguments"))
    elif kind == "reasoning":
        out.pop("encrypted_content", None)
        if out.get("content") == []:
            del out["content"]
    else:
        out["type"] = value.get("type")
    return out


def fingerprint(item: Mapping[str, Any], seen: dict[str, Any] | None = None) -> OutputFingerprint:
    """Project an upstream output item (as in ``response.output``) for echo matching
    (``seen``: its :func:`projection`, when the caller has it)."""
    kind = _kind(item)
    if seen is None:
        seen = projection(item)
    alt = phaseless = None
    if kind == "reasoning" and item.get("encrypted_content") is not None:
        alt = digest(_dumps(item["encrypted_content"]))
    if kind == "message" and "phase" in seen:
        phaseless = digest(_dumps({k: v for k, v in seen.items() if k != "phase"}))
    return OutputFingerprint(kind, _str_id(item), digest(_dumps(seen)), alt, phaseless)


def _is_reference(echo: Mapping[str, Any]) -> bool:
    kind = echo.get("type")
    if kind == "item_reference":
        return True
    # ``{"id": X}`` alone is the short form of an item reference.
    return kind is None and "role" not in echo and set(echo) - {"type"} == {"id"}


def _same_item(fp: OutputFingerprint, echo: Any) -> bool | None:
    """The checks before the projection: ``True``/``False`` when they decide, else ``None``."""
    if not isinstance(echo, dict):
        return False
    echo_id = echo.get("id")
    if _is_reference(echo):
        return fp.id is not None and echo_id == fp.id
    if echo_id is not None and echo_id != fp.id:
        return False
    if _kind(echo) != fp.kind:
        return False
    if fp.kind == "reasoning" and not _reasoning_content_ok(fp, echo):
        return False
    return None


def echo_matches(fp: OutputFingerprint, echo: Any) -> bool:
    """Whether ``echo`` (an item the app sent) is an echo of the output item behind ``fp``:
    everything the model sees equal (a dropped ``phase`` is a difference: see
    :func:`phase_dropped`)."""
    decided = _same_item(fp, echo)
    if decided is not None:
        return decided
    return digest(_dumps(projection(echo))) == fp.main


def phase_dropped(fp: OutputFingerprint, echo: Any) -> bool:
    """Whether ``echo`` is the message behind ``fp`` but for the ``phase`` it left out (the
    ``phase`` tolerance: the model would see a ``phase`` the app did not send)."""
    if fp.phaseless is None or not isinstance(echo, dict) or echo.get("phase") is not None:
        return False
    if _same_item(fp, echo) is not None:
        return False
    return digest(_dumps(projection(echo))) == fp.phaseless


def _reasoning_content_ok(fp: OutputFingerprint, echo: Mapping[str, Any]) -> bool:
    enc = echo.get("encrypted_content")
    if enc is not None:
        return digest(_dumps(enc)) == fp.alt
    # No encrypted content in the echo: acceptable only when the upstream item had none
    # either, or when the echo names the item by id (the upstream resolves it from its store).
    return fp.alt is None or (echo.get("id") is not None and echo.get("id") == fp.id)
