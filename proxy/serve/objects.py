"""Stored objects other than responses behind the ``/v1`` relay: conversations, files, vector
stores, stored chat completions, batches, containers, uploads.

Behind an injected key the upstream's store is shared by every tenant, so each such object is
its creator's, as a response id is (:mod:`proxy.serve.creator_check`): the ``id`` of a ``POST`` to its
collection (``POST /v1/files``) is recorded with its creator before the app sees it, and a route
naming one (``GET /v1/files/{id}/content``, ``POST /v1/conversations/{id}/items``) is answered
only for its owner (another's, or behind an injected key one no process knows: a 404 as for an
unknown id). A list of the collection (``GET /v1/files``) would show every tenant's objects: behind
an injected key it is refused (403 ``not_shared``). ``identity.shared_objects`` opens a kind to
every tenant (lists answered, ids unchecked).

The owner of an object (and of a response) is who created it: its credential, not the query
string of a later read (``?limit=``, ``?stream=true&starting_after=N``): :func:`owner_digests`.
"""

from __future__ import annotations

from urllib.parse import unquote_plus

from aiohttp import web

from proxy.core.creators import noun, object_route
from proxy.errors import ForeignObject, NotShared
from proxy.intake.identity import Identity, request_identity
from proxy.serve.handlers import Services
from proxy.upstream.passthrough import Options

__all__ = ["guard", "owner_digests"]

_UPSTREAM_PARAMETERS = frozenset({"api-version"})
"""Query parameters the upstream needs on every request of an identity (Azure's): kept in the
owner's identity; every other parameter is how to read, not whose."""


def owner_digests(svc: Services, request: web.Request, identity: Identity) -> tuple[str, ...]:
    """The digests the caller's ids are recorded under: its identity's, and, when its query
    string carries more than the upstream's own parameters, its identity without them."""
    raw = request.rel_url.raw_query_string
    if not raw:
        return (identity.digest,)
    pairs = raw.split("&")
    kept = [pair for pair in pairs if unquote_plus(pair.partition("=")[0]) in _UPSTREAM_PARAMETERS]
    if len(kept) == len(pairs):
        return (identity.digest,)
    owner = request_identity(request.headers, "&".join(kept), svc.settings, svc.keys)
    return (identity.digest, owner.digest)


async def guard(svc: Services, request: web.Request) -> Options | None:
    """Check a ``/v1`` request of the relay against the owners of the objects it names.

    Returns:
        The relay's options when the answer creates an object (its id is recorded), else ``None``.

    Raises:
        InvalidRequest: a credential header came twice (the identity).
        ForeignObject: the path names an object that is not the caller's.
        NotShared: behind an injected key, a list of a collection not shared.
    """
    route = object_route(request.method, request.path)
    if route is None or route.kind in svc.owners.shared:
        return None
    identity = svc.identity(request)
    digests = owner_digests(svc, request, identity)
    if route.object_id is not None:
        if not await svc.owners.allows(digests[0], route.object_id, *digests[1:]):
            raise ForeignObject(noun(route.kind), route.object_id)
        return None
    if route.lists and svc.owners.strict:
        raise NotShared(
            f"Behind the sidecar's injected key {request.path} would list every tenant's {route.kind};"
            f" an operator shares them with identity.shared_objects: [{route.kind}]."
        )
    if route.creates:
        owner = digests[-1]
        return Options(on_id=lambda object_id: svc.owners.note(owner, object_id))
    return None
