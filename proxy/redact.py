"""Secrets out of text: the one place URLs are redacted (issues 21 and 22).

An exception's text may quote a whole URL (websockets' ``InvalidProxy``: ``http://user:PW@proxy:3128/x
isn't a valid proxy``; aiohttp's ``InvalidURL``), and an upstream URL may carry a key in its query
(``?api-key=``, SAS tokens). Before such text reaches an app (an error body), a log line or
``--print-config``, :func:`redact_urls` passes every URL in it through :func:`redact_url`: the
userinfo's password (or a lone user name, which may be a token) and every query value but
``api-version`` become ``***``. Text without a URL is returned as it is.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["REDACTED_PART", "redact_url", "redact_urls"]

REDACTED_PART = "***"

_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
_KEEP_QUERY = frozenset({"api-version"})
"""Query parameters shown as they are (Azure's version); every other value may be a secret."""


def redact_url(url: str) -> str:
    """``url`` safe to print: the userinfo's password (or a lone user name) and every query
    value but ``api-version`` replaced by ``***``."""
    try:
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
        netloc = parts.netloc
        if "@" in netloc:
            user = parts.username or ""
            netloc = f"{user}:{REDACTED_PART}@{host}" if parts.password is not None else f"{REDACTED_PART}@{host}"
        query = parts.query
        if query:
            pairs = []
            for pair in query.split("&"):
                name, eq, _ = pair.partition("=")
                pairs.append(pair if not eq or name.lower() in _KEEP_QUERY else f"{name}={REDACTED_PART}")
            query = "&".join(pairs)
        return parts._replace(netloc=netloc, query=query).geturl()
    except ValueError:  # not a URL urllib can split (a bad port): print none of it
        return "<url>"


def redact_urls(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`."""
    if "://" not in text:
        return text
    return _URL.sub(lambda m: redact_url(m.group(0)), text)
