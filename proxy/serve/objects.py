"""Stored objects other than responses behind the ``/v1`` relay: conversations, items, files,
vector stores, stored chat completions, batches, containers, uploads; and the routes of objects
the sidecar does not track.

Behind an injected key the upstream's store is shared by every tenant, so each such object is
its creator's tenant's, as a response id is (:mod:`proxy.serve.creator_check`):

* **Created, recorded.** The ``id`` of a ``POST`` to its collection (``POST /v1/files``; of a
  streamed ``POST /v1/chat/completions``, the ``id`` of its first chunk) is recorded with its
  creator before the app sees it; so are the objects a request under an object the caller owns
  creates or shows it (:func:`~proxy.core.named_ids.answer_ids`: the items of
  ``/v1/conversations/{id}/items``, the file of ``POST /v1/uploads/{id}/complete``, a batch's
  output and error files), whose answer is read whole (up to
  :data:`~proxy.core.creators.SNIFF_LIMIT`) before any byte of it reaches the app. Those are
  recorded only when no tenant owns them yet: an answer never takes an id from its creator.
* **Named, checked.** A route naming one (``GET /v1/files/{id}/content``, ``POST
  /v1/conversations/{id}/items``) is answered only for its owner; so is a body naming one
  (``file_id`` of ``POST /v1/vector_stores/{id}/files``, ``file_ids`` of a file batch, a
  ``conversation``, ``item_reference`` or ``input_file_id``...): the body is read under the
  request's memory lease and parsed once (:func:`~proxy.core.named_ids.read_request`), a body
  that does not parse is refused, and the bytes read are what is forwarded. What type a body
  declares does not decide (an upstream may parse JSON whatever the type says): every body but an
  upload to a route that takes uploads is read, and one declared as an upload (multipart,
  binary) is checked when it starts like JSON. Another tenant's
  object, and behind an injected key one no process knows, is a 404 as for an unknown id.
* **Listed, refused.** A list of the collection (``GET /v1/files``) would show every tenant's
  objects: behind an injected key it is refused (403 ``not_shared``).

* **Not tracked, refused.** Any other ``/v1`` route (``/v1/fine_tuning/...``, ``/v1/evals/...``,
  ...) behind an injected key is refused (403 ``not_shared``) unless it names no stored object of
  a tenant (:func:`~proxy.core.named_ids.stateless_route`: models, embeddings, audio, images, ...)
  or ``identity.shared_objects`` lists ``untracked``. (``/v1/responses`` has routes of its own.)

``identity.shared_objects`` opens a kind to every tenant (lists answered, ids unchecked). The
owner is the tenant (:mod:`proxy.core.creators`): not the query string of a later read
(``?limit=``, ``?stream=true&starting_after=N``) nor an optional header.

Uploads (a multipart, form or binary body to ``/v1/files``, ``/v1/uploads/``, ``/v1/audio/``,
``/v1/images/``, ``/v1/containers/``, ``/v1/videos``) are relayed as they arrive, unread: they
carry new content, not ids.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.core.named_ids import (
    PARSE_INLINE,
    ObjectRoute,
    answer_ids,
    noun,
    object_route,
    read_request,
    stateless_route,
)
from proxy.errors import ClientGone, ForeignObject, InvalidRequest, NotShared
from proxy.intake.body import BodyClock, read_body
from proxy.intake.identity import Identity
from proxy.intake.memory import Lease
from proxy.reasons import ObjectKind
from proxy.serve.handlers import Services
from proxy.upstream.passthrough import Options

__all__ = ["guard"]

_UPLOAD_TYPES = (
    "multipart/",
    "application/x-www-form-urlencoded",
    "application/octet-stream",
    "audio/",
    "image/",
    "video/",
)
"""Content types of an upload (new content, never a reference to an object)."""
_UPLOAD_ROUTES = ("/v1/files", "/v1/uploads/", "/v1/audio/", "/v1/images/", "/v1/containers/", "/v1/videos")
"""Routes that take uploads: a body of an upload type is relayed to them as it arrives, unread."""
_CHAT_CHUNK_ID = ("id",)
"""Where a streamed chat completion's id is: the top-level ``id`` of its first chunk."""


def _is_upload(request: web.Request) -> bool:
    kind = request.headers.get("Content-Type", "").strip().lower()
    return kind.startswith(_UPLOAD_TYPES)


def _reads_body(request: web.Request) -> bool:
    """A body whose ids are checked: every body of a ``POST``/``PUT``/``PATCH`` but an upload to
    a route that takes uploads (an upstream may parse JSON whatever type a body declares)."""
    if request.method not in ("POST", "PUT", "PATCH") or not request.body_exists:
        return False
    return not (_is_upload(request) and request.path.startswith(_UPLOAD_ROUTES))


