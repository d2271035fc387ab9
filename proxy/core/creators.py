"""Who created each response id: the owner registry, and finding ids in bytes that pass by.

Behind one injected key the upstream's store is shared by every tenant of the sidecar, so the
sidecar itself must refuse a tenant that names another tenant's response id (``GET``/``DELETE
/v1/responses/{id}``, ``/input_items``, ``/cancel``, ``previous_response_id``). Every path that
returns a response id records its creator here; every route that names one asks
:meth:`OwnerRegistry.verdict`.

Bounded and fair: at most ``capacity`` ids are remembered, and when one must go it is the
oldest id of the identity that holds the most (a tenant creating ids at a thousand times the
rate of another evicts its own ids, never the other's while it holds more than that one).

:func:`request_ids` is the one reading of which ids a request names (``previous_response_id``,
``conversation``, ``item_reference`` inputs), for every route and the relay: from the parsed
request, never from a byte search (``"previous\\u005fresponse_id"`` is the same key to every
parser), and refusing an object that repeats a key it names an id with (one parser keeps the
first, another the last).

The sniffers find a response id in bytes on their way to the app without parsing or
re-encoding them: the top-level ``id`` of a JSON response body, ``response.id`` of the first
SSE event or of a WebSocket ``response.created`` frame. Each looks at a bounded prefix only.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.reasons import ObjectKind, OwnerVerdict
from proxy.core.request import ParsedRequest
from proxy.core.request import _loads as loads_body
from proxy.errors import InvalidRequest

__all__ = [
    "PARSE_INLINE",
    "SNIFF_LIMIT",
    "NamedIds",
    "ObjectRoute",
    "OwnerRegistry",
    "OwnerVerdict",
    "created_id",
    "member_string",
    "noun",
    "object_route",
    "parsed_ids",
    "read_request",
    "request_ids",
]

PARSE_INLINE = 256 * 1024
"""A body or frame whose ids are read is parsed on the event loop up to this size, else in a thread."""
SNIFF_LIMIT = 256 * 1024
"""Bytes of an answer looked at for its response id; an id found nowhere in them stays unknown
(then, behind an injected key, it is refused: the safe direction)."""


class OwnerRegistry:
    """Response id → the identity digest that created it, bounded, evicting from the heaviest.

    Args:
        capacity: Ids remembered in total.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 1)
        self._owner: dict[str, str] = {}
        self._by_identity: dict[str, OrderedDict[str, None]] = {}
        self._sizes: dict[int, set[str]] = {}
        """Identities by how many ids they hold (finds the heaviest in O(1))."""
        self._heaviest = 0

    @classmethod
    def for_heads(cls, max_heads: int) -> OwnerRegistry:
        """Sized for a head table of ``max_heads``: four ids a head (a head's own, those of
        incomplete and HTTP answers around it), at least 1024."""
        return cls(max(4 * max_heads, 1024))

    def __len__(self) -> int:
        return len(self._owner)

    def __repr__(self) -> str:
        return f"<OwnerRegistry [{len(self._owner)} ids, {len(self._by_identity)} identities]>"

    def held(self, identity: str) -> int:
        """How many ids of ``identity`` are remembered."""
        ids = self._by_identity.get(identity)
        return len(ids) if ids is not None else 0

    def note(self, identity: str, response_id: str) -> None:
        """Remember that ``identity`` created ``response_id``."""
        current = self._owner.get(response_id)
        if current is not None:
            if current == identity:
                self._by_identity[identity].move_to_end(response_id)
                return
            self._remove(response_id)  # an id is created once; the latest word wins
        ids = self._by_identity.setdefault(identity, OrderedDict())
        self._resize(identity, len(ids), len(ids) + 1)
        ids[response_id] = None
        self._owner[response_id] = identity
        while len(self._owner) > self.capacity:
            self._evict()

    def owner_of(self, response_id: str) -> str | None:
        """The identity that created ``response_id``, if remembered."""
        return self._owner.get(response_id)

    def verdict(self, identity: str, response_id: str) -> OwnerVerdict:
        """Whether ``response_id`` is ``identity``'s own, another's, or unknown here."""
        owner = self._owner.get(response_id)
        if owner is None:
            return OwnerVerdict.UNKNOWN
        return OwnerVerdict.OWN if owner == identity else OwnerVerdict.FOREIGN

    def _resize(self, identity: str, old: int, new: int) -> None:
        if old:
            bucket = self._sizes[old]
            bucket.discard(identity)
            if not bucket:
                del self._sizes[old]
        if new:
            self._sizes.setdefault(new, set()).add(identity)
        if new > self._heaviest:
            self._heaviest = new
        while self._heaviest and self._heaviest not in self._sizes:
            self._heaviest -= 1

    def _remove(self, response_id: str) -> None:
        identity = self._owner.pop(response_id)
        ids = self._by_identity[identity]
        del ids[response_id]
        self._resize(identity, len(ids) + 1, len(ids))
        if not ids:
            del self._by_identity[identity]

    def _evict(self) -> None:
        """Drop the oldest id of the identity holding the most (ties: any of them)."""
        identity = next(iter(self._sizes[self._heaviest]))
        oldest = next(iter(self._by_identity[identity]))
        self._remove(oldest)


