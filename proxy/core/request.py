"""Parse an app's ``POST /v1/responses`` body and build the upstream ``response.create`` frame.

Pure functions: bytes in, a :class:`ParsedRequest` (or :class:`~proxy.errors.InvalidRequest`)
out. Validation is deliberately shallow: the sidecar rejects only what it cannot forward
faithfully (bodies that are not a JSON object, or whose ``input``/``tools``/flags have the wrong
JSON type); everything else is the upstream's to judge, exactly as it would over HTTP.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.core.items import canonical, item_key
from proxy.errors import InvalidRequest

__all__ = [
    "NON_SETTINGS_FIELDS",
    "TRANSPORT_ONLY_FIELDS",
    "ParsedRequest",
    "Transport",
    "build_frame",
    "choose_transport",
    "parse_request",
]

TRANSPORT_ONLY_FIELDS = frozenset({"stream", "stream_options", "background"})
"""Fields that describe the HTTP exchange, not the model call; never sent in a frame."""

NON_SETTINGS_FIELDS = frozenset(
    {"input", "previous_response_id", "stream", "stream_options", "client_metadata"}
)
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


class Transport(enum.Enum):
    """How a request goes upstream."""

    WS = "websocket"
    HTTP = "http"


@dataclass(slots=True, eq=False)
class ParsedRequest:
    """One app request, parsed once.

    Attributes:
        body: The raw body as received (replayed unchanged over HTTP).
        fields: Every top-level field, parsed.
        items: The input as a list of items (a string input is one user message).
        stream: Whether the app asked for SSE.
        store: The effective ``store`` (default true).
        previous_response_id: The app's own ``previous_response_id``, if any.
        settings_digest: Digest of every field but those in :data:`NON_SETTINGS_FIELDS`.
    """

    body: bytes
    fields: dict[str, Any]
    items: list[Any]
    stream: bool
    store: bool
    previous_response_id: str | None
    settings_digest: bytes
    _keys: list[bytes] | None = field(default=None, repr=False)
    _prefix: dict[int, bytes] = field(default_factory=dict, repr=False)

    @property
    def item_keys(self) -> list[bytes]:
        """:func:`~proxy.core.items.item_key` of every input item, computed once."""
        if self._keys is None:
            self._keys = [item_key(item) for item in self.items]
        return self._keys

    def prefix_digest(self, n: int) -> bytes:
        """Digest of the first ``n`` input items (order-sensitive)."""
        found = self._prefix.get(n)
        if found is None:
            hasher = hashlib.sha256()
            for key in self.item_keys[:n]:
                hasher.update(key)
            found = self._prefix[n] = hasher.digest()[:16]
        return found

    def prefix_digests(self, lengths: set[int]) -> dict[int, bytes]:
        """Digests for several prefix lengths in one pass."""
        wanted = sorted(n for n in lengths if n not in self._prefix and n <= len(self.items))
        if wanted:
            keys = self.item_keys
            hasher = hashlib.sha256()
            done = 0
            for n in wanted:
                for key in keys[done:n]:
                    hasher.update(key)
                done = n
                self._prefix[n] = hasher.copy().digest()[:16]
        return {n: self._prefix[n] for n in lengths if n in self._prefix}


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson refuses integers beyond 64 bits, which are valid JSON; the stdlib parser is
        # the judge of last resort (it also rejects invalid UTF-8 and NaN-free JSON errors).
        try:
            return json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise InvalidRequest(
                f"We could not parse the JSON body of your request. ({exc})"
            ) from None


def settings_digest(fields: dict[str, Any]) -> bytes:
    """Digest of the non-input fields; ``include`` compares as a set (rule 8)."""
    settings = {k: v for k, v in fields.items() if k not in NON_SETTINGS_FIELDS}
    value = canonical(settings)
    include = value.get("include")
    if isinstance(include, list):
        value["include"] = sorted(set(orjson.dumps(v).decode() for v in include))
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).digest()[:16]


def parse_request(body: bytes) -> ParsedRequest:
    """Parse and shallowly validate a ``POST /v1/responses`` body.

    Raises:
        InvalidRequest: the body is not a JSON object, or a field has the wrong JSON type.
    """
    fields = _loads(body)
    if not isinstance(fields, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    for name, types in _TYPES.items():
        value = fields.get(name)
        if value is not None and not isinstance(value, types):
            want = " or ".join(_TYPE_NAMES[t] for t in types)
            raise InvalidRequest(f"Invalid type for '{name}': expected {want}.", param=name)
    raw_input = fields.get("input")
    if raw_input is None:
        items: list[Any] = []
    elif isinstance(raw_input, str):
        items = [{"role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        for index, item in enumerate(raw_input):
            if not isinstance(item, dict):
                raise InvalidRequest(
                    f"Invalid type for 'input[{index}]': expected an object.", param=f"input[{index}]"
                )
        items = raw_input
    else:
        raise InvalidRequest(
            "Invalid type for 'input': expected a string or an array of input items.", param="input"
        )
    tools = fields.get("tools")
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise InvalidRequest(
                    f"Invalid type for 'tools[{index}]': expected an object.", param=f"tools[{index}]"
                )
    store = fields.get("store")
    return ParsedRequest(
        body=body,
        fields=fields,
        items=items,
        stream=fields.get("stream") is True,
        store=store is not False,
        previous_response_id=fields.get("previous_response_id"),
        settings_digest=settings_digest(fields),
    )


def choose_transport(req: ParsedRequest, *, mode: str, frame_budget: int) -> tuple[Transport, str]:
    """Pick WebSocket mode or plain HTTP for a request, with the reason for HTTP.

    ``background`` and ``conversation`` do not exist in WebSocket mode; ``generate`` and
    ``stream_id`` exist *only* there, so an app sending them over HTTP gets the upstream's
    own HTTP answer. A body over the frame budget would be closed with 1009.
    """
    if mode == "http":
        return Transport.HTTP, "mode_http"
    if req.fields.get("background") is True:
        return Transport.HTTP, "background"
    if req.fields.get("conversation") is not None:
        return Transport.HTTP, "conversation"
    if "generate" in req.fields or "stream_id" in req.fields:
        return Transport.HTTP, "ws_only_field"
    # The frame is the body plus a few bytes of "type"; compare with a margin.
    if len(req.body) + 64 > frame_budget:
        return Transport.HTTP, "oversize"
    return Transport.WS, ""


def build_frame(
    req: ParsedRequest,
    *,
    previous_response_id: str | None = None,
    items: list[Any] | None = None,
) -> bytes:
    """The ``response.create`` frame for ``req``.

    Args:
        req: The app's request.
        previous_response_id: The anchor of a continuation; ``None`` keeps the app's own.
        items: The new items of a continuation; ``None`` keeps the app's whole input.
    """
    frame: dict[str, Any] = {"type": "response.create"}
    for key, value in req.fields.items():
        if key not in TRANSPORT_ONLY_FIELDS and key != "type":
            frame[key] = value
    if items is not None:
        frame["input"] = items
    if previous_response_id is not None:
        frame["previous_response_id"] = previous_response_id
    return orjson.dumps(frame)
