"""Validate Responses API payloads against OpenAI's published OpenAPI file AND the ``openai`` SDK types.

Importable by any test (``from tests.conformance.schema import validate_stream_event``)::

    validate_stream_event(obj)      # an SSE data payload (ResponseStreamEvent)
    validate_ws_server_event(obj)   # a WebSocket server frame (ResponsesServerEvent, error = ResponseWsError)
    validate_response(obj)          # a response object (HTTP JSON, lifecycle events' ``response``)
    validate_error_body(obj)        # an HTTP error body {"error": {...}}
    validate_client_event(frame)    # a WebSocket client frame (ResponsesClientEvent; create = CreateResponse)
    validate_create_body(obj)       # a POST /v1/responses body (CreateResponse)
    validate_sse_bytes(data)        # a whole SSE body: framing, ``event:`` == ``type``, each event

Each raises :class:`ConformanceError` listing every finding that is not a known lag
(``lags.KNOWN_LAGS``); ``findings(...)`` returns them all without raising. The OpenAPI file is loaded
once per process (about 2 s). Both validators run on every payload when OpenAI's file is there
(``../shared/reference/openapi/openapi.yaml`` beside the checkout, or ``UPSHIFT_OPENAPI``); a clone
without it runs the SDK layer alone (``LAYERS`` says which ran; the suite's header says it once):

* OpenAPI: Draft 2020-12 via ``jsonschema`` + ``referencing``; unions are dispatched on ``type`` to
  the one branch that declares it (an unknown ``type`` is a finding).
* SDK: the pydantic model for the ``type`` (from the SDK's own discriminated unions), validated, then
  walked for ``model_extra``: every key the model does not declare is a finding (the models accept
  unknown keys silently otherwise).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pydantic
import yaml
from jsonschema import Draft202012Validator
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.responses_client_event import ResponsesClientEvent
from openai.types.responses.responses_server_event import ResponsesServerEvent, ResponseWsError
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from .lags import KNOWN_LAGS

__all__ = [
    "HAVE_OPENAPI",
    "LAYERS",
    "OPENAPI_PATH",
    "ConformanceError",
    "Finding",
    "covered_types",
    "findings",
    "validate_client_event",
    "validate_create_body",
    "validate_error_body",
    "validate_response",
    "validate_sse_bytes",
    "validate_stream_event",
    "validate_ws_server_event",
]

JSON = Any
_ROOT = Path(__file__).resolve().parents[2]
OPENAPI_PATH = Path(
    os.environ.get("UPSHIFT_OPENAPI", _ROOT.parent / "shared" / "reference" / "openapi" / "openapi.yaml")
)
_URI = "urn:openai-openapi"
HAVE_OPENAPI = OPENAPI_PATH.is_file()
"""Whether OpenAI's OpenAPI file is there: without it only the SDK's pydantic models validate."""
LAYERS: frozenset[str] = frozenset({"openapi", "sdk", "sse"} if HAVE_OPENAPI else {"sdk", "sse"})
"""The finding sources this process checks (``Finding.source``)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One disagreement: ``source`` (openapi | sdk | sse), ``subject`` (schema or event type), ``path``, ``kind``."""

    source: str
    subject: str
    path: str
    kind: str
    detail: str = ""

    @property
    def key(self) -> str:
        """``"source subject path kind"``: what ``KNOWN_LAGS`` patterns match (fnmatch)."""
        return f"{self.source} {self.subject} {self.path} {self.kind}"

    def known(self) -> str | None:
        """The reason, when this finding is a listed known lag."""
        for pattern, reason in KNOWN_LAGS.items():
            if fnmatch.fnmatchcase(self.key, pattern):
                _USED.add(pattern)
                return reason
        return None

    def __str__(self) -> str:
        return f"{self.key}: {self.detail}"


class ConformanceError(AssertionError):
    """Findings that are not known lags."""

    def __init__(self, what: str, found: list[Finding]) -> None:
        super().__init__(f"{what} does not conform:\n  " + "\n  ".join(str(f) for f in found))
        self.findings = found


_USED: set[str] = set()
"""Known-lag patterns that matched at least once (tests check none is stale)."""
_COVERED: set[tuple[str, str]] = set()
"""(validator entry point, ``type``) pairs validated so far in this process."""


def covered_types() -> set[tuple[str, str]]:
    """What was validated so far: ``("stream" | "ws" | "client" | "response" | "error", type)``."""
    return set(_COVERED)


def used_lags() -> set[str]:
    """Known-lag patterns that explained at least one finding."""
    return set(_USED)


# -- OpenAPI ------------------------------------------------------------------------------------
@functools.cache
def _document() -> dict[str, JSON]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with OPENAPI_PATH.open("rb") as handle:
        doc: dict[str, JSON] = yaml.load(handle, Loader=loader)  # noqa: S506 - a safe loader
    return doc


@functools.cache
def _registry() -> Registry[JSON]:
    return Registry().with_resource(_URI, DRAFT202012.create_resource(_document()))


@functools.cache
def _validator(pointer: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"{_URI}#{pointer}"}, registry=_registry())


def _schemas() -> dict[str, JSON]:
    schemas: dict[str, JSON] = _document()["components"]["schemas"]
    return schemas


def _type_values(schema: JSON, depth: int = 0) -> set[str]:
    """The ``type`` discriminator values a (sub)schema declares (through ``$ref`` / ``allOf``)."""
    if not isinstance(schema, dict) or depth > 8:
        return set()
    if "$ref" in schema:
        return _type_values(_schemas()[schema["$ref"].rsplit("/", 1)[-1]], depth + 1)
    found: set[str] = set()
    prop = schema.get("properties", {}).get("type")
    if isinstance(prop, dict):
        found.update(v for v in prop.get("enum", []) if isinstance(v, str))
        if isinstance(prop.get("const"), str):
            found.add(prop["const"])
        if isinstance(prop.get("default"), str) and not found:
            found.add(prop["default"])
    for part in schema.get("allOf", []):
        found |= _type_values(part, depth + 1)
    return found


@functools.cache
def _branches(union: str) -> dict[str, str]:
    """``type`` → JSON pointer of the union member declaring it."""
    out: dict[str, str] = {}
    for index, branch in enumerate(_schemas()[union]["anyOf"]):
        for value in _type_values(branch):
            out.setdefault(value, f"/components/schemas/{union}/anyOf/{index}")
    return out


def _path(parts: Iterator[JSON] | typing.Sequence[JSON]) -> str:
    return ".".join("*" if isinstance(p, int) else str(p) for p in parts) or "$"


def _openapi(pointer: str, subject: str, obj: JSON) -> list[Finding]:
    if not HAVE_OPENAPI:
        return []
    out = []
    for error in _validator(pointer).iter_errors(obj):
        path = _path(error.absolute_path)
        kind = str(error.validator)
        detail = error.message[:300]
        if kind == "required" and isinstance(error.validator_value, list) and isinstance(error.instance, dict):
            missing = [k for k in error.validator_value if k not in error.instance]
            path = ".".join(p for p in (path if path != "$" else "", ",".join(missing)) if p)
        out.append(Finding("openapi", subject, path, kind, detail))
    return out


def _openapi_union(union: str, obj: JSON) -> list[Finding]:
    if not HAVE_OPENAPI:
        return []
    kind = obj.get("type") if isinstance(obj, dict) else None
    pointer = _branches(union).get(str(kind))
    if pointer is None:
        return [Finding("openapi", str(kind), "type", "unknown_type", f"{kind!r} is no member of {union}")]
    return _openapi(pointer, str(kind), obj)


# -- SDK ------------------------------------------------------------------------------------------
def _members(union: Any) -> list[type[pydantic.BaseModel]]:
    args = typing.get_args(union)
    if typing.get_origin(union) is typing.Annotated:
        return _members(args[0])
    return [a for a in args if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]


@functools.cache
def _models(union_name: str) -> dict[str, type[pydantic.BaseModel]]:
    union = {"stream": ResponseStreamEvent, "ws": ResponsesServerEvent, "client": ResponsesClientEvent}[union_name]
    out: dict[str, type[pydantic.BaseModel]] = {}
    for model in _members(union):
        for value in typing.get_args(model.model_fields["type"].annotation):
            out.setdefault(str(value), model)
    return out


def _extras(value: JSON, path: str, subject: str) -> Iterator[Finding]:
    if isinstance(value, pydantic.BaseModel):
        for key in value.model_extra or {}:
            yield Finding("sdk", subject, f"{path}.{key}".lstrip("."), "unknown_key", type(value).__name__)
        for name in value.model_fields_set:
            if name in type(value).model_fields:
                yield from _extras(getattr(value, name), f"{path}.{name}", subject)
    elif isinstance(value, list):
        for item in value:
            yield from _extras(item, f"{path}.*", subject)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _extras(item, f"{path}.{key}", subject)


def _sdk(model: type[pydantic.BaseModel], subject: str, obj: JSON) -> list[Finding]:
    try:
        parsed = model.model_validate(obj)
    except pydantic.ValidationError as exc:
        return [
            Finding("sdk", subject, _path(error["loc"]), str(error["type"]), str(error["msg"])[:300])
            for error in exc.errors()
        ]
    return list(_extras(parsed, "", subject))


def _sdk_union(union_name: str, obj: JSON) -> list[Finding]:
    kind = obj.get("type") if isinstance(obj, dict) else None
    model = _models(union_name).get(str(kind))
    if model is None:
        return [Finding("sdk", str(kind), "type", "unknown_type", f"{kind!r} is no member of the SDK union")]
    return _sdk(model, str(kind), obj)


# -- entry points -----------------------------------------------------------------------------------
def findings(what: str, obj: JSON) -> list[Finding]:
    """Every finding for ``obj`` as ``what`` (stream | ws | client | create | response | error), lags included."""
    kind = str(obj.get("type")) if isinstance(obj, dict) else "?"
    if what == "stream":
        found = _openapi_union("ResponseStreamEvent", obj) + _sdk_union("stream", obj)
    elif what == "ws":
        if kind == "error":
            found = _openapi("/components/schemas/ResponseWsError", "error", obj) + _sdk(ResponseWsError, "error", obj)
        else:
            found = _openapi_union("ResponsesServerEvent", obj) + _sdk_union("ws", obj)
    elif what == "client":
        found = _openapi_union("ResponsesClientEvent", obj) + _sdk_union("client", obj)
        if kind == "response.create":
            body = {k: v for k, v in obj.items() if k not in ("type", "stream_id", "generate")}
            found += _openapi("/components/schemas/CreateResponse", "CreateResponse", body)
    elif what == "create":
        found = _openapi("/components/schemas/CreateResponse", "CreateResponse", obj)
        found += _sdk(_CreateBody, "CreateResponse", {"type": "response.create", **obj})
        kind = "CreateResponse"
    elif what == "response":
        kind = str(obj.get("status")) if isinstance(obj, dict) else "?"
        subject = f"Response.{kind}"
        found = _openapi("/components/schemas/Response", subject, obj) + _sdk(Response, subject, obj)
    elif what == "error":
        found = _error_body(obj)
        kind = "error"
    else:
        raise ValueError(f"unknown payload kind {what!r}")
    _COVERED.add((what, kind))
    return found


_CreateBody = _models("client")["response.create"]


class _ErrorPayload(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    code: str | None
    message: str
    param: str | None
    type: str


class _ErrorBody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    error: _ErrorPayload


def _error_body(obj: JSON) -> list[Finding]:
    """HTTP error bodies: OpenAPI ``ErrorResponse``; the SDK has no model for them, so the SDK side is
    what ``openai._exceptions.APIStatusError`` reads (``error.{message, type, param, code}``)."""
    return _openapi("/components/schemas/ErrorResponse", "ErrorResponse", obj) + _sdk(_ErrorBody, "ErrorResponse", obj)


def _check(what: str, obj: JSON) -> None:
    unknown = [f for f in findings(what, obj) if f.known() is None]
    if unknown:
        raise ConformanceError(f"{what} {str(obj)[:200]}", unknown)


def validate_stream_event(obj: JSON) -> None:
    """An SSE ``data:`` payload (``ResponseStreamEvent``), and its ``response`` when it has one."""
    _check("stream", obj)
    _nested_response(obj)


def validate_ws_server_event(obj: JSON) -> None:
    """A WebSocket server frame: ``ResponsesServerEvent`` (``error`` → ``ResponseWsError``)."""
    _check("ws", obj)
    _nested_response(obj)


def validate_response(obj: JSON) -> None:
    """A response object (``Response``)."""
    _check("response", obj)


def validate_error_body(obj: JSON) -> None:
    """An HTTP error body ``{"error": {message, type, param, code}}`` (``ErrorResponse``)."""
    _check("error", obj)


def validate_client_event(frame: JSON) -> None:
    """A WebSocket client frame (``ResponsesClientEvent``; a create's body also as ``CreateResponse``).

    ``frame`` may be the text of the frame or its parsed object.
    """
    _check("client", orjson.loads(frame) if isinstance(frame, str | bytes) else frame)


def validate_create_body(obj: JSON) -> None:
    """A ``POST /v1/responses`` body (``CreateResponse``; SDK: the create event's fields)."""
    _check("create", obj)


def _nested_response(obj: JSON) -> None:
    if isinstance(obj, dict) and isinstance(obj.get("response"), dict):
        _check("response", obj["response"])


def validate_sse_bytes(data: bytes) -> list[dict[str, JSON]]:
    """A whole SSE body: ``event: <type>`` + ``data: <json>`` + blank line per event, ``event`` equal to
    the payload's ``type``, no ``[DONE]``; every event validated. Returns the payloads."""
    events: list[dict[str, JSON]] = []
    problems: list[Finding] = []
    text = data.decode()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    if text and not text.endswith("\n\n"):
        problems.append(Finding("sse", "stream", "$", "framing", "the body does not end with a blank line"))
    for block in blocks:
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value
        if fields.get("data", "").startswith("[DONE]"):
            problems.append(Finding("sse", "stream", "$", "done_marker", "/v1/responses streams have no [DONE]"))
            continue
        payload = orjson.loads(fields.get("data", "null"))
        if not isinstance(payload, dict):
            problems.append(Finding("sse", "stream", "data", "not_object", block[:120]))
            continue
        if fields.get("event") != payload.get("type"):
            detail = f"event: {fields.get('event')!r} but type {payload.get('type')!r}"
            problems.append(Finding("sse", str(payload.get("type")), "event", "event_name", detail))
        events.append(payload)
    unknown = [f for f in problems if f.known() is None]
    if unknown:
        raise ConformanceError("SSE body", unknown)
    for payload in events:
        if payload.get("type") == "error":
            _check("stream", payload)
        else:
            validate_stream_event(payload)
    return events
