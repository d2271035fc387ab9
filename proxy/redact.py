"""Secrets out of text: the one place URLs are redacted.

An exception's text may quote a whole URL (websockets' ``InvalidProxy``: ``http://user:PW@proxy:3128/x
isn't a valid proxy``; aiohttp's ``InvalidURL``), and an upstream URL may carry a key in its query
(``?api-key=``, SAS tokens). Before such text reaches an app (an error body), a log line or
``--print-config``, :func:`redact_urls` passes every URL in it through :func:`redact_url`: the
userinfo's password (or a lone user name, which may be a token) and every query value but
``api-version`` become ``***``. Text without a URL is returned as it is.

A password may hold any character, quotes and spaces included, so nothing here stops a URL at a
character a password could contain: a URL in a text runs from its scheme to the next whitespace,
its userinfo up to its last ``@``; and the secrets of the URLs the sidecar was configured with
(:func:`remember`: the egress proxy) are masked wherever they appear in a text, whatever
surrounds them (a quote, a space, a repr's escapes).
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

__all__ = ["REDACTED_PART", "remember", "redact_url", "redact_urls"]

REDACTED_PART = "***"

_KEEP_QUERY = frozenset({"api-version"})
"""Query parameters shown as they are (Azure's version); every other value may be a secret."""
_SCHEME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")
_MAX_REMEMBERED = 64
_remembered: tuple[str, ...] = ()
"""Secret parts of configured URLs, in every spelling a text may quote them in (longest first)."""


def _userinfo(rest: str) -> tuple[str, str] | None:
    """``(userinfo, rest)`` of what follows ``scheme://``: up to its last ``@`` (a password may
    hold ``/``, ``?``, ``#`` or another ``@``), unless that ``@`` is in a path or query (the part
    before the first ``:`` already holds a ``/``, ``?`` or ``#``)."""
    at = rest.rfind("@")
    if at < 0:
        return None
    info = rest[:at]
    user = info.partition(":")[0]
    if any(c in user for c in "/?#"):
        return None
    return info, rest[at + 1 :]


def redact_url(url: str) -> str:
    """``url`` safe to print: the userinfo's password (or a lone user name) and every query
    value but ``api-version`` replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    prefix = ""
    if sep:
        split = _userinfo(rest)
        if split is not None:
            info, rest = split
            user, colon, _ = info.partition(":")
            prefix = f"{user}:{REDACTED_PART}@" if colon else f"{REDACTED_PART}@"
        url = f"{scheme}://{rest}"
    try:
        parts = urlsplit(url)
        query = parts.query
        if query:
            pairs = []
            for pair in query.split("&"):
                name, eq, _ = pair.partition("=")
                pairs.append(pair if not eq or name.lower() in _KEEP_QUERY else f"{name}={REDACTED_PART}")
            query = "&".join(pairs)
        text = parts._replace(query=query).geturl()
    except ValueError:  # not a URL urllib can split (a bad IPv6 host): print none of it
        return "<url>"
    if prefix:
        head, _, tail = text.partition("://")
        text = f"{head}://{prefix}{tail}"
    return text


def remember(url: str) -> None:
    """Mask the secrets of ``url`` (a configured URL: its userinfo's password or lone user
    name, its query values) in every later :func:`redact_urls`, however a text quotes them."""
    global _remembered
    if len(_remembered) >= _MAX_REMEMBERED:
        return
    secrets: list[str] = []
    _, sep, rest = url.partition("://")
    split = _userinfo(rest) if sep else None
    if split is not None:
        user, colon, password = split[0].partition(":")
        secrets.append(password if colon else user)
    query = rest.partition("?")[2].partition("#")[0]
    for pair in query.split("&"):
        name, eq, value = pair.partition("=")
        if eq and name.lower() not in _KEEP_QUERY:
            secrets.append(value)
    forms = set(_remembered)
    for secret in secrets:
        for spelling in {secret, unquote(secret)}:
            for form in {spelling, repr(spelling)[1:-1], spelling.encode("unicode_escape").decode("ascii")}:
                if len(form) >= 3:  # shorter would mask ordinary text
                    forms.add(form)
    _remembered = tuple(sorted(forms, key=len, reverse=True))


def _redact_token(token: str) -> str:
    """``token`` (no whitespace) with every URL in it redacted; a URL ends where the next begins."""
    starts: list[int] = []
    i = token.find("://")
    while i >= 0:
        start = i
        while start > 0 and token[start - 1] in _SCHEME:
            start -= 1
        while start < i and not token[start].isalpha():
            start += 1
        if start < i and (not starts or start >= starts[-1]):
            starts.append(start)
        i = token.find("://", i + 3)
    if not starts:
        return token
    out = [token[: starts[0]]]
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(token)
        out.append(redact_url(token[start:end]))
    return "".join(out)


def redact_urls(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`, and every remembered
    secret masked."""
    for secret in _remembered:
        if secret in text:
            text = text.replace(secret, REDACTED_PART)
    if "://" not in text:
        return text
    out: list[str] = []
    word: list[str] = []
    for char in text:
        if char.isspace():
            if word:
                out.append(_redact_token("".join(word)))
                word = []
            out.append(char)
        else:
            word.append(char)
    if word:
        out.append(_redact_token("".join(word)))
    return "".join(out)
