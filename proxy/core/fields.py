"""The top-level fields of a request body: which are settings, their digest, their JSON types.

Two requests continue one conversation only with equal settings: every field but the input and
the transport's own (:data:`NON_SETTINGS_FIELDS`), compared by :func:`settings_digest`; the
fields of the HTTP exchange (:data:`TRANSPORT_ONLY_FIELDS`) never go into a frame, and
:func:`dumps` writes the others back.
Validation is deliberately shallow: the sidecar rejects only what it cannot forward faithfully
(fields the sidecar itself relies on with the wrong JSON type, input items that are not
objects); everything else is the upstream's to judge, exactly as it would over HTTP. Both
parses (:func:`proxy.core.request.parse_request`, :func:`proxy.core.fastparse.fast_parse`) apply
these checks.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson

from proxy.core.items import canonical
from proxy.errors import InvalidRequest

__all__ = [
    "NON_SETTINGS_FIELDS",
    "TRANSPORT_ONLY_FIELDS",
    "dumps",
    "settings_digest",
    "validate_fields",
    "validate_items",
]

TRANSPORT_ONLY_FIELDS = frozenset({"stream", "stream_options", "background"})
"""Fields that describe the HTTP exchange, not the model call; never sent in a frame."""

NON_SETTINGS_FIELDS = frozenset({"input", "previous_response_id", "stream", "stream_options", "client_metadata"})
"""Fields left out of the settings comparison (client-echo.md rule 8)."""

_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "instructions": (str, list),
    "previous_response_id": (str,),
    "stream": (bool,),
    "store": (bool,),
    "background": (bool,),
    "tools": (list,),
    "include": (list,),
    "metadata": (dict,),
    "reasoning": (dict,),
    "text": (dict,),
    "stream_options": (dict,),
    "parallel_tool_calls": (bool,),
}
"""JSON types the sidecar itself relies on; ``null`` is accepted for each."""

_TYPE_NAMES = {str: "a string", list: "an array", dict: "an object", bool: "a boolean"}


def dumps(value: Any) -> bytes:
    """orjson, or the stdlib for what orjson cannot write (integers beyond 64 bits)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def settings_digest(fields: dict[str, Any]) -> bytes:
    """Digest of the non-input fields; ``include`` compares as a set (rule 8)."""
    settings = {k: v for k, v in fields.items() if k not in NON_SETTINGS_FIELDS}
    value = canonical(settings)
    include = value.get("include")
    if isinstance(include, list):
        value["include"] = sorted(set(orjson.dumps(v).decode() for v in include))
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).digest()[:16]


def validate_fields(fields: dict[str, Any]) -> None:
    """Check the JSON types of the fields the sidecar relies on.

    Raises:
        InvalidRequest: naming the offending field.
    """
    for name, types in _TYPES.items():
        value = fields.get(name)
        if value is not None and not isinstance(value, types):
            want = " or ".join(_TYPE_NAMES[t] for t in types)
            raise InvalidRequest(f"Invalid type for '{name}': expected {want}.", param=name)
    tools = fields.get("tools")
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise InvalidRequest(f"Invalid type for 'tools[{index}]': expected an object.", param=f"tools[{index}]")


def validate_items(items: list[Any], offset: int = 0) -> None:
    """Every input item must be an object."""
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            where = f"input[{index + offset}]"
            raise InvalidRequest(f"Invalid type for '{where}': expected an object.", param=where)
