"""Who a request belongs to: the key that partitions sockets and conversation heads.

Headers exist only on a WebSocket upgrade, so a socket belongs to exactly one set of them
(pitfall 12), and an anchor must belong to the caller (pitfall 13). The identity hashes the
app's credential headers (``identity.headers``: by default ``Authorization``, ``api-key``,
``OpenAI-Organization``, ``OpenAI-Project``, ``OpenAI-Beta``), the upstream credential actually
used (a configured key), the upstream URL and the app's query string (Azure's ``api-version``:
it is part of the upgrade URL). With an injected key the app's own headers still count, so
tenants behind one key stay apart. Any other header (per-turn metadata) never splits an identity.

The identity partitions; its *tenant* accounts. Everything that shares a bound between callers
(memory admission, relay and socket quotas, "evict from the heaviest") is keyed by the tenant:
the app's credential alone (``Authorization``, ``api-key``, the injected key's header and any
other configured credential header: behind an injected key, the app's placeholder), never the
query string or the optional ``OpenAI-Beta``/``OpenAI-Project``/``OpenAI-Organization`` values,
which a caller varies for free. Requests that carry no credential at all are one tenant
(:attr:`Identity.keyless`). The tenant is the digest's first
:data:`~proxy.core.tenants.TENANT_CHARS` characters, so every module keyed by the digest can
account by tenant with :func:`~proxy.core.tenants.tenant_of`, no lookup.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from proxy.config import DEFAULT_IDENTITY_HEADERS, Settings, upstream_ws_url
from proxy.core.tenants import TENANT_CHARS, tenant_of
from proxy.errors import InvalidRequest
from proxy.intake.keys import KeySource

__all__ = ["USER_AGENT", "Identity", "identify", "request_identity"]


def _version() -> str:
    try:
        return version("upshift")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.1.0"


USER_AGENT = f"upshift/{_version()}"
"""``User-Agent`` of every upstream connection."""

_CACHE_MAX = 4096


@dataclass(frozen=True, slots=True)
class Identity:
    """A credential partition. Equality and hash use :attr:`digest` only.

    The repr shows a digest prefix, never a credential: identities end up in logs and reprs.
    """

    digest: str
    """The tenant (:attr:`tenant`: sha256 hex of the app's credential, cut to
    :data:`~proxy.core.tenants.TENANT_CHARS`) followed by sha256 hex of every part that makes the
    partition (64 characters in all)."""
    headers: tuple[tuple[str, str], ...] = field(compare=False, repr=False)
    """Upgrade headers for the upstream socket: the credential headers (``identity.headers``)
    the app sent, with an injected key in place of the app's own."""
    ws_url: str = field(compare=False, repr=False)
    """The upstream WebSocket URL of this identity's sockets: the upstream base URL's path
    prefix and query string, plus the app's own query string (``api-version``). Part of the
    digest, so sockets opened for one query string never serve another."""
    keyless: bool = field(default=False, compare=False)
    """The app sent no credential (the keyless tenant, which shares one small quota)."""

    @property
    def tenant(self) -> str:
        """Whose quota: the app's credential, without the query string or optional headers."""
        return tenant_of(self.digest)

    def __repr__(self) -> str:
        return f"Identity({self.digest[:12]})"


_cache: dict[tuple[object, ...], Identity] = {}

_KEY_HEADERS = frozenset({"authorization", "api-key"})
"""Headers that carry an app's own key: replaced (not forwarded) when the sidecar injects one."""
_OPTIONAL_HEADERS = frozenset({"openai-beta", "openai-project", "openai-organization"})
"""Credential headers a caller may vary for free with one key: part of the partition, never of
the tenant."""


def _bare_key(authorization: str) -> str:
    scheme, _, key = authorization.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key else authorization