# -- finding ids in bytes ----------------------------------------------------------------------

_STRUCT = re.compile(rb'["{}\[\]:,]')
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class _NotThere(Exception):
    """The member cannot appear in the rest of the bytes."""


def member_string(data: bytes, path: tuple[str, ...]) -> str | None:
    """The string at ``path`` (``("id",)``, ``("response", "id")``) of the JSON object that
    starts ``data``, or ``None`` when it is not there (or not within ``data``, a prefix).

    Only structure is tokenised (strings are skipped at C speed); nothing is decoded but the
    keys on the path and the value found.
    """
    try:
        return _member_string(data, path)
    except (_NotThere, orjson.JSONDecodeError, IndexError):
        return None


def _member_string(data: bytes, path: tuple[str, ...]) -> str | None:
    stack: list[int] = []  # 0x7B object, 0x5B array
    matched = 0  # path components entered so far; the path's object is at depth matched + 1
    expect_key = False
    hit = False  # the last key read is the next path component
    pos = 0
    while True:
        m = _STRUCT.search(data, pos)
        if m is None:
            return None
        c = data[m.start()]
        pos = m.end()
        if c == 0x22:
            s = _STRING.match(data, m.start())
            if s is None:
                return None  # cut inside a string: the prefix ends here
            pos = s.end()
            if not stack:
                raise _NotThere
            if expect_key:
                hit = len(stack) == matched + 1 and orjson.loads(s.group()) == path[matched]
                expect_key = False
            else:
                if hit and matched == len(path) - 1:
                    value = orjson.loads(s.group())
                    return value if isinstance(value, str) else None
                hit = False
        elif c in (0x7B, 0x5B):
            if hit and c == 0x7B and matched < len(path) - 1:
                matched += 1
            elif not stack and c != 0x7B:
                raise _NotThere
            stack.append(c)
            expect_key, hit = c == 0x7B, False
        elif c in (0x7D, 0x5D):
            if not stack:
                raise _NotThere
            stack.pop()
            if len(stack) < matched + 1:
                raise _NotThere  # the object on the path ended without the member
            expect_key, hit = False, False
        elif c == 0x2C:
            expect_key, hit = bool(stack) and stack[-1] == 0x7B, False
        # ':' changes nothing: the value follows the key read


_CREATED = "response.created"


def created_id(message: str | bytes) -> str | None:
    """``response.id`` of a WebSocket ``response.created`` frame (or of a frame whose head
    carries one), else ``None``; looks at a bounded head only."""
    head = message[:256]
    needle = _CREATED if isinstance(head, str) else _CREATED.encode()
    if needle not in head:  # type: ignore[operator]
        return None
    data = message[:SNIFF_LIMIT]
    raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    return member_string(raw, ("response", "id"))


# -- which ids a request names ------------------------------------------------------------------

_TOP_KEYS = ("previous_response_id", "conversation")
"""Top-level members that name a stored object."""
_REFERENCE = "item_reference"
_NESTED = (_REFERENCE, "file_id", "vector_store_ids")
"""Names below the top level that name a stored object (or make an input a reference)."""
_NAMES = frozenset({*_TOP_KEYS, *_NESTED})
_CHECKED = frozenset({*_TOP_KEYS, "input", "type", "id", "content", "file_id", "tools", "vector_store_ids"})
"""Keys an object may not repeat once its ids are read exactly (the upstream may keep the first
of two, orjson keeps the last)."""
_ESCAPE = re.compile(rb"u00[5-7]")
"""Part of an escape of ``_`` or a lower-case letter (``\\u005f``): the only way a checked name is
spelled otherwise (searched without its backslash: faster, and a match only costs a closer look)."""
_ESCAPED_NAME = re.compile(rb'"(?:[a-z_]|\\u[0-9a-fA-F]{4})*\\u[0-9a-fA-F]{4}(?:[a-z_]|\\u[0-9a-fA-F]{4})*"')
"""A string of letters and ``_`` with at least one ``\\u`` escape (a checked name spelled so)."""


