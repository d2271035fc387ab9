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
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.core.items import canonical, item_key
from proxy.core.rawjson import InputSpan, locate_input
from proxy.core.reasons import PassthroughReason
from proxy.errors import InvalidRequest, UnsupportedRequest

__all__ = [
    "Base",
    "SettingsBlock",
    "NON_SETTINGS_FIELDS",
    "TRANSPORT_ONLY_FIELDS",
    "ParsedRequest",
    "Transport",
    "build_frame",
    "choose_transport",
    "http_unsupported",
    "make_request",
    "parse_request",
    "validate_fields",
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


class Transport(enum.Enum):
    """How a request goes upstream."""

    WS = "websocket"
    HTTP = "http"


@dataclass(frozen=True, slots=True)
class Base:
    """What a fast parse knows about the byte-identical prefix it skipped.

    Attributes:
        anchor: The head whose request body the new body extends byte for byte.
        count: Input items in that prefix (parsed last turn, not this one).
        input_state: SHA-256 state over those items' keys (see ``ParsedRequest.prefix_digest``).
        raw_state: SHA-256 state over ``body[:raw_len]``.
        raw_len: Length of the prefix: it ends right after the prefix's last input item.
    """

    anchor: Hashable
    count: int
    input_state: Any
    raw_state: Any
    raw_len: int


@dataclass(slots=True, eq=False)
class SettingsBlock:
    """The non-input members of a body, processed once and reused while later bodies carry the
    very same bytes around their input (the steady state of an agent loop).

    Blocks are shared: every conversation whose bodies hold the same settings bytes uses one
    block (:meth:`of` keeps a bounded table of them), so a head costs a reference, not a copy
    of the instructions and tools.

    Attributes:
        before: Fields before ``input`` (body order).
        after: Fields after the ``input`` array.
        digest: :func:`settings_digest` of both.
        huge: Whether a value may be an integer beyond 64 bits (see :func:`build_frame`).
    """

    before: dict[str, Any]
    after: dict[str, Any]
    digest: bytes
    huge: bool
    _members: tuple[bytes, bytes] | None = None

    @classmethod
    def of(cls, req: ParsedRequest) -> SettingsBlock | None:
        """The block of ``req`` (its fast parse's, or the shared one for the same settings bytes);
        ``None`` without a located input array."""
        if req.settings is not None:
            return req.settings
        span = req.span
        if span is None or "input" not in req.fields:
            return None
        body = memoryview(req.body)
        key = (
            req.settings_digest,
            hashlib.blake2b(body[: span.key]).digest(),
            hashlib.blake2b(body[span.end :]).digest(),
        )
        block = _BLOCKS.get(key)
        if block is not None:
            return block
        before: dict[str, Any] = {}
        after: dict[str, Any] = {}
        side = before
        for name, value in req.fields.items():
            if name == "input":
                side = after
            else:
                side[name] = value
        huge = _has_huge_float(list(before.values())) or _has_huge_float(list(after.values()))
        block = cls(before, after, req.settings_digest, huge)
        if len(_BLOCKS) >= _MAX_BLOCKS:
            del _BLOCKS[next(iter(_BLOCKS))]
        _BLOCKS[key] = block
        return block

    def fields(self, items: list[Any]) -> dict[str, Any]:
        """Every field in body order, ``input`` set to ``items``."""
        out = dict(self.before)
        out["input"] = items
        out.update(self.after)
        return out

    def members(self) -> tuple[bytes, bytes]:
        """The frame's members before and after ``input`` (serialised once): no transport-only
        fields, no ``type``/``stream_id``/``previous_response_id``."""
        if self._members is None:
            skip = TRANSPORT_ONLY_FIELDS | {"type", "stream_id", "previous_response_id"}
            head = _dumps({k: v for k, v in self.before.items() if k not in skip})[1:-1]
            tail = _dumps({k: v for k, v in self.after.items() if k not in skip})[1:-1]
            self._members = (head, tail)
        return self._members


_BLOCKS: dict[tuple[bytes, bytes, bytes], SettingsBlock] = {}
"""Shared blocks by (settings digest, hashes of the bytes before and after the input array)."""
_MAX_BLOCKS = 256
"""Distinct settings blocks kept (oldest first out): apps have a handful of agent configurations."""


@dataclass(slots=True, eq=False)
class ParsedRequest:
    """One app request, parsed once.

    A *fast* parse (``base`` set) read only the bytes after the prefix that the previous turn
    already sent: ``tail`` holds the input items after that prefix. What costs work in
    proportion to the history is a method that says so: :meth:`all_items` (after a fast parse:
    parses the skipped prefix of the input array, once) and :meth:`item_keys`; the cheap views
    (:attr:`n_items`, :meth:`items_from`, :meth:`prefix_digests` for lengths the fast parse
    covers) never parse anything.

    Attributes:
        body: The raw body as received (replayed unchanged over HTTP).
        fields: Every top-level field except ``input``, in body order, with ``input`` kept in
            place as a marker (its value is the whole input for a full parse, the tail for a
            fast one).
        stream: Whether the app asked for SSE.
        store: The effective ``store`` (default true).
        previous_response_id: The app's own ``previous_response_id``, if any.
        settings_digest: Digest of every field but those in :data:`NON_SETTINGS_FIELDS`.
        span: Where the ``input`` array sits in ``body`` (``None``: string input or unknown).
        base: Set by a fast parse.
        tail: Input items after ``base``'s prefix (fast parse), else ``None``.
        settings: The previous turn's :class:`SettingsBlock`, when this body carries the same
            bytes around its input (fast parse of a hot head): nothing of it was parsed again.
        prefix_parses: How many times the skipped prefix had to be parsed (0 on the hot path).
    """

    body: bytes
    fields: dict[str, Any]
    stream: bool
    store: bool
    previous_response_id: str | None
    settings_digest: bytes
    span: InputSpan | None = None
    base: Base | None = None
    tail: list[Any] | None = None
    settings: SettingsBlock | None = None
    prefix_parses: int = 0
    _items: list[Any] | None = field(default=None, repr=False)
    _keys: list[bytes] | None = field(default=None, repr=False)
    _partial: list[bytes] = field(default_factory=list, repr=False)
    _prefix: dict[int, bytes] = field(default_factory=dict, repr=False)
    _count: int | None = field(default=None, repr=False)
    """Input items of a full parse whose items were released."""
    _tail_cache: list[bytes] | None = field(default=None, repr=False)

    def all_items(self) -> list[Any]:
        """The whole input as a list of items (a string input is one user message).

        Free after a full parse. After a fast parse it parses the skipped prefix of the input
        array (only that: not the settings, not the tail) once, and counts it in
        :attr:`prefix_parses`; the hot path never needs it (see :meth:`items_from`).
        """
        if self._items is None:
            self._items = self._parse_prefix() + (self.tail or [])
        return self._items

    @property
    def items(self) -> list[Any]:
        """:meth:`all_items` (kept for callers that read it as an attribute; prefer the method)."""
        return self.all_items()

    def _parse_prefix(self) -> list[Any]:
        base, span = self.base, self.span
        self.prefix_parses += 1
        if base is not None and span is not None:
            try:
                found = orjson.loads(b"".join((memoryview(self.body)[span.start : base.raw_len], b"]")))
            except orjson.JSONDecodeError:
                found = None
            if isinstance(found, list) and len(found) == base.count:
                return found
        raw_input = parse_request(self.body).all_items()  # cannot happen for a valid fast parse
        return raw_input[: len(raw_input) - len(self.tail or [])]

    def items_from(self, n: int) -> tuple[list[Any], int, int]:
        """``(items, m, skipped)`` with ``items[m:]`` the input items from index ``n`` on and
        ``skipped`` the items before ``items[0]``: the fast parse's tail when ``n`` is within it
        (nothing parsed), else :meth:`all_items`."""
        if self._items is None and self.base is not None and self.tail is not None and n >= self.base.count:
            return self.tail, n - self.base.count, self.base.count
        return self.all_items(), n, 0

    @property
    def adoptable(self) -> bool:
        """A stored new conversation: its answer over plain HTTP can become its head."""
        return self.store and self.previous_response_id is None

    @property
    def n_items(self) -> int:
        """Number of input items, without a full parse."""
        if self.base is not None and self.tail is not None:
            return self.base.count + len(self.tail)
        if self._items is None and self._count is not None:
            return self._count
        return len(self.all_items())

    def item_keys(self) -> list[bytes]:
        """:func:`~proxy.core.items.item_key` of every input item, computed once (canonicalises the
        whole history: :meth:`input_state` and :meth:`prefix_digests` avoid it after a fast parse)."""
        keys = self._keys
        return keys if keys is not None else self._all_keys()

    def _all_keys(self) -> list[bytes]:
        # Not inline in item_keys: after ``if self._keys is None`` mypy keeps the attribute narrowed
        # to None across the warm_keys() call, and the compiled build, trusting that, raised
        # TypeError on the list it then held.
        self.warm_keys(len(self.all_items()))
        assert self._keys is not None
        return self._keys

    def warm_keys(self, count: int) -> bool:
        """Compute up to ``count`` more item keys; ``True`` once all are known.

        Lets an I/O shell spread the canonicalisation of a huge full-history body over
        several event-loop turns instead of stalling other streams.
        """
        if self._keys is not None:
            return True
        items = self.all_items()
        done = self._partial
        for item in items[len(done) : len(done) + count]:
            done.append(item_key(item))
        if len(done) < len(items):
            return False
        self._keys = done
        return True

    def release_items(self) -> bool:
        """Let go of the parsed input of a full parse once its item keys are known (the
        parsed copy is about as large as the body). The frame splices the body's bytes and
        heads need only the keys; anything that still asks for :attr:`items` re-parses."""
        if self.base is not None or self._keys is None or self.span is None or self._items is None:
            return False
        self._count = len(self._items)
        self._items = None
        if isinstance(self.fields.get("input"), list):
            self.fields["input"] = None  # the marker stays in place, its value goes
        return True

    def tail_keys(self) -> list[bytes]:
        """Item keys of the fast parse's tail, computed once per request."""
        if self._tail_cache is None:
            self._tail_cache = [item_key(item) for item in self.tail or []]
        return self._tail_cache

    def input_state(self) -> Any:
        """SHA-256 state over the keys of every input item (cheap after a fast parse)."""
        if self.base is not None and self.tail is not None:
            hasher = self.base.input_state.copy()
            for key in self.tail_keys():
                hasher.update(key)
            return hasher
        hasher = hashlib.sha256()
        for key in self.item_keys():
            hasher.update(key)
        return hasher

    def prefix_digest(self, n: int) -> bytes:
        """Digest of the first ``n`` input items (order-sensitive)."""
        return self.prefix_digests({n})[n]

    def prefix_digests(self, lengths: set[int]) -> dict[int, bytes]:
        """Digests for several prefix lengths in one pass.

        After a fast parse, lengths from the skipped prefix's on extend its carried state with
        the tail's keys (no parse); shorter ones need :meth:`item_keys` of the whole history.
        """
        wanted = sorted(n for n in lengths if n not in self._prefix and n <= self.n_items)
        base = self.base if self._keys is None else None
        if wanted and base is not None and self.tail is not None and wanted[0] >= base.count:
            hasher = base.input_state.copy()
            keys = self.tail_keys()
            done = base.count
            for n in wanted:
                for key in keys[done - base.count : n - base.count]:
                    hasher.update(key)
                done = n
                self._prefix[n] = hasher.copy().digest()[:16]
        elif wanted:
            keys = self.item_keys()
            hasher = hashlib.sha256()
            done = 0
            for n in wanted:
                for key in keys[done:n]:
                    hasher.update(key)
                done = n
                self._prefix[n] = hasher.copy().digest()[:16]
        return {n: self._prefix[n] for n in lengths if n in self._prefix}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson refuses lone surrogate escapes ("\ud800"), which the JSON grammar allows but
        # no upstream can carry as text; the stdlib parser tells a grammar error from those.
        try:
            value = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("The request body contains invalid Unicode (a lone surrogate).") from None
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise InvalidRequest(f"We could not parse the JSON body of your request. ({exc})") from None
        return value


def _dumps(value: Any) -> bytes:
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


def parse_request(body: bytes) -> ParsedRequest:
    """Parse and shallowly validate a ``POST /v1/responses`` body.

    Raises:
        InvalidRequest: the body is not a JSON object, or a field has the wrong JSON type.
    """
    fields = _loads(body)
    if not isinstance(fields, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    validate_fields(fields)
    raw_input = fields.get("input")
    if raw_input is None:
        items: list[Any] = []
    elif isinstance(raw_input, str):
        items = [{"role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        validate_items(raw_input)
        items = raw_input
    else:
        raise InvalidRequest("Invalid type for 'input': expected a string or an array of input items.", param="input")
    span = locate_input(body, fields) if isinstance(raw_input, list) and raw_input else None
    return make_request(body, fields, span, items=items)


def make_request(
    body: bytes,
    fields: dict[str, Any],
    span: InputSpan | None,
    *,
    items: list[Any] | None = None,
    base: Base | None = None,
    tail: list[Any] | None = None,
    settings: SettingsBlock | None = None,
) -> ParsedRequest:
    """Build a :class:`ParsedRequest` from validated fields (full or fast parse); with
    ``settings`` (same bytes as last turn's) its digest is reused, not recomputed."""
    return ParsedRequest(
        body=body,
        fields=fields,
        stream=fields.get("stream") is True,
        store=fields.get("store") is not False,
        previous_response_id=fields.get("previous_response_id"),
        settings_digest=settings.digest if settings is not None else settings_digest(fields),
        span=span,
        base=base,
        tail=tail,
        settings=settings,
        _items=items,
    )


def choose_transport(req: ParsedRequest, *, mode: str, frame_budget: int) -> tuple[Transport, PassthroughReason | None]:
    """Pick WebSocket mode or plain HTTP for a request, with the reason for HTTP.

    ``background`` and ``conversation`` do not exist in WebSocket mode; ``generate`` and
    ``stream_id`` exist *only* there, so they never travel in a frame built from an HTTP body
    (the handler refuses ``generate`` itself: over HTTP it would be a billed generation).
    A body over the frame budget would be closed with 1009.
    """
    if mode == "http":
        return Transport.HTTP, PassthroughReason.MODE_HTTP
    if req.fields.get("background") is True:
        return Transport.HTTP, PassthroughReason.BACKGROUND
    if req.fields.get("conversation") is not None:
        return Transport.HTTP, PassthroughReason.CONVERSATION
    if "generate" in req.fields or "stream_id" in req.fields:
        return Transport.HTTP, PassthroughReason.WS_ONLY_FIELD
    # The frame is the body plus a few bytes of "type"; compare with a margin.
    if len(req.body) + 64 > frame_budget:
        return Transport.HTTP, PassthroughReason.OVERSIZE
    return Transport.WS, None


def http_unsupported(req: ParsedRequest) -> UnsupportedRequest | None:
    """What a request going over plain HTTP must not ask for: a warm-up (``generate``) there is
    a real, billed generation or a 400 (pitfall 18), so the sidecar refuses it itself."""
    if "generate" in req.fields:
        return UnsupportedRequest("The 'generate' parameter is only supported in WebSocket mode.", param="generate")
    return None


def _has_huge_float(value: Any) -> bool:
    """Whether ``value`` holds an integral float of 2**63 or more: possibly an integer beyond 64
    bits that orjson parsed as a float, which must reach the upstream with its exact digits."""
    if isinstance(value, float):
        return abs(value) >= 2.0**63 and value.is_integer()
    if isinstance(value, dict):
        return any(_has_huge_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_huge_float(v) for v in value)
    return False


def build_frame(
    req: ParsedRequest,
    *,
    previous_response_id: str | None = None,
    items: list[Any] | None = None,
    stream_id: str | None = None,
) -> bytes:
    """The ``response.create`` frame for ``req``.

    A full send splices the app's ``input`` array bytes in unchanged (no re-serialisation of
    the history); only the small settings around it are written anew. ``items`` (the new items
    of a continuation) is always a suffix of the app's input.

    Args:
        req: The app's request.
        previous_response_id: The anchor of a continuation; ``None`` keeps the app's own.
        items: The new items of a continuation; ``None`` keeps the app's whole input.
        stream_id: The lane's ``stream_id`` (``None``: the default lane).
    """
    block = req.settings
    if items is not None and block is not None and not block.huge and not _has_huge_float(items):
        # The settings were serialised once, when their block was first used.
        return _spliced(
            block,
            items,
            previous_response_id if previous_response_id is not None else req.previous_response_id,
            stream_id,
        )
    # The frame splices the body's own bytes: a full parse's items may go first.
    req.release_items()
    frame = _frame(req, req.fields, previous_response_id, items, stream_id)
    # Only what is written anew is checked: a spliced input array keeps the app's own digits.
    written = items if items is not None else (req.fields.get("input") if req.span is None else None)
    others = [v for k, v in req.fields.items() if k != "input"]
    if _has_huge_float(others) or _has_huge_float(written):
        # Rare: re-read the body with the stdlib parser, which keeps every integer exact.
        exact = json.loads(req.body.decode("utf-8"))
        if items is not None:
            raw_input = exact.get("input")
            exact_items = [{"role": "user", "content": raw_input}] if isinstance(raw_input, str) else raw_input
            items = exact_items[len(exact_items) - len(items) :] if items else []
        frame = _frame(req, exact, previous_response_id, items, stream_id)
    return frame


def _spliced(
    block: SettingsBlock, items: list[Any], previous_response_id: str | None, stream_id: str | None = None
) -> bytes:
    """What :func:`_frame` writes for ``items``, from the block's serialised members."""
    head, tail = block.members()
    parts = [b'{"type":"response.create"']
    if stream_id is not None:
        parts += (b',"stream_id":', _dumps(stream_id))
    if head:
        parts += (b",", head)
    parts += (b',"input":', _dumps(items))
    if tail:
        parts += (b",", tail)
    if previous_response_id is not None:
        parts += (b',"previous_response_id":', _dumps(previous_response_id))
    parts.append(b"}")
    return b"".join(parts)


def _frame(
    req: ParsedRequest,
    fields: dict[str, Any],
    previous_response_id: str | None,
    items: list[Any] | None,
    stream_id: str | None,
) -> bytes:
    before: dict[str, Any] = {"type": "response.create"}
    if stream_id is not None:
        before["stream_id"] = stream_id
    after: dict[str, Any] = {}
    side = before
    for key, value in fields.items():
        if key == "input":
            side = after
        elif key not in TRANSPORT_ONLY_FIELDS and key not in ("type", "stream_id"):
            side[key] = value
    if previous_response_id is not None:
        before.pop("previous_response_id", None)
        after.pop("previous_response_id", None)
        after["previous_response_id"] = previous_response_id
    if items is not None:
        return _dumps({**before, "input": items, **after})
    if req.span is None:
        raw_input = fields.get("input")
        return _dumps({**before, **({"input": raw_input} if "input" in fields else {}), **after})
    head = _dumps(before)[:-1] + b',"input":'
    # One copy of the history into the frame (slicing and "+" would copy it three times).
    array = memoryview(req.body)[req.span.start : req.span.end + 1]
    if after:
        return b"".join((head, array, b",", _dumps(after)[1:]))
    return b"".join((head, array, b"}"))