def _looks_like_json(body: bytes) -> bool:
    return body.lstrip(b" \t\r\n")[:1] in (b"{", b"[")


@contextlib.asynccontextmanager
async def guard(svc: Services, request: web.Request) -> AsyncIterator[tuple[Options | None, bytes | None]]:
    """Check a ``/v1`` request of the relay against the owners of the objects it names.

    Yields:
        The relay's options (an id of the answer is recorded) or ``None``, and the body when it
        was read to be checked (forward exactly it), else ``None`` (it streams from the app).
        The body's memory lease is held until the block ends.

    Raises:
        InvalidRequest: a credential header came twice (the identity); a read body does not
            parse as one JSON object, or repeats a key once it names an id.
        ForeignObject: the path or body names an object that is not the caller's.
        NotShared: behind an injected key, a list of a collection not shared, or a route of no
            known collection that is not stateless (:func:`~proxy.core.named_ids.stateless_route`)
            while ``untracked`` is not shared.
        BodyTooLarge, BodyTimeout, MemoryRefused: reading the body (as on ``POST /v1/responses``).
    """
    route = object_route(request.method, request.path)
    if route is None and svc.owners.strict and not _opened(svc, request):
        raise NotShared(
            f"Behind the sidecar's injected key {request.method} {request.path} is not forwarded: the"
            " sidecar does not track the objects it may name, so every tenant would reach every"
            " other's; an operator opens such routes with identity.shared_objects: [untracked]."
        )
    checked = route is not None and route.kind not in svc.owners.shared
    reads = svc.owners.strict and _reads_body(request)
    if not checked and not reads:
        yield None, None
        return
    identity = svc.identity(request)
    options: Options | None = None
    if route is not None and checked:
        options = await _path(svc, request, identity, route)
    if not reads:
        yield options, None
        return
    async with _lease(svc, request, identity) as (lease, clock):
        try:
            body = await read_body(request, svc.settings.limits.max_body_bytes, lease, clock)
        except ClientGone:  # nobody reads the answer: a refusal, not a bug of ours
            raise InvalidRequest("The app closed its connection before its request body was complete.") from None
        if not _is_upload(request) or _looks_like_json(body):
            # Declared JSON (or nothing), or JSON declared as something else: read as JSON, and
            # refused when it does not parse as one object.
            named = read_request(body) if len(body) <= PARSE_INLINE else await asyncio.to_thread(read_request, body)
            await svc.owners.check(identity.digest, named)
        yield options, body


def _opened(svc: Services, request: web.Request) -> bool:
    """Whether a ``/v1`` route of no known collection is forwarded behind an injected key: it
    names no stored object of a tenant, or the operator shares the untracked routes."""
    return ObjectKind.UNTRACKED in svc.owners.shared or stateless_route(request.method, request.path)


async def _path(svc: Services, request: web.Request, identity: Identity, route: ObjectRoute) -> Options | None:
    """The check of the object the path names (or of its collection); the options recording
    what the answer creates."""
    owner = identity.digest
    if route.object_id is not None:
        if not await svc.owners.allows(owner, route.object_id):
            raise ForeignObject(noun(route.kind), route.object_id)
        paths = answer_ids(route, request.method)
        if paths:
            return Options(on_id=lambda object_id: svc.owners.adopt(owner, object_id), answer=paths)
        return None
    if route.lists and svc.owners.strict:
        raise NotShared(
            f"Behind the sidecar's injected key {request.path} would list every tenant's {route.kind};"
            f" an operator shares them with identity.shared_objects: [{route.kind}]."
        )
    if route.creates:
        sse = _CHAT_CHUNK_ID if route.kind is ObjectKind.CHAT_COMPLETIONS else None
        return Options(on_id=lambda object_id: svc.owners.note(owner, object_id), sse_id=sse)
    return None


@contextlib.asynccontextmanager
async def _lease(
    svc: Services, request: web.Request, identity: Identity
) -> AsyncIterator[tuple[Lease | None, BodyClock]]:
    """The memory lease a read body is held under (as ``POST /v1/responses`` is) and its clock."""
    clock = BodyClock(svc.settings.limits, asyncio.get_running_loop().time())
    if svc.memory is None:
        yield None, clock
        return
    lease = svc.memory.lease(
        request.content_length,
        key=identity.tenant,
        deadline=clock.deadline,
        keyless=identity.keyless,
    )
    async with lease as held:
        yield held, clock