@dataclass(frozen=True, slots=True)
class NamedIds:
    """The stored objects a request (an HTTP body, a relay frame) names, as the upstream reads them.

    Attributes:
        previous_response_id: The response it continues.
        conversation: The conversation it belongs to (``"conv_…"`` or ``{"id": "conv_…"}``).
        items: The ids of its ``item_reference`` inputs.
        stream_id: A relay frame's lane (only to address an error event to it).
        files: The ``file_id`` of its input parts (after a fast parse: of its new items).
        vector_stores: The ``vector_store_ids`` of its ``file_search`` tools.
    """

    previous_response_id: str | None = None
    conversation: str | None = None
    items: tuple[str, ...] = ()
    stream_id: str | None = None
    files: tuple[str, ...] = ()
    vector_stores: tuple[str, ...] = ()


def read_request(raw: bytes) -> NamedIds:
    """The ids named by ``raw``, a body or frame that must be one JSON object.

    Raises:
        InvalidRequest: ``raw`` is not a JSON object (parsed as the upstream parses it: what
            orjson refuses is read by the stdlib parser, and NaN or a lone surrogate refused), or
            repeats a key it names an id with.
    """
    fields = loads_body(raw)
    if not isinstance(fields, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    named = _object_ids(fields, raw)
    nested = fields.get("response")
    if fields.get("type") == "response.create" and isinstance(nested, dict):
        # The nested envelope ({"type": "response.create", "response": {...}}) some WebSocket
        # clients send: an upstream that accepts it reads the ids inside, so they are checked too.
        named = _either(named, _object_ids(nested, raw))
    return named


def _object_ids(fields: dict[str, Any], raw: bytes) -> NamedIds:
    raw_input = fields.get("input")
    return request_ids(fields, raw_input if isinstance(raw_input, list) else (), raw)


def _either(outer: NamedIds, inner: NamedIds) -> NamedIds:
    """The ids of a frame that names them at two levels; two different values of one id are
    refused (which one an upstream reads is not ours to guess)."""
    single: list[str | None] = []
    for name, a, b in (
        ("previous_response_id", outer.previous_response_id, inner.previous_response_id),
        ("conversation", outer.conversation, inner.conversation),
        ("stream_id", outer.stream_id, inner.stream_id),
    ):
        if a is not None and b is not None and a != b:
            raise InvalidRequest(f"The frame names two different values of '{name}'.", param=name)
        single.append(a if a is not None else b)
    return NamedIds(
        single[0],
        single[1],
        outer.items + inner.items,
        single[2],
        outer.files + inner.files,
        outer.vector_stores + inner.vector_stores,
    )


def parsed_ids(req: ParsedRequest) -> NamedIds:
    """The ids a ``POST /v1/responses`` names, read from the parse already made (after a fast
    parse: only its new bytes and items; the rest passed this check when they were sent)."""
    if req.base is not None and req.tail is not None:
        return request_ids(req.fields, req.tail, req.body, req.base.raw_len)
    return request_ids(req.fields, req.items, req.body)


def request_ids(fields: dict[str, Any], items: Sequence[Any], raw: bytes, start: int = 0) -> NamedIds:
    """Which ids a request names: the one decision every route and the relay use.

    Args:
        fields: ``raw`` parsed (its top-level members).
        items: The input items whose ``item_reference`` ids are read (after a fast parse: the
            new ones; the rest were read the same way when the previous turn sent them).
        raw: The bytes the upstream will read.
        start: Only ``raw[start:]`` is new (a fast parse): ``raw[:start]`` is a prefix of a body
            this identity sent before that passed this very check, so a key repeated anywhere
            has a spelling in ``raw[start:]``.

    Raises:
        InvalidRequest: an object repeats a key it names an id with (or that says which member
            is an ``item_reference``): parsers disagree on which of the two counts.
    """
    previous = fields.get("previous_response_id")
    conversation = fields.get("conversation")
    if isinstance(conversation, dict):
        conversation_id = conversation.get("id")
    else:
        conversation_id = conversation
    spelled = _spelled(raw, start)
    refs: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    if _REFERENCE in spelled:
        refs = tuple(
            str(item["id"])
            for item in items
            if isinstance(item, dict) and item.get("type") == _REFERENCE and isinstance(item.get("id"), str)
        )
    if "file_id" in spelled:
        files = tuple(_file_ids(items))
    if _suspect(fields, raw, start, spelled):
        _refuse_repeats(raw)
    stream = fields.get("stream_id")
    return NamedIds(
        previous if isinstance(previous, str) else None,
        conversation_id if isinstance(conversation_id, str) else None,
        refs,
        stream if isinstance(stream, str) else None,
        files,
        tuple(_store_ids(fields.get("tools"))),
    )


def _file_ids(items: Sequence[Any]) -> Iterator[str]:
    """The ``file_id`` of every content part of ``items`` (``input_file``, ``input_image``)."""
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("file_id"), str):
                    yield part["file_id"]


