"""The value checks of the settings: each value against its field's type, then per-key rules.

:func:`coerce` turns one raw value (a YAML value, or the text of an environment variable or a
flag) into a value of the field's type, or says why it cannot; :func:`check_settings` checks the
rules that involve more than one key. Kept apart from the loader (:mod:`proxy.config_load`) so
that the rules a value must follow read in one place, without the mechanics of where it came
from.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

from proxy.config import Settings, parse_hostport, peer_urls
from proxy.errors import ConfigError
from proxy.reasons import ObjectKind, Tolerance
from proxy.redact import redact_url

__all__ = ["Leaf", "check_settings", "coerce", "suggest"]

_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

# Numbers must be >= 0 (checked generically); these must also be > 0 because zero would make
# the sidecar unusable rather than merely switch something off.
_POSITIVE = frozenset(
    {
        "pool.max_sockets_per_identity",
        "pool.max_sockets_total",
        "pool.lanes_per_socket",
        "pool.http_connections",
        "pool.max_active_per_socket",
        "timeouts.connect_seconds",
        "timeouts.stream_idle_seconds",
        "timeouts.http_total_seconds",
        "workers",
        "listener.max_connections",
        "listener.header_timeout_seconds",
        "limits.body_timeout_seconds",
        "limits.body_grace_seconds",
        "cluster.dns_refresh_seconds",
        "cluster.connect_timeout_seconds",
        "cluster.max_forwards_per_peer",
    }
)


@dataclass(frozen=True, slots=True)
class Leaf:
    """One settable field of the tree."""

    key: str
    """Dotted path, e.g. ``pool.max_sockets_per_identity``."""
    type: Any
    """Resolved type hint (``int``, ``float``, ``bool``, ``str``, a ``Literal`` or
    ``tuple[str, ...]``, a list)."""


def suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    # A truncated name names its completions first; then the closest spellings.
    close = [c for c in choices if c.startswith(word)][:3]
    close = close or difflib.get_close_matches(word, choices, n=2, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


def coerce(leaf: Leaf, raw: object, *, text: bool) -> object:
    """Turn ``raw`` into a value of the leaf's type or raise ``ValueError`` saying why.

    ``text`` is true for env vars and string flag values: those are parsed, whereas YAML
    values already have a type and must match it.
    """
    tp = leaf.type
    if text and isinstance(raw, str):
        raw = raw.strip()
    if get_origin(tp) is Literal:
        choices = [str(c) for c in get_args(tp)]
        if isinstance(raw, str) and raw.lower() in choices:
            return raw.lower()
        raise ValueError(f"expected one of {', '.join(choices)}; got {raw!r}")
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if text and isinstance(raw, str) and raw.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[raw.lower()]
        raise ValueError(f"expected a boolean (true/false/1/0/yes/no); got {raw!r}")
    if tp is int or tp is float:
        number: int | float
        if isinstance(raw, bool):  # bool is an int subclass: "true" is no count
            raise ValueError(f"expected a number; got {raw!r}")
        if isinstance(raw, str) and text:
            try:
                number = int(raw) if tp is int else float(raw)
            except ValueError:
                kind = "an integer" if tp is int else "a number"
                raise ValueError(f"expected {kind}; got {raw!r}") from None
        elif isinstance(raw, int) or (tp is float and isinstance(raw, float)):
            number = raw
        else:
            kind = "an integer" if tp is int else "a number"
            raise ValueError(f"expected {kind}; got {raw!r}")
        number = tp(number)
        if not math.isfinite(number):
            raise ValueError(f"expected a finite number; got {raw!r}")
        if number < 0 or (number == 0 and leaf.key in _POSITIVE):
            bound = "> 0" if leaf.key in _POSITIVE else ">= 0"
            raise ValueError(f"must be {bound}; got {raw!r}")
        return number
    if tp is str:
        if not isinstance(raw, str):
            raise ValueError(f"expected a string; got {raw!r}")
        _check_string(leaf.key, raw)
        return raw
    if get_origin(tp) is tuple:
        # A list: a YAML sequence of strings, or comma-separated text (env var, flag).
        if text and isinstance(raw, str):
            items: list[object] = [part.strip() for part in raw.split(",") if part.strip()]
        elif isinstance(raw, list | tuple):
            items = list(raw)
        else:
            raise ValueError(f"expected a list of strings; got {raw!r}")
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"expected a list of strings; got {raw!r}")
        values = tuple(str(item).strip() for item in items)
        _check_list(leaf.key, values)
        return values
    raise TypeError(f"setting {leaf.key!r} has unsupported type {tp!r}")  # a bug, not config


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
"""An HTTP field name (RFC 9110 §5.1)."""
_NOT_CREDENTIALS = frozenset(
    {"host", "cookie", "connection", "upgrade", "content-length", "content-type", "transfer-encoding", "te"}
)
"""Headers that describe the request or the connection, never a credential."""


def _check_header_name(value: str) -> None:
    if not _TOKEN.match(value):
        raise ValueError(f"{value!r} is not an HTTP header name")
    lowered = value.lower()
    if lowered in _NOT_CREDENTIALS or lowered.startswith(("sec-websocket-", "proxy-")):
        raise ValueError(f"{value!r} cannot be a credential header")


def _check_list(key: str, values: tuple[str, ...]) -> None:
    """Semantic checks of list settings, by key."""
    if key == "matching.tolerate":
        for value in values:
            names = [t.value for t in Tolerance]
            if value not in names:
                raise ValueError(f"expected a list of {', '.join(names)}; got {value!r}{suggest(value, names)}")
    if key == "identity.headers":
        seen: set[str] = set()
        for value in values:
            _check_header_name(value)
            if value.lower() in seen:
                raise ValueError(f"header {value!r} is listed twice")
            seen.add(value.lower())
    elif key == "identity.shared_objects":
        kinds = [k.value for k in ObjectKind]
        for value in values:
            if value not in kinds:
                raise ValueError(f"expected a list of {', '.join(kinds)}; got {value!r}{suggest(value, kinds)}")
    elif key == "listener.allowed_origins":
        for value in values:
            parts = urlsplit(value)
            bad = parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/")
            if value != "null" and bad:
                raise ValueError(f"expected origins like https://app.example:8443; got {value!r}")
    elif key == "listener.allowed_hosts":
        for value in values:
            if not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?", value):
                raise ValueError(f"expected host names like upshift.apps.svc or upshift:8080; got {value!r}")


def _check_string(key: str, value: str) -> None:
    """Semantic checks of string settings, by key (the only per-key rules)."""
    if key == "api_key.header":
        _check_header_name(value)
    elif key == "egress.proxy":
        if value not in ("env", "off"):
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"expected env, off or an http(s):// proxy URL; got {redact_url(value)!r}")
    elif key in ("listen", "admin_listen"):
        try:
            parse_hostport(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    elif key == "cluster.peers":
        for url in filter(None, (u.strip() for u in value.split(","))):
            _check_peer_url(url)
    elif key == "cluster.self_url" and value:
        _check_peer_url(value)
    elif key == "cluster.peers_dns" and value:
        try:
            parse_hostport(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    elif key == "upstream":
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            raise ValueError(f"expected an http(s):// or ws(s):// URL; got {redact_url(value)!r}")


def _check_peer_url(url: str) -> None:
    parts = urlsplit(url)
    # https:// is what replicas off loopback use (cluster.tls_*); http:// only with
    # cluster.plain_http_peers, which the cluster checks when it starts.
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ValueError(f"expected a peer base URL like https://10.0.0.1:8443 or http://10.0.0.1:8080; got {url!r}")
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError:
        hint = " (an IPv6 address goes in brackets: https://[fd00::5]:8443)" if parts.netloc.count(":") > 1 else ""
        raise ValueError(f"expected a peer base URL with a valid port{hint}; got {url!r}") from None


def check_settings(s: Settings) -> None:
    """Checks that involve more than one key."""
    if s.pool.max_sockets_per_identity > s.pool.max_sockets_total:
        raise ConfigError(
            f"settings: pool.max_sockets_per_identity ({s.pool.max_sockets_per_identity}) exceeds "
            f"pool.max_sockets_total ({s.pool.max_sockets_total})"
        )
    if s.pool.lanes_per_socket > 33:
        raise ConfigError(
            f"settings: pool.lanes_per_socket ({s.pool.lanes_per_socket}) exceeds 33 "
            "(the default lane plus the upstream's 32 named stream_ids per connection)"
        )
    if s.pool.max_active_per_socket > 16:
        raise ConfigError(
            f"settings: pool.max_active_per_socket ({s.pool.max_active_per_socket}) exceeds 16 "
            "(the upstream queues beyond 16 responses per connection)"
        )
    listed = {h.lower() for h in s.identity.headers}
    missing = [h for h in dict.fromkeys(("Authorization", "api-key", s.api_key.header)) if h.lower() not in listed]
    if missing:
        # a credential header the upstream accepts but the identity leaves out lets
        # two apps with different keys in it share sockets, heads and response ids.
        raise ConfigError(
            f"settings: identity.headers must list every credential header the upstream accepts; "
            f"missing {', '.join(missing)} (Authorization and api-key always, and api_key.header)",
            param="identity.headers",
        )
    c = s.cluster
    if c.peers and c.peers_dns:
        raise ConfigError("settings: set cluster.peers or cluster.peers_dns, not both")
    if (c.peers or c.peers_dns) and not c.self_url:
        raise ConfigError("settings: cluster.self_url is required with cluster.peers or cluster.peers_dns")
    if c.peers and c.self_url.rstrip("/") not in peer_urls(c.peers):
        raise ConfigError(f"settings: cluster.self_url ({c.self_url}) is not one of cluster.peers")
    host, port = parse_hostport(s.listen)
    if s.api_key.source != "passthrough" and not s.listener.allowed_hosts and not _loopback_host(host):
        # Any Host would be answered with the injected key: a DNS-rebound page (a laptop's
        # container publishing 0.0.0.0) could read every /v1 route with it.
        raise ConfigError(
            f"settings: listen ({s.listen}) is not loopback and api_key.source is {s.api_key.source}: "
            "set listener.allowed_hosts (UPSHIFT_LISTENER_ALLOWED_HOSTS) to the host names apps use "
            "to reach the sidecar, or listen on 127.0.0.1",
            param="listener.allowed_hosts",
        )
    admin_host, admin_port = parse_hostport(s.admin_listen)
    wildcard = ("0.0.0.0", "::")
    if port and port == admin_port and (host == admin_host or host in wildcard or admin_host in wildcard):
        raise ConfigError(f"settings: listen ({s.listen}) and admin_listen ({s.admin_listen}) share a port")


def _loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