def identify(
    app_headers: Mapping[str, str],
    *,
    upstream: str,
    authorization: str | None,
    openai_beta: str = "",
    query: str = "",
    credential_headers: Sequence[str] = DEFAULT_IDENTITY_HEADERS,
    key_header: str | None = None,
) -> Identity:
    """The identity of a request.

    Args:
        app_headers: The app's request headers (case-insensitive mapping).
        upstream: The upstream base URL.
        authorization: The ``Authorization`` to send upstream (``KeySource.authorization``).
        openai_beta: The configured ``OpenAI-Beta`` (empty: none); the app's own value wins.
        query: The app's raw query string (``api-version=...``), without ``?``.
        credential_headers: The headers that form a credential (``identity.headers``).
        key_header: With an injected key, the header it goes into (``api_key.header``); the
            app's own ``Authorization``, ``api-key`` and ``key_header`` are then hashed but
            not sent. ``None``: the app's own credential headers are sent.

    Returns:
        The identity; equal inputs give an equal (and usually the same, cached) object.
    """
    values = tuple(
        app_headers.get(name) or openai_beta or None if name.lower() == "openai-beta" else app_headers.get(name)
        for name in credential_headers
    )
    names = tuple(credential_headers)
    parts = (*names, *values, authorization, key_header, upstream, query)
    found = _cache.get(parts)
    if found is not None:
        return found
    partition = _hashed(str(len(names)), parts)
    # The tenant: the app's own credential values (not the upstream credential: behind an
    # injected key it is everyone's), nothing optional, nothing from the URL.
    # (The configuration refuses an api_key.header that is not one of identity.headers.)
    owned = [(name, app_headers.get(name)) for name in names if name.lower() not in _OPTIONAL_HEADERS]
    credential = tuple(value or None for _, value in owned)
    keyless = not any(credential)
    tenant = _hashed("tenant", () if keyless else (*(name.lower() for name, _ in owned), *credential))
    replaced = _KEY_HEADERS | {key_header.lower()} if key_header else frozenset()
    headers: list[tuple[str, str]] = []
    for name, value in zip(names, values, strict=True):
        lowered = name.lower()
        if lowered in replaced:
            continue
        if lowered == "authorization":
            value = authorization
        if value:
            headers.append((name, value))
    if key_header and authorization:
        is_bearer = key_header.lower() == "authorization"
        headers.append((key_header, authorization if is_bearer else _bare_key(authorization)))
    digest = tenant[:TENANT_CHARS] + partition[: 64 - TENANT_CHARS]
    identity = Identity(digest, tuple(headers), upstream_ws_url(upstream, query), keyless)
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()  # cheap bound; a miss only costs one hash
    _cache[parts] = identity
    return identity


def _hashed(label: str, parts: Sequence[str | None]) -> str:
    hasher = hashlib.sha256()
    hasher.update(label.encode() + b";")
    for part in parts:
        # A length prefix keeps ("ab", "c") and ("a", "bc") apart; -1 marks an absent header.
        data = b"" if part is None else part.encode("utf-8", "surrogateescape")
        hasher.update(str(-1 if part is None else len(data)).encode() + b":" + data)
    return hasher.hexdigest()


def request_identity(app_headers: Mapping[str, str], query: str, settings: Settings, keys: KeySource) -> Identity:
    """The identity of an app request under ``settings`` (what handlers and the relay use).

    Args:
        app_headers: The app's request headers.
        query: The app's raw query string (``request.rel_url.raw_query_string``).
        settings: ``upstream``, ``identity.headers``, ``api_key.header``, ``pool.openai_beta``.
        keys: The key source (passthrough or an injected key).

    Raises:
        InvalidRequest: a credential header (``identity.headers``, ``api_key.header``) came more
            than once: the identity would hash one value while the HTTP relay forwards them all,
            and the upstream may authenticate a value that was never hashed.
    """
    getall = getattr(app_headers, "getall", None)
    if getall is not None:
        for name in (*settings.identity.headers, settings.api_key.header):
            if len(getall(name, ())) > 1:
                raise InvalidRequest(f"The credential header '{name}' was sent more than once.")
    authorization, key_header = app_headers.get("Authorization"), None
    if keys.injects:  # the sidecar's own key goes upstream (passthrough: the app's, unchanged)
        authorization, key_header = keys.authorization(authorization), settings.api_key.header
    return identify(
        app_headers,
        upstream=settings.upstream,
        authorization=authorization,
        openai_beta=settings.pool.openai_beta,
        query=query,
        credential_headers=settings.identity.headers,
        key_header=key_header,
    )
