"""The network path to the upstream: the forward proxy and the TLS trust of both clients.

A company network often allows egress only through a forward proxy (``HTTPS_PROXY``) and may
inspect TLS with its own CA. The openai SDK honours ``HTTPS_PROXY`` / ``HTTP_PROXY`` /
``ALL_PROXY`` / ``NO_PROXY`` (lower case first, as curl) and ``SSL_CERT_FILE``; so does the sidecar, for the WebSocket
upgrade and the HTTP relay alike (``egress.proxy``, ``egress.ca_file``). One
:class:`ssl.SSLContext` serves both clients.

An upstream on loopback (``127.0.0.0/8``, ``::1``, ``localhost``) never goes through a proxy
taken from the environment (no proxy could reach the Pod's own loopback); an explicit
``egress.proxy`` URL is used for it too.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from websockets.exceptions import InvalidProxy

try:  # websockets >= 16 has it in websockets.proxy; 15.x, the lowest allowed, in websockets.uri
    from websockets.proxy import parse_proxy
except ImportError:  # pragma: no cover - exercised by .ci/ranges at the lowest versions
    from websockets.uri import parse_proxy  # type: ignore[attr-defined,no-redef]

from proxy.config import EgressSettings, Settings
from proxy.errors import ConfigError
from proxy.redact import redact_url, remember

__all__ = ["ENV_NAMES", "Egress", "check_proxy_url", "egress_for"]

ENV_NAMES = (
    "https_proxy",
    "HTTPS_PROXY",
    "http_proxy",
    "HTTP_PROXY",
    "all_proxy",
    "ALL_PROXY",
    "no_proxy",
    "NO_PROXY",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
)
"""Environment variables that decide the egress path."""


@dataclass(frozen=True, slots=True)
class Egress:
    """How to reach the upstream."""

    proxy: str | None
    """Forward proxy URL (``http://[user:pass@]host:port``), or ``None``: connect directly."""
    ssl: ssl.SSLContext | None
    """TLS context for an ``https``/``wss`` upstream; ``None`` for plain ``http``/``ws``."""

    def without_credentials(self) -> tuple[str | None, dict[str, str]]:
        """The proxy URL without its userinfo, and the ``Proxy-Authorization`` header that
        carries it (aiohttp sends no credentials from an explicit proxy URL by itself)."""
        if self.proxy is None:
            return None, {}
        parts = urlsplit(self.proxy)
        if parts.username is None and parts.password is None:
            return self.proxy, {}
        host = parts.netloc.rpartition("@")[2]
        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        return parts._replace(netloc=host).geturl(), {"Proxy-Authorization": f"Basic {token}"}

    def for_websockets(self) -> str | None:
        """The proxy URL for websockets, which sends the userinfo as written: percent-encoding
        decoded (as curl, httpx and aiohttp do) wherever the decoded text still parses as the
        same URL."""
        if self.proxy is None:
            return None
        parts = urlsplit(self.proxy)
        if parts.username is None or parts.password is None:
            return self.proxy
        user, password = unquote(parts.username), unquote(parts.password)
        if any(c in user for c in ":@/?#") or any(c in password for c in "/?#") or not (user + password).isascii():
            return self.proxy
        host = parts.netloc.rpartition("@")[2]
        return parts._replace(netloc=f"{user}:{password}@{host}").geturl()

    def describe(self) -> str:
        """For logs: the proxy without its password."""
        return f"via proxy {redact_url(self.proxy)}" if self.proxy else "direct"


def _env(environ: Mapping[str, str], name: str) -> str:
    """``name`` in lower case first (curl's and urllib's order), then upper case."""
    return (environ.get(name.lower()) or environ.get(name.upper()) or "").strip()


def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether ``NO_PROXY`` lists ``host``: ``*``, a host or domain (``example.com`` and
    ``.example.com`` both match its subdomains), an optional ``:port``, an IP or a CIDR block."""
    host = host.lower().strip("[]").rstrip(".")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        entry_port: int | None = None
        if entry.startswith("["):  # [::1]:443
            entry, _, rest = entry[1:].partition("]")
            entry_port = int(rest[1:]) if rest[1:].isdigit() else None
        elif entry.count(":") == 1:
            entry, _, port_text = entry.partition(":")
            entry_port = int(port_text) if port_text.isdigit() else None
        if entry_port is not None and entry_port != port:
            continue
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        domain = entry.lstrip(".").rstrip(".")
        if domain and (host == domain or host.endswith("." + domain)):
            return True
    return False


def _env_proxy(upstream: str, environ: Mapping[str, str]) -> str | None:
    parts = urlsplit(upstream)
    host = parts.hostname or ""
    if _is_loopback(host):
        return None
    secure = parts.scheme in ("https", "wss")
    proxy = _env(environ, "https_proxy" if secure else "http_proxy") or _env(environ, "all_proxy")
    if not proxy:
        return None
    port = parts.port or (443 if secure else 80)
    if _bypassed(host, port, _env(environ, "no_proxy")):
        return None
    if "://" not in proxy:  # "proxy:3128", as curl accepts it
        proxy = "http://" + proxy
    return proxy


def _context(egress: EgressSettings, environ: Mapping[str, str]) -> ssl.SSLContext:
    context = ssl.create_default_context()
    cert_file, cert_dir = environ.get("SSL_CERT_FILE", ""), environ.get("SSL_CERT_DIR", "")
    try:
        if cert_file or cert_dir:
            context.load_verify_locations(cafile=cert_file or None, capath=cert_dir or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"SSL_CERT_FILE / SSL_CERT_DIR: cannot load CA certificates: {exc}") from None
    if egress.ca_file:
        try:
            context.load_verify_locations(cafile=os.path.expanduser(egress.ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"egress.ca_file: cannot load CA certificates from {egress.ca_file!r}: {exc}", param="egress.ca_file"
            ) from None
    return context


def check_proxy_url(url: str) -> None:
    """Refuse a proxy URL websockets would refuse (a path, query or fragment, a user without a
    password, no host), as websockets checks it, at startup: otherwise the first WebSocket
    upgrade fails with websockets' ``InvalidProxy``, whose text is the whole URL, password and
    all. The message names the URL without its credentials.

    Raises:
        ConfigError: with the reason and the redacted URL.
    """
    remember(url)  # its password is masked in every later text, whatever characters it holds
    try:
        parse_proxy(url)
    except InvalidProxy as exc:
        raise ConfigError(f"egress.proxy: {redact_url(url)!r} is not a valid proxy URL: {exc.msg}") from None


@functools.lru_cache(maxsize=16)
def _build(upstream: str, egress: EgressSettings, env: tuple[tuple[str, str], ...]) -> Egress:
    environ = dict(env)
    if egress.proxy == "off":
        proxy = None
    elif egress.proxy == "env":
        proxy = _env_proxy(upstream, environ)
        if proxy is not None and urlsplit(proxy).scheme not in ("http", "https"):
            raise ConfigError(f"egress.proxy: env: unsupported proxy {redact_url(proxy)!r} (http:// or https:// only)")
    else:
        proxy = egress.proxy
    if proxy is not None:
        check_proxy_url(proxy)
    secure = urlsplit(upstream).scheme in ("https", "wss")
    return Egress(proxy, _context(egress, environ) if secure else None)


def egress_for(settings: Settings, environ: Mapping[str, str] | None = None) -> Egress:
    """The egress path of ``settings.upstream``.

    The same settings and environment give the same object, so the WebSocket client and the
    HTTP relay share one :class:`ssl.SSLContext`.

    Args:
        settings: ``upstream`` and ``egress``.
        environ: The environment (default ``os.environ``); only :data:`ENV_NAMES` are read.

    Raises:
        ConfigError: ``egress.ca_file`` (or ``SSL_CERT_FILE``) cannot be loaded, or the
            environment names a proxy of an unsupported scheme.
    """
    env = os.environ if environ is None else environ
    relevant = tuple((name, env[name]) for name in ENV_NAMES if name in env)
    return _build(settings.upstream, settings.egress, relevant)
