"""What the HTTP relay changes on the way through: the headers it drops or sets each way, ids
swapped in an answer's bytes, a compressed answer's text for a look inside, and whether an
upstream URL sends in cleartext. Pure functions of what they are given; the relay itself is
:mod:`proxy.upstream.passthrough`."""

from __future__ import annotations

import ipaddress
import zlib
from urllib.parse import urlsplit

from aiohttp import web
from multidict import CIMultiDict

__all__ = ["HOP_BY_HOP", "RESPONSE_DROP", "SKIP_AUTO", "Swap", "cleartext", "decoded", "forward_headers"]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
"""RFC 9110 §7.6.1 connection-specific headers, never forwarded."""

REQUEST_DROP = HOP_BY_HOP | {"host", "authorization", "cookie", "expect", "content-length", "x-upshift-forwarded"}
"""The app's headers never sent upstream (the key comes from the key source, the length from
the body as sent)."""
RESPONSE_DROP = HOP_BY_HOP | {"set-cookie", "x-request-id", "content-length", "date", "server"}
"""The upstream's headers never passed to the app (the listener writes its own)."""
SKIP_AUTO = frozenset({"Accept-Encoding", "User-Agent", "Content-Type", "Accept"})
"""Headers aiohttp's client would add on its own: only the app's go."""


class Swap:
    """Replaces every ``old`` by ``new`` in a byte stream cut anywhere (the last
    ``len(old) - 1`` bytes of a chunk wait for the next one)."""

    __slots__ = ("_keep", "_new", "_old", "_tail")

    def __init__(self, old: bytes, new: bytes) -> None:
        self._old, self._new, self._keep, self._tail = old, new, len(old) - 1, b""

    def feed(self, chunk: bytes) -> bytes:
        data = (self._tail + chunk).replace(self._old, self._new)
        # A match may start in the last len(old)-1 bytes: hold them (never part of a replacement,
        # which ``new`` cannot complete: it does not end with a prefix of ``old``).
        cut = max(len(data) - self._keep, 0)
        self._tail = data[cut:]
        return data[:cut]

    def rest(self) -> bytes:
        tail, self._tail = self._tail, b""
        return tail


def decoded(body: bytes, encoding: str) -> bytes:
    """``body`` as text bytes for a look inside (gzip or deflate undone, at most 1 MiB)."""
    encoding = encoding.strip().lower()
    if encoding not in ("gzip", "deflate"):
        return body
    try:
        return zlib.decompressobj(wbits=47).decompress(body, 1 << 20)
    except zlib.error:
        return body


def cleartext(url: str) -> bool:
    """An ``http://``/``ws://`` upstream that is not loopback (warned at startup)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "ws"):
        return False
    host = (parts.hostname or "").lower()
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"


def forward_headers(
    request: web.Request, authorization: str | None, keep_length: bool, key_header: str | None = None
) -> CIMultiDict[str]:
    """The app's headers for the upstream: hop-by-hop, cookies and ``Host`` dropped, the
    ``Authorization`` from the key source. With an injected key in ``key_header`` (not
    ``Authorization``), the app's own ``Authorization`` and ``api-key`` (its placeholders) are
    dropped and ``key_header`` carries the bare key."""
    listed = {h.strip().lower() for h in request.headers.getall("Connection", []) for h in h.split(",")}
    injected = {"api-key", key_header.lower()} if key_header else set()
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in request.headers.items():
        lowered = name.lower()
        if lowered in REQUEST_DROP or lowered in listed or lowered in injected:
            if not (keep_length and lowered == "content-length"):
                continue
        if lowered == "content-encoding" and not keep_length:
            continue  # a body read by the sidecar was decoded (read_body): it goes as it is now
        out.add(name, value)
    if not authorization:
        return out
    if key_header and key_header.lower() != "authorization":
        scheme, _, key = authorization.partition(" ")
        out[key_header] = key.strip() if scheme.lower() == "bearer" and key else authorization
    else:
        out["Authorization"] = authorization
    return out
