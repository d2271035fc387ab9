"""One app request, parsed (:class:`ParsedRequest`), and the upstream ``response.create`` frame
built from it (:func:`build_frame`); which transport it takes (:func:`choose_transport`).

The parses that build a :class:`ParsedRequest` are :func:`parse_request` (the whole body,
validated by :mod:`proxy.core.fields`) and :func:`proxy.core.fastparse.fast_parse` (only the bytes after
the previous turn's prefix); both end in :func:`make_request`.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.core.fields import TRANSPORT_ONLY_FIELDS, dumps, settings_digest, validate_fields, validate_items
from proxy.core.items import item_key
from proxy.core.prefixes import Base, SettingsBlock
from proxy.core.rawjson import InputSpan, locate_input
from proxy.errors import InvalidRequest, UnsupportedRequest
from proxy.reasons import PassthroughReason

__all__ = [
    "ParsedRequest",
    "Transport",
    "build_frame",
    "choose_transport",
    "http_unsupported",
    "has_huge_float",
    "make_request",
    "parse_request",
]


class Transport(enum.Enum):
    """How a request goes upstream."""

    WS = "websocket"
    HTTP = "http"


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
        settings_digest: Digest of every field but those in :data:`~proxy.core.fields.NON_SETTINGS_FIELDS`.
        span: Where the ``input`` array sits in ``body`` (``None``: string input or unknown).
        base: Set by a fast parse.
        tail: Input items after ``base``'s prefix (fast parse), else ``None``.
        settings: The previous turn's :class:`~proxy.core.prefixes.SettingsBlock`, when this body carries the same
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


def has_huge_float(value: Any) -> bool:
    """Whether ``value`` holds an integral float of 2**63 or more: possibly an integer beyond 64
    bits that orjson parsed as a float, which must reach the upstream with its exact digits."""
    if isinstance(value, float):
        return abs(value) >= 2.0**63 and value.is_integer()
    if isinstance(value, dict):
        return any(has_huge_float(v) for v in value.values())
    if isinstance(value, list):
        return any(has_huge_float(v) for v in value)
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
    if items is not None and block is not None and not block.huge and not has_huge_float(items):
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
    if has_huge_float(others) or has_huge_float(written):
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
    head, tail = _members(block)
    parts = [b'{"type":"response.create"']
    if stream_id is not None:
        parts += (b',"stream_id":', dumps(stream_id))
    if head:
        parts += (b",", head)
    parts += (b',"input":', dumps(items))
    if tail:
        parts += (b",", tail)
    if previous_response_id is not None:
        parts += (b',"previous_response_id":', dumps(previous_response_id))
    parts.append(b"}")
    return b"".join(parts)


def _members(block: SettingsBlock) -> tuple[bytes, bytes]:
    """The frame's members before and after ``input`` (serialised once, kept in the block): no
    transport-only fields, no ``type``/``stream_id``/``previous_response_id``."""
    if block.members is None:
        skip = TRANSPORT_ONLY_FIELDS | {"type", "stream_id", "previous_response_id"}
        head = dumps({k: v for k, v in block.before.items() if k not in skip})[1:-1]
        tail = dumps({k: v for k, v in block.after.items() if k not in skip})[1:-1]
        block.members = (head, tail)
    return block.members


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
        return dumps({**before, "input": items, **after})
    if req.span is None:
        raw_input = fields.get("input")
        return dumps({**before, **({"input": raw_input} if "input" in fields else {}), **after})
    head = dumps(before)[:-1] + b',"input":'
    # One copy of the history into the frame (slicing and "+" would copy it three times).
    array = memoryview(req.body)[req.span.start : req.span.end + 1]
    if after:
        return b"".join((head, array, b",", dumps(after)[1:]))
    return b"".join((head, array, b"}"))
