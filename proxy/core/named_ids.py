"""Which stored objects a request names, and which a ``/v1`` path addresses: the one reading.

Behind one injected key every object id a request names is checked against its owner
(:mod:`proxy.core.creators`, :mod:`proxy.serve.creator_check`). :func:`read_request` says which
ids a body or relay frame names, for every route and the relay: from the parsed request, never
from a byte search (``"previous\\u005fresponse_id"`` is the same key to every parser), and
refusing an object that repeats a key once the body names an id (one parser keeps the first of
two, another the last).

What is an id: ``previous_response_id`` and ``conversation`` (a string or ``{"id": …}``) at the
top level, and anywhere below it the value (a string, a list of strings, or ``{"id": …}``) of a
key that names a stored object (:data:`ID_KEYS`: ``file_id``, ``file_ids``, ``vector_store_ids``,
``container``, ``input_file_id``, ...) and the ``id`` of an ``item_reference``. ``metadata`` is
the app's own and names nothing. The kind an id is checked as is its prefix's (``file-``,
``vs_``, ``conv_``, ``cntr_``, ``resp_``, ...), else its key's: a ``vs_`` id under ``file_id`` is
still a vector store.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.core.request import ParsedRequest
from proxy.core.request import _loads as loads_body
from proxy.errors import InvalidRequest
from proxy.reasons import ObjectKind

__all__ = [
    "ID_KEYS",
    "PARSE_INLINE",
    "RESPONSES",
    "NamedIds",
    "ObjectRoute",
    "kind_of",
    "noun",
    "object_route",
    "parsed_ids",
    "read_request",
    "request_ids",
    "stateless_route",
]

PARSE_INLINE = 256 * 1024
"""A body or frame whose ids are read is parsed on the event loop up to this size, else in a thread."""

RESPONSES = "responses"
"""The kind of a response id named below the top level (never shared)."""

ID_KEYS: dict[str, str] = {
    "file_id": ObjectKind.FILES,
    "file_ids": ObjectKind.FILES,
    "input_file_id": ObjectKind.FILES,
    "training_file": ObjectKind.FILES,
    "validation_file": ObjectKind.FILES,
    "vector_store_id": ObjectKind.VECTOR_STORES,
    "vector_store_ids": ObjectKind.VECTOR_STORES,
    "container": ObjectKind.CONTAINERS,
    "container_id": ObjectKind.CONTAINERS,
    "conversation": ObjectKind.CONVERSATIONS,
    "conversation_id": ObjectKind.CONVERSATIONS,
    "previous_response_id": RESPONSES,
}
"""Keys whose value names stored objects, and the kind an id without a known prefix is."""

_PREFIXES: tuple[tuple[str, str], ...] = (
    ("file-", ObjectKind.FILES),
    ("vs_", ObjectKind.VECTOR_STORES),
    ("conv_", ObjectKind.CONVERSATIONS),
    ("cntr_", ObjectKind.CONTAINERS),
    ("batch_", ObjectKind.BATCHES),
    ("upload_", ObjectKind.UPLOADS),
    ("chatcmpl-", ObjectKind.CHAT_COMPLETIONS),
    ("resp_", RESPONSES),
)


def kind_of(object_id: str, default: str) -> str:
    """The kind ``object_id`` is by its prefix, else ``default`` (its key's)."""
    for prefix, kind in _PREFIXES:
        if object_id.startswith(prefix):
            return kind
    return default


_TOP_KEYS = ("previous_response_id", "conversation")
"""Top-level members that name a stored object."""
_REFERENCE = "item_reference"
_OPAQUE = frozenset({"metadata"})
"""Members that are the app's own data: no id in them is resolved by the upstream."""
_NAMES = frozenset({*ID_KEYS, _REFERENCE})
_GROUPS: tuple[tuple[bytes, tuple[str, ...]], ...] = (
    (b"file_id", ("file_id", "file_ids", "input_file_id")),
    (b'_file"', ("training_file", "validation_file")),
    (b"vector_store_id", ("vector_store_id", "vector_store_ids")),
    (b"container", ("container", "container_id")),
    (b"item_reference", ("item_reference",)),
)
"""The nested names by a part they share: one search for each part, then one for each whole name
(a quoted string) only where the part was found (a body is searched a few times, not once a name)."""
_CHECKED = frozenset({*_NAMES, "input", "type", "id", "content", "tools"})
"""Keys an object may never repeat (the upstream may keep the first of two, orjson keeps the last);
once a body names an id below its top level, no object of it may repeat any key."""
_ESCAPE = re.compile(rb"u00[5-7]")
"""Part of an escape of ``_`` or a lower-case letter (``\\u005f``): the only way a checked name is
spelled otherwise (searched without its backslash: faster, and a match only costs a closer look)."""
_ESCAPED_NAME = re.compile(rb'"(?:[a-z_]|\\u[0-9a-fA-F]{4})*\\u[0-9a-fA-F]{4}(?:[a-z_]|\\u[0-9a-fA-F]{4})*"')
"""A string of letters and ``_`` with at least one ``\\u`` escape (a checked name spelled so)."""


@dataclass(frozen=True, slots=True)
class NamedIds:
    """The stored objects a request (an HTTP body, a relay frame) names, as the upstream reads them.

    Attributes:
        previous_response_id: The response it continues (top level).
        conversation: The conversation it belongs to (top level: ``"conv_…"`` or ``{"id": "conv_…"}``).
        items: The ids of its ``item_reference`` inputs.
        stream_id: A relay frame's lane (only to address an error event to it).
        objects: Every other id it names below its top level: ``(kind, id, param)``, ``param``
            the top-level member it is in (after a fast parse: of its new items and its other
            members).
    """

    previous_response_id: str | None = None
    conversation: str | None = None
    items: tuple[str, ...] = ()
    stream_id: str | None = None
    objects: tuple[tuple[str, str, str], ...] = ()

    @property
    def names_any(self) -> bool:
        """Whether it names any stored object (:attr:`stream_id` names none): an owner check of
        what names none has nothing to refuse, in every mode."""
        named = self.previous_response_id is not None or self.conversation is not None
        return named or bool(self.items or self.objects)

    def of(self, kind: str) -> tuple[str, ...]:
        """The ids of ``kind`` in :attr:`objects`."""
        return tuple(object_id for k, object_id, _ in self.objects if k == kind)

    @property
    def files(self) -> tuple[str, ...]:
        return self.of(ObjectKind.FILES)

    @property
    def vector_stores(self) -> tuple[str, ...]:
        return self.of(ObjectKind.VECTOR_STORES)


def read_request(raw: bytes) -> NamedIds:
    """The ids named by ``raw``, a body or frame that must be one JSON object (``POST
    /v1/responses`` and its other routes, a relay frame, a JSON body of any other ``/v1`` route).

    Raises:
        InvalidRequest: ``raw`` is not a JSON object (parsed as the upstream parses it: what
            orjson refuses is read by the stdlib parser, and NaN or a lone surrogate refused), or
            repeats a key once it names an id.
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
    return NamedIds(single[0], single[1], outer.items + inner.items, single[2], outer.objects + inner.objects)


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
        items: The input items read for ids (after a fast parse: the new ones; the rest were
            read the same way when the previous turn sent them).
        raw: The bytes the upstream will read.
        start: Only ``raw[start:]`` is new (a fast parse): ``raw[:start]`` is a prefix of a body
            this identity sent before that passed this very check, so a key repeated anywhere
            has a spelling in ``raw[start:]``.

    Raises:
        InvalidRequest: an object repeats a key once the body names an id below its top level
            (or repeats a key that names one): parsers disagree on which of the two counts.
    """
    previous = fields.get("previous_response_id")
    conversation = fields.get("conversation")
    if isinstance(conversation, dict):
        conversation_id = conversation.get("id")
    else:
        conversation_id = conversation
    spelled = _spelled(raw, start)
    refs: list[str] = []
    objects: list[tuple[str, str, str]] = []
    if spelled:
        for key, value in fields.items():
            if key not in _TOP_KEYS and key != "input" and key not in _OPAQUE:
                _walk(value, key, ID_KEYS.get(key), objects, refs)
        _walk(list(items), "input", None, objects, refs)
    if _suspect(fields, raw, start, spelled):
        _refuse_repeats(raw, every=bool(spelled))
    stream = fields.get("stream_id")
    return NamedIds(
        previous if isinstance(previous, str) else None,
        conversation_id if isinstance(conversation_id, str) else None,
        tuple(refs),
        stream if isinstance(stream, str) else None,
        tuple(objects),
    )


def _walk(value: Any, param: str, kind: str | None, objects: list[tuple[str, str, str]], refs: list[str]) -> None:
    """Collect the ids below ``value`` (a member of ``param``; ``kind``: its key names objects
    of that kind) without recursion (a deep body cannot exhaust the stack)."""
    stack: deque[tuple[Any, str | None]] = deque([(value, kind)])
    while stack:
        node, named = stack.popleft()  # breadth first: a list's ids in their order
        if isinstance(node, str):
            if named is not None:
                objects.append((kind_of(node, named), node, param))
        elif isinstance(node, list):
            stack.extend((v, named) for v in node if isinstance(v, (dict, list)) or named is not None)
        elif isinstance(node, dict):
            if named is not None and isinstance(node.get("id"), str):
                objects.append((kind_of(node["id"], named), node["id"], param))
            if node.get("type") == _REFERENCE and isinstance(node.get("id"), str):
                refs.append(node["id"])
            for key, member in node.items():
                if key in _OPAQUE:
                    continue
                if isinstance(member, (dict, list)) or key in ID_KEYS:
                    stack.append((member, ID_KEYS.get(key)))


def _spelled(raw: bytes, start: int) -> frozenset[str]:
    """The checked names ``raw[start:]`` may spell: the nested ones found literally (a whole JSON
    string), and any spelled with a ``\\u00XX`` escape of ``_`` or a letter (the only other way
    to spell them; a top-level name so spelled too). Errs towards more names, never fewer. (A
    ``conversation`` or ``previous_response_id`` below the top level is read when the body is
    walked, but no upstream reads one there: it alone does not make the body walked.)"""
    found = {
        name
        for needle, names in _GROUPS
        if raw.find(needle, start) >= 0
        for name in names
        if raw.find(b'"' + name.encode() + b'"', start) >= 0
    }
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


def _refuse_repeats(raw: bytes, *, every: bool) -> None:
    """Read ``raw`` exactly (every member of every object) and refuse a repeated checked key
    (``every``: any repeated key, since an id below it may be read from either of the two)."""

    def pairs(members: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in members:
            if key in seen and (every or key in _CHECKED):
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
    RESPONSES: "response",
}


def noun(kind: str) -> str:
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
        tail: The path below the object (``("items",)`` of ``/v1/conversations/{id}/items``).
    """

    kind: ObjectKind
    object_id: str | None = None
    creates: bool = False
    lists: bool = False
    tail: tuple[str, ...] = ()


def object_route(method: str, path: str) -> ObjectRoute | None:
    """The stored-object collection a canonical ``/v1`` path addresses, or ``None``."""
    segments = path.split("/")[2:] if path.startswith("/v1/") else []
    for prefix, kind in _COLLECTIONS:
        n = len(prefix)
        if tuple(segments[:n]) != prefix:
            continue
        rest = segments[n:]
        if rest:
            return ObjectRoute(kind, object_id=rest[0], tail=tuple(rest[1:]))
        return ObjectRoute(kind, creates=method == "POST", lists=method == "GET")
    return None


_STATELESS: frozenset[tuple[str, tuple[str, ...]]] = frozenset(
    {
        ("GET", ("models",)),
        ("POST", ("embeddings",)),
        ("POST", ("moderations",)),
        ("POST", ("completions",)),
        ("POST", ("audio", "speech")),
        ("POST", ("audio", "transcriptions")),
        ("POST", ("audio", "translations")),
        ("POST", ("images", "generations")),
        ("POST", ("images", "edits")),
        ("POST", ("images", "variations")),
        ("POST", ("realtime", "client_secrets")),
        ("POST", ("realtime", "sessions")),
        ("POST", ("realtime", "transcription_sessions")),
    }
)
"""``/v1`` routes that name no stored object of a tenant (their answer is computed from the
request, or is the org's catalogue): forwarded behind an injected key though no owner is checked
(a JSON body's ids still are). The realtime ones mint a short-lived credential for one realtime
session, which the app then uses against the upstream directly: a realtime session keeps its
conversation in memory and an ephemeral credential opens no other route, so it reaches no
tenant's stored object."""


def stateless_route(method: str, path: str) -> bool:
    """Whether ``method`` on the canonical ``/v1`` ``path`` names no stored object of a tenant
    (:data:`_STATELESS`, or ``GET /v1/models/{id}``): the only routes besides the known
    collections (:func:`object_route`) and ``/v1/responses`` forwarded behind an injected key
    unless ``identity.shared_objects`` lists ``untracked``. Exact: a route not listed (``GET
    /v1/audio/voices``, ``DELETE /v1/models/{id}``) is not stateless."""
    if not path.startswith("/v1/"):
        return False
    segments = tuple(path.split("/")[2:])
    if (method, segments) in _STATELESS:
        return True
    return method == "GET" and len(segments) == 2 and segments[0] == "models" and segments[1] != ""


def answer_ids(route: ObjectRoute, method: str) -> tuple[tuple[str, ...], ...]:
    """The members of a JSON answer that hold objects a request under an owned object creates
    (recorded for the caller): ``data[*].id`` of ``/v1/conversations/{id}/items`` (items),
    ``file.id`` of ``POST /v1/uploads/{id}/complete``, the output and error files of a batch,
    the ``id`` of ``POST /v1/vector_stores/{id}/files`` and ``/file_batches``. Empty: none."""
    kind, tail = route.kind, route.tail
    if kind is ObjectKind.CONVERSATIONS and tail == ("items",) and method in ("GET", "POST"):
        return (("data", "*", "id"),)
    if kind is ObjectKind.UPLOADS and tail == ("complete",) and method == "POST":
        return (("file", "id"),)
    if kind is ObjectKind.BATCHES and (tail, method) in (((), "GET"), (("cancel",), "POST")):
        return (("output_file_id",), ("error_file_id",))
    if kind is ObjectKind.VECTOR_STORES and tail in (("files",), ("file_batches",)) and method == "POST":
        return (("id",),)
    return ()


def members(answer: Any, paths: tuple[tuple[str, ...], ...]) -> Iterator[str]:
    """The strings at ``paths`` of a parsed answer (``"*"``: every element of a list)."""
    for path in paths:
        nodes: list[Any] = [answer]
        for step in path:
            if step == "*":
                nodes = [v for n in nodes if isinstance(n, list) for v in n]
            else:
                nodes = [n[step] for n in nodes if isinstance(n, dict) and step in n]
        yield from (n for n in nodes if isinstance(n, str))
