"""Secrets out of text: URLs inside messages lose their credentials (issue 22).

An exception's text may quote a whole URL (websockets' ``InvalidProxy``: ``http://user:PW@proxy:3128/x
isn't a valid proxy``; aiohttp's ``InvalidURL``). Before such text reaches an app (an error body),
a log line or ``--print-config``, :func:`redact_urls` replaces every URL's password (or a
userinfo without one: it may be a token) with ``***``
and the values of query parameters named like a credential (``key``, ``token``, ``secret``,
``password``, ``sig``, ``auth``...) with ``***``. Text without a URL is returned as it is.
"""

from __future__ import annotations

import re

__all__ = ["REDACTED_PART", "redact_urls"]

REDACTED_PART = "***"

_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^\s'\"<>]*)")
_QUERY_SECRET = re.compile(
    r"(?i)([?&;](?:[\w.-]*(?:key|token|secret|passw(?:or)?d|pwd|sig|signature|auth)[\w.-]*)=)([^&;#\s]*)"
)


def _one(match: re.Match[str]) -> str:
    scheme, rest = match.group(1), match.group(2)
    authority_end = len(rest)
    for sep in "/?#":
        at = rest.find(sep)
        if at >= 0:
            authority_end = min(authority_end, at)
    authority, tail = rest[:authority_end], rest[authority_end:]
    if "@" in authority:
        userinfo, _, host = authority.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        # user:password keeps the user (as redact_url does); a lone userinfo may be a token.
        authority = (f"{user}:{REDACTED_PART}" if colon else REDACTED_PART) + "@" + host
    tail = _QUERY_SECRET.sub(lambda m: m.group(1) + REDACTED_PART, tail)
    return scheme + authority + tail


def redact_urls(text: str) -> str:
    """``text`` with every URL's credentials replaced (see the module doc)."""
    if "://" not in text:
        return text
    return _URL.sub(_one, text)
