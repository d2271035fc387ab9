"""Byte-level facts about a JSON object body, found without parsing the whole of it.

The sidecar's hot path must not re-parse a megabyte of history the app already sent last
turn. Two facts make that possible: clients re-send the earlier input byte for byte
(client-echo.md §1.2), and the *top-level* members of an object can be located exactly with
a search plus a parse of only the small part on one side.

Why the searches are exact: in valid JSON the bytes ``"key"`` followed by ``:`` are always an
object key (a raw ``"`` cannot occur inside a string). Cutting a valid body at a key of depth
*d* leaves *d - 1* unmatched closers on the right and openers on the left, so ``{`` + right
side (or left side + ``}``) parses only when the key is top-level, and the parse must then
reproduce the members we already know. Every function returns ``None`` rather than guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["InputSpan", "blank_back", "blank_forward", "locate_input", "parse_object_part"]

_WS = b" \t\r\n"
_MAX_TRIES = 8
"""Candidate positions checked before giving up (each costs a parse of a small part)."""


@dataclass(frozen=True, slots=True)
class InputSpan:
    """Where the top-level ``input`` array sits in a body.

    Attributes:
        key: Offset of the ``"input"`` key's opening quote.
        start: Offset of the array's ``[``.
        end: Offset of the array's ``]``.
    """

    key: int
    start: int
    end: int


def parse_object_part(part: bytes) -> dict[str, Any] | None:
    """Parse ``part`` as the members of an object (no braces); ``None`` if it is not."""
    try:
        value = orjson.loads(b"{" + part + b"}")
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _key_pattern(key: str) -> bytes | None:
    encoded = orjson.dumps(key)
    # Keys that need escaping could be spelled several ways in the body; do not search.
    return None if b"\\" in encoded else encoded


def blank_back(body: bytes, i: int) -> int:
    """The last non-blank offset at or before ``i`` (-1 if none)."""
    while i >= 0 and body[i] in _WS:
        i -= 1
    return i


def blank_forward(body: bytes, i: int) -> int:
    """The first non-blank offset at or after ``i`` (``len(body)`` if none)."""
    while i < len(body) and body[i] in _WS:
        i += 1
    return i


def _members_after(body: bytes, keys: list[str], fields: dict[str, Any], closing: int) -> int | None:
    """Offset of the ``,`` that ends the member before ``keys[0]`` (a top-level key)."""
    pattern = _key_pattern(keys[0])
    if pattern is None:
        return None
    want = {k: fields[k] for k in keys}
    end = closing
    for _ in range(_MAX_TRIES):
        q = body.rfind(pattern, 0, end)
        if q < 0:
            return None
        end = q
        colon = blank_forward(body, q + len(pattern))
        if colon >= len(body) or body[colon] != ord(":"):
            continue
        comma = blank_back(body, q - 1)
        if comma < 0 or body[comma] != ord(","):
            continue
        if parse_object_part(body[q:closing]) == want:
            return comma
    return None


def locate_input(body: bytes, fields: dict[str, Any]) -> InputSpan | None:
    """Locate the top-level ``input`` array of ``body``, whose parse is ``fields``.

    Costs a search plus parses of the members before and after ``input``, not of ``input``.
    """
    keys = list(fields)
    if not isinstance(fields.get("input"), list):
        return None
    index = keys.index("input")
    closing = blank_back(body, len(body) - 1)
    begin = blank_forward(body, 0)
    if closing <= begin or body[closing] != ord("}") or body[begin] != ord("{"):
        return None
    # The array's closing bracket: the last non-blank byte before the members after it.
    if index + 1 < len(keys):
        comma = _members_after(body, keys[index + 1 :], fields, closing)
        if comma is None:
            return None
        end = blank_back(body, comma - 1)
    else:
        end = blank_back(body, closing - 1)
    if end < 0 or body[end] != ord("]"):
        return None
    # The key: the first top-level "input" whose preceding members are the known ones.
    want = {k: fields[k] for k in keys[:index]}
    start = begin + 1
    for _ in range(_MAX_TRIES):
        q = body.find(b'"input"', start, end)
        if q < 0:
            return None
        start = q + 1
        colon = blank_forward(body, q + 7)
        if colon >= end or body[colon] != ord(":"):
            continue
        array = blank_forward(body, colon + 1)
        if array >= end or body[array] != ord("["):
            continue
        before_end = blank_back(body, q - 1)
        if before_end == begin:
            before: dict[str, Any] | None = {}
        elif body[before_end] == ord(","):
            before = parse_object_part(body[begin + 1 : before_end])
        else:
            continue
        if before == want:
            return InputSpan(q, array, end)
    return None