def _store_ids(tools: Any) -> Iterator[str]:
    """The ``vector_store_ids`` of every ``file_search`` tool."""
    if isinstance(tools, list):
        for tool in tools:
            ids = tool.get("vector_store_ids") if isinstance(tool, dict) else None
            if isinstance(ids, list):
                yield from (i for i in ids if isinstance(i, str))


def _spelled(raw: bytes, start: int) -> frozenset[str]:
    """The checked names ``raw[start:]`` may spell: the nested ones found literally, and any spelled
    with a ``\\u00XX`` escape of ``_`` or a letter (the only other way to spell them). Errs
    towards more names, never fewer."""
    found = {name for name in _NESTED if raw.find(name.encode(), start) >= 0}
    if _ESCAPE.search(raw, start) is not None:
        for match in _ESCAPED_NAME.finditer(raw, start):
            try:
                name = orjson.loads(match.group())
            except orjson.JSONDecodeError:
                return _NAMES  # an escape that does not decode alone: any name, to be safe
            if name in _NAMES:
                found.add(name)
    return frozenset(found)


def _suspect(fields: dict[str, Any], raw: bytes, start: int, spelled: frozenset[str]) -> bool:
    """Whether ``raw`` may repeat a checked key: cheap byte searches that can only err towards
    ``True`` (the exact reading then decides)."""
    if isinstance(fields.get("conversation"), dict) or spelled:
        return True  # a conversation's "id", or a nested name (or an escaped one) may be repeated
    for key in _TOP_KEYS:
        if key not in fields:
            continue  # never at the top level (any spelling of it would be a member)
        needle = b'"' + key.encode() + b'"'
        if start:
            if raw.find(needle, start) >= 0:
                return True
        elif raw.count(needle) >= 2:
            return True
    return False


def _refuse_repeats(raw: bytes) -> None:
    """Read ``raw`` exactly (every member of every object) and refuse a repeated checked key."""

    def pairs(members: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in members:
            if key in seen and key in _CHECKED:
                raise InvalidRequest(
                    f"The request body repeats the key '{key}' in one object; send each key once.", param=key
                )
            seen.add(key)
        return dict(members)

    try:
        json.loads(raw.decode("utf-8", "surrogatepass"), object_pairs_hook=pairs)
    except InvalidRequest:
        raise
    except (ValueError, RecursionError) as exc:  # read by orjson or the stdlib already: not expected
        raise InvalidRequest(f"We could not parse the JSON body of your request. ({exc})") from None


# -- routes of other stored objects ------------------------------------------------------------

_COLLECTIONS: tuple[tuple[tuple[str, ...], ObjectKind], ...] = (
    (("conversations",), ObjectKind.CONVERSATIONS),
    (("files",), ObjectKind.FILES),
    (("vector_stores",), ObjectKind.VECTOR_STORES),
    (("chat", "completions"), ObjectKind.CHAT_COMPLETIONS),
    (("batches",), ObjectKind.BATCHES),
    (("containers",), ObjectKind.CONTAINERS),
    (("uploads",), ObjectKind.UPLOADS),
)
"""``/v1/<these>``: collections of stored objects an app creates (``POST``), lists (``GET``) and
names (``/v1/<these>/{id}...``)."""
_NOUNS = {
    ObjectKind.CONVERSATIONS: "conversation",
    ObjectKind.ITEMS: "item",
    ObjectKind.FILES: "file",
    ObjectKind.VECTOR_STORES: "vector store",
    ObjectKind.CHAT_COMPLETIONS: "chat completion",
    ObjectKind.BATCHES: "batch",
    ObjectKind.CONTAINERS: "container",
    ObjectKind.UPLOADS: "upload",
}


def noun(kind: ObjectKind) -> str:
    """One object of ``kind``, in words (``vector store``)."""
    return _NOUNS[kind]


@dataclass(frozen=True, slots=True)
class ObjectRoute:
    """What a ``/v1`` request does to a collection of stored objects.

    Attributes:
        kind: The collection.
        object_id: The object the path names (``/v1/files/{id}/content``), if any.
        creates: ``POST`` to the collection: the answer's ``id`` is a new object.
        lists: ``GET`` of the collection: every object of the key, whoever created it.
    """

    kind: ObjectKind
    object_id: str | None = None
    creates: bool = False
    lists: bool = False


def object_route(method: str, path: str) -> ObjectRoute | None:
    """The stored-object collection a canonical ``/v1`` path addresses, or ``None``."""
    segments = path.split("/")[2:] if path.startswith("/v1/") else []
    for prefix, kind in _COLLECTIONS:
        n = len(prefix)
        if tuple(segments[:n]) != prefix:
            continue
        rest = segments[n:]
        if rest:
            return ObjectRoute(kind, object_id=rest[0])
        return ObjectRoute(kind, creates=method == "POST", lists=method == "GET")
    return None
