"""Settings: a frozen dataclass tree with defaults, and its loader.

Precedence: CLI flags > env (``UPSHIFT_*``) > YAML file > defaults. The loader
(:func:`load_settings`) lives here too; every key of ``config.yaml`` maps to one field below.

The loader is generic over the tree: a key is the dotted path of a leaf field
(``pool.max_sockets_per_identity``), its env var is ``UPSHIFT_`` plus the path upper-cased with
dots replaced by underscores (``UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY``), and its value is parsed
by the field's type hint. Adding a field to a dataclass below is all it takes to add a setting.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints
from urllib.parse import unquote_plus, urlsplit

import yaml

from proxy.errors import ConfigError
from proxy.reasons import ObjectKind, Tolerance
from proxy.redact import redact_url, redact_urls

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "DEFAULT_IDENTITY_HEADERS",
    "ApiKeySettings",
    "EgressSettings",
    "IdentitySettings",
    "ClusterSettings",
    "ListenerSettings",
    "LimitsSettings",
    "LoggingSettings",
    "MatchingSettings",
    "PoolSettings",
    "Settings",
    "ShutdownSettings",
    "StreamingSettings",
    "TimeoutSettings",
    "env_name",
    "load_settings",
    "merge_query",
    "parse_hostport",
    "peer_urls",
    "setting_keys",
    "settings_to_dict",
    "upstream_ws_url",
]


@dataclass(frozen=True, slots=True)
class ApiKeySettings:
    """Where the upstream credential comes from."""

    source: Literal["passthrough", "file", "env"] = "passthrough"
    """``passthrough``: forward the app's own ``Authorization`` header (laptop, multi-tenant);
    ``file``: inject the key read from ``api_key.file``; ``env``: inject the key from
    ``api_key.env`` (``--api-key-file`` implies ``file``)."""
    file: str = "/var/run/secrets/openai/api-key"
    """Key file, e.g. a Kubernetes Secret mounted as a directory; re-read when it changes, so
    Secret rotation needs no restart. To use it: set ``source: file`` and mount the Secret here."""
    env: str = "OPENAI_API_KEY"
    """Environment variable holding the key when ``source: env``."""
    header: str = "Authorization"
    """Header an injected key goes into: ``Authorization`` sends ``Bearer <key>``, any other name
    (``api-key`` for Azure OpenAI, a gateway's own key header) sends the bare key. The app's own
    ``Authorization``, ``api-key`` and this header are then not forwarded (they hold the app's
    placeholder), but still count in its identity, so tenants behind one key stay apart."""


DEFAULT_IDENTITY_HEADERS = ("Authorization", "api-key", "OpenAI-Organization", "OpenAI-Project", "OpenAI-Beta")
"""Credential headers of OpenAI (Bearer, organisation, project, beta) and Azure OpenAI (``api-key``)."""


@dataclass(frozen=True, slots=True)
class IdentitySettings:
    """What makes a credential."""

    headers: tuple[str, ...] = DEFAULT_IDENTITY_HEADERS
    """App request headers that form a credential: hashed into the identity (sockets and
    conversation heads never cross it) and sent on the upstream WebSocket upgrade. Any other
    header (per-turn metadata such as ``x-codex-turn-metadata``) never splits an identity and
    is not sent on the upgrade. A gateway with its own key header adds it here
    (``x-litellm-api-key``). ``OpenAI-Beta`` falls back to ``pool.openai_beta``. Must list
    ``Authorization``, ``api-key`` and ``api_key.header``: a list without them is refused (apps
    with different keys in a header left out would share one identity)."""
    shared_objects: tuple[str, ...] = ()
    """Behind an injected key, stored objects every tenant may reach (``conversations``,
    ``items``, ``files``, ``vector_stores``, ``chat_completions``, ``batches``, ``containers``,
    ``uploads``): their list routes are answered and their ids are not checked. Not listed (the
    default): each object is its creator's, a list route is refused (403 ``not_shared``) and so is
    an ``item_reference`` input."""


@dataclass(frozen=True, slots=True)
class LimitsSettings:
    """Request size limits and the memory budget (docs/reliability.md, "Memory")."""

    memory_bytes: int = 0
    """The sidecar's memory budget (RSS): request bodies with their parsed copies and frames, kept
    bodies and heads all draw from it. When it is taken, new request bodies wait unread (the
    app's connection backs up); only a request that waits longer than ``memory_wait_seconds``,
    or that could never fit, is answered 429/503 with ``retry-after`` (SDKs retry those). 0: 85%
    of the container's cgroup memory limit (``memory.max`` / ``memory.limit_in_bytes``), or 1 GiB
    without one. The shipped manifests: 256Mi → ~217 MiB; 1Gi → ~870 MiB."""
    memory_wait_seconds: float = 30.0
    """Longest a request waits for memory before it is answered 429 with ``retry-after``."""
    max_body_bytes: int = 0
    """Largest request body accepted from an app (413 above). 0: derived from the budget (the
    largest body that fits it, at most 64 MiB)."""
    ws_frame_budget_bytes: int = 15 * 1024 * 1024
    """Largest ``response.create`` frame sent upstream; larger requests go over HTTP."""
    body_timeout_seconds: float = 120.0
    """A request body must be complete this long after its head arrived (waiting for memory
    included); else 408 ``request_timeout`` and the connection is closed (docs/security.md)."""
    body_min_bytes_per_second: int = 16384
    """After ``body_grace_seconds`` of reading, a body must have arrived at this average rate
    at least (time waiting for memory not counted); else 408 and close. 0: no minimum."""
    body_grace_seconds: float = 5.0
    """When the minimum rate starts to count, and the longest a body may go silent (no byte
    arriving) while it is read."""


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """Upstream WebSocket pool."""

    max_sockets_per_identity: int = 32
    """Upstream sockets per credential, relay sessions included (real per-key limits are low:
    tens); counted by tenant (the app's credential), whatever query string or optional headers
    split its identities."""
    max_sockets_total: int = 256
    """Sockets across all credentials (at least ``max_sockets_per_identity``); at the limit the
    least recently used socket with nothing in flight is closed."""
    lanes_per_socket: int = 32
    """Lanes per socket, the default lane included: the default lane plus up to 32 named
    ``stream_id`` lanes (at most 33). 1: the default lane only (an upstream without lanes; the
    sidecar also falls back to 1 by itself when the upstream refuses a ``stream_id``)."""
    max_active_per_socket: int = 16
    """Responses in flight per socket across its lanes (at most 16; the upstream queues beyond)
    when placing a new conversation; a conversation's next turn goes on its own lane whatever
    the count (queued upstream: cheaper than a full send elsewhere)."""
    spread_sockets: int = 32
    """New conversations get a socket of their own until a credential has this many sockets;
    beyond, they share sockets through lanes (a dropped socket then takes fewer heads with it)."""
    reseed: bool = False
    """When a socket is rotated (``rotate_after_seconds``), rebuild its ``store: false`` heads on a
    fresh lane with a ``generate: false`` create (never a billed generation, never seen by the
    app), so their next turn stays a continuation. Stored heads need none (the upstream hydrates)."""
    reseed_bytes: int = 64 * 1024 * 1024
    """Memory for the contexts re-seeding keeps (request bodies and outputs), least recently used
    out first."""
    http_connections: int = 4096
    """HTTP requests in flight to the upstream at once (the plain-HTTP relay's connection pool);
    more wait for a slot, and the wait counts in the added latency. As many as the listener
    admits connections (``listener.max_connections``): a bound below the app's own concurrency
    makes turns wait that the app, sending straight to the upstream, would not."""
    wait_seconds: float = 1.0
    """The longest a request waits for a free lane when every lane it may use is busy, before it
    goes over HTTP (``pool_full``); within it a turn waits only while that is expected to pay
    (``proxy/core/waiting.py``, else ``wait_not_worth_it``). While the identity's sockets are still opening or probing
    their lanes (a burst of new conversations), the wait counts from when that stops, at most
    ``timeouts.connect_seconds`` later."""
    idle_close_seconds: float = 900.0
    """Close a socket unused for this long (its conversation head goes with it), and a WebSocket
    relay session with no message either way for as long."""
    rotate_after_seconds: float = 3300.0
    """Retire a socket this old (55 min, before the 60-minute limit), only while idle."""
    ping_interval_seconds: float = 20.0
    """Keepalive ping period on upstream sockets."""
    ping_timeout_seconds: float = 20.0
    """Drop a socket whose pong does not arrive within this time."""
    openai_beta: str = ""
    """``OpenAI-Beta`` header for the upgrade (empty: none, as the GA API expects)."""
    compression: bool = False
    """Offer permessage-deflate on upstream sockets."""
    fragment_bytes: int = 0
    """Send a ``response.create`` larger than this as one message in fragments of this size (0: one
    frame per message, as the official clients send; protocol.md §5 lists fragments as untested
    against the real API). One whole frame holds about 2.5× its size while it is serialised,
    masked and written (~38 MiB for the largest, ``limits.ws_frame_budget_bytes`` = 15 MiB),
    against ~0.23× with 1 MiB fragments; a request whose frame goes whole reserves half a frame
    more in the memory budget until it is sent."""
    http_continuations: bool = True
    """When no lane can be had for a stored conversation (every socket busy, the socket cap
    reached), continue it over plain HTTP with ``previous_response_id`` + the new items instead
    of its full history (the upstream hydrates the stored response)."""
    http_continuation_after_seconds: float = 0.01
    """How long such a turn waits for lanes a moment away (a socket opening or probing its
    lanes) before the HTTP continuation; for busy lanes it waits only while that pays."""
    cap_probe_seconds: float = 600.0
    """After an upgrade was refused for the socket cap (429), how long before one upgrade above
    the learned cap tries whether the limit was raised."""
    cap_state_dir: str = ""
    """Private directory (0700) where the workers of a machine share learned socket caps; empty:
    ``$XDG_RUNTIME_DIR/upshift``, else ``/tmp/upshift-<uid>``; ``off``: not shared."""


@dataclass(frozen=True, slots=True)
class TimeoutSettings:
    """Timeouts towards the upstream."""

    connect_seconds: float = 10.0
    """TCP + TLS + WebSocket handshake."""
    stream_idle_seconds: float = 900.0
    """Longest silence between two upstream events of one response (slow reasoning turns)."""
    http_total_seconds: float = 3600.0
    """Whole-request limit for HTTP passthrough."""


@dataclass(frozen=True, slots=True)
class EgressSettings:
    """The network path to the upstream (both the WebSocket upgrade and the HTTP relay)."""

    proxy: str = "env"
    """``env``: the forward proxy of ``HTTPS_PROXY`` / ``HTTP_PROXY`` (by the upstream's scheme)
    unless ``NO_PROXY`` lists the upstream host, as the openai SDK does; ``off``: connect
    directly; or a proxy URL (``http://[user:pass@]host:port``), used for every upstream
    connection."""
    ca_file: str = ""
    """PEM file of extra CA certificates trusted for the upstream's TLS (a TLS-inspecting proxy,
    an internal gateway), added to the system store; ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` are
    honoured as well. Empty: none."""


@dataclass(frozen=True, slots=True)
class StreamingSettings:
    """Streaming answers to the app."""

    hold_back_seconds: float = 0.1
    """Longest time ``response.created`` / ``in_progress`` are held back waiting for the first
    output (so that a socket lost before output can be replayed invisibly); after that they go
    to the app, and a later failure is surfaced as an error event. 0 never holds them."""


@dataclass(frozen=True, slots=True)
class MatchingSettings:
    """Conversation matching."""

    tolerate: tuple[str, ...] = ()
    """Echoes that differ from the previous output in a way the model sees, continued anyway (the
    model then sees what the app left out; each counted in
    ``upshift_echo_tolerances_total{tolerance}``): ``reasoning`` (the echo leaves out reasoning
    items, client-echo.md rule 6), ``phase`` (the echo sends an assistant message without its
    ``phase``, e.g. pydantic-ai for model ids it does not know to support ``phase``,
    llama-index, LangChain's chat form). Empty: every such echo is a full send, explained on
    /misses (``dropped_reasoning``, ``dropped_phase``)."""
    allow_dropped_reasoning: bool = False
    """Deprecated: ``tolerate: [reasoning]``. Still honoured (added to ``tolerate``)."""
    max_heads: int = 10000
    """Conversation heads kept in memory across all credentials (least recently used go first)."""
    head_ttl_seconds: float = 3600.0
    """Forget a head unused for this long."""
    hot_prefix_bytes: int = 0
    """Request bodies kept, in total, so the next turn's history prefix is checked by a byte
    comparison instead of a SHA-256 digest (faster; same answer). 0: half the memory budget's
    share for requests; kept bodies give way to requests first either way."""
    hot_prefix_seconds: float = 120.0
    """A kept body is let go this long after its turn (idle heads keep only digests)."""

    def tolerances(self) -> frozenset[Tolerance]:
        """``tolerate`` with the deprecated ``allow_dropped_reasoning`` folded in."""
        found = {Tolerance(value) for value in self.tolerate}
        if self.allow_dropped_reasoning:
            found.add(Tolerance.REASONING)
        return frozenset(found)


@dataclass(frozen=True, slots=True)
class LoggingSettings:
    """Logs."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    """``debug``, ``info``, ``warning`` or ``error``."""
    access_log: bool = True
    """One JSON line per request (logger ``upshift.access``)."""


@dataclass(frozen=True, slots=True)
class ShutdownSettings:
    """Drain on SIGTERM."""

    grace_seconds: float = 25.0
    """Time in-flight requests get to finish after SIGTERM before sockets are closed; keep it
    below the Pod's ``terminationGracePeriodSeconds``."""


@dataclass(frozen=True, slots=True)
class ListenerSettings:
    """The API listener, hardened for a network (a gateway, replicas and peers reach it)."""

    max_connections: int = 4096
    """Open connections on the API listener; one more is answered 503 and closed."""
    header_timeout_seconds: float = 5.0
    """A connection that has not sent a request's complete headers this long after it opened
    (or after the first byte of a later request) is closed."""
    keepalive_seconds: float = 75.0
    """Close a keep-alive connection idle between requests for this long."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins (``https://app.example``) whose requests are let through; a request that
    carries any other ``Origin`` header (a web page: cross-site POSTs, WebSocket upgrades) gets
    403 ``origin_not_allowed``. The sidecar never grants CORS: OPTIONS is answered locally
    without it."""
    allowed_hosts: tuple[str, ...] = ()
    """``Host`` names (``name`` or ``name:port``) the API listener answers to. On loopback, the
    listen address, ``localhost`` and loopback IPs are always accepted and any other ``Host``
    gets 403 ``host_not_allowed`` (DNS rebinding); on any other address (a gateway) list its
    Service names here; empty there: any ``Host``, so with an injected key the sidecar refuses
    to start without them."""


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """Conversation affinity across replicas (workers of one machine are peers automatically)."""

    peers: str = ""
    """Base URLs of all replicas, comma-separated (``https://10.0.0.1:8443,https://10.0.0.2:8443``,
    their ``peer_listen``; ``http://`` only with ``plain_http_peers``), this one included;
    empty: no replicas (unless ``peers_dns``)."""
    self_url: str = ""
    """This replica's name in the peer set (exactly as listed, or as DNS yields it:
    ``https://<pod IP>:<port>``); never derived from the listen address."""
    peers_dns: str = ""
    """``name:port`` of a headless Service whose addresses are the replicas (instead of
    ``peers``); re-resolved every ``dns_refresh_seconds``."""
    dns_refresh_seconds: float = 5.0
    """How often ``peers_dns`` is re-resolved."""
    secret_file: str = ""
    """File holding the secret shared by the replicas (one per line: the first signs, a second
    still verifies, for rotation). Every replica forward is signed with it (HMAC over method,
    path, time, nonce, body digest) and an owner refuses (403) one that is not; a replica is
    sent forwards only after it proved it holds it. Empty: forwards unsigned, peers unproven."""
    plain_http_peers: bool = False
    """Allow forwards between replicas over plain HTTP (``http://`` peers): they carry the apps'
    keys, so only for loopback tests; logged. Otherwise peers must be ``https://``."""
    peer_listen: str = ""
    """``host:port`` of a listener for forwards from other replicas, TLS with
    ``tls_cert_file``/``tls_key_file`` (empty: none; forwards then arrive on ``listen``)."""
    tls_cert_file: str = ""
    """Certificate (PEM, chain included) the peer listener presents to other replicas."""
    tls_key_file: str = ""
    """Private key (PEM) of ``tls_cert_file``."""
    tls_ca_file: str = ""
    """CA bundle (PEM) that signs the replicas' peer certificates: ``https://`` peers are
    verified against it (``peers_dns`` then resolves to ``https://`` URLs)."""
    tls_server_name: str = ""
    """Name every replica's peer certificate carries, checked instead of the peer URL's host
    (replicas are addressed by pod IP; one certificate names them all). Empty: the URL's host."""
    connect_timeout_seconds: float = 0.75
    """A forward whose owner has not accepted the request (connected and answered ``100
    Continue``) within this time is served locally, and the owner is marked down."""
    down_seconds: float = 5.0
    """How long an owner that failed stays skipped before it is tried again."""
    max_forwards_per_peer: int = 64
    """Forwards in flight to one peer; more wait up to ``connect_timeout_seconds`` for a slot,
    then are served locally."""
    handoff: bool = True
    """With ``--workers``: a request on a worker not owning its conversation hands the app's
    connection itself to the owner (``SCM_RIGHTS``), which then serves it and the later requests
    on it; ``false``: every such request is forwarded as bytes (proxy/ingress/handoff.py)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """All settings of the sidecar."""

    listen: str = "127.0.0.1:8080"
    """API listener: the app's ``OPENAI_BASE_URL`` points here (``http://127.0.0.1:8080/v1``). Keep
    it on loopback in a sidecar (only the Pod's own containers reach it); IPv6: ``"[::1]:8080"``."""
    admin_listen: str = "127.0.0.1:9090"
    """Admin listener: /healthz, /readyz, /metrics, the status page. Loopback, so the LAN and web
    pages never see it; in Kubernetes (``KUBERNETES_SERVICE_HOST`` set) when no source sets it:
    ``0.0.0.0:9090``, the kubelet's probes reaching the pod IP
    (:data:`ADMIN_LISTEN_IN_KUBERNETES`; the shipped manifests set it too). It answers only
    ``Host`` names that are an IP address, ``localhost`` or in ``listener.allowed_hosts`` (DNS
    rebinding gets 403)."""
    upstream: str = "https://api.openai.com/v1"
    """Upstream base URL; the WebSocket URL is this with http→ws, https→wss, plus /responses. Its
    path prefix and query string are kept on both (Azure OpenAI:
    ``https://RESOURCE.openai.azure.com/openai/v1``)."""
    mode: Literal["websocket", "http"] = "websocket"
    """``websocket``: relay continuations over pooled upstream WebSockets; ``http``: plain
    passthrough (WebSocket use off entirely)."""
    api_key: ApiKeySettings = field(default_factory=ApiKeySettings)
    identity: IdentitySettings = field(default_factory=IdentitySettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    timeouts: TimeoutSettings = field(default_factory=TimeoutSettings)
    egress: EgressSettings = field(default_factory=EgressSettings)
    streaming: StreamingSettings = field(default_factory=StreamingSettings)
    matching: MatchingSettings = field(default_factory=MatchingSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    shutdown: ShutdownSettings = field(default_factory=ShutdownSettings)
    workers: int = 1
    """Worker processes sharing the API listen address (``SO_REUSEPORT``): one per core you want
    to use. Above 1, a supervisor owns the admin listener (its /metrics covers every worker, with
    a ``worker`` label), restarts a worker that dies and drains them all on SIGTERM; a request
    that lands on the wrong worker goes to the worker that owns its conversation."""
    listener: ListenerSettings = field(default_factory=ListenerSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    @property
    def ws_url(self) -> str:
        """The upstream WebSocket URL for ``/responses``: the base URL's path prefix
        (``/openai/v1``) and query string kept, the app's own query string not included
        (``Identity.ws_url`` adds it)."""
        return upstream_ws_url(self.upstream, "")


def merge_query(base: str, app: str) -> str:
    """The query string of an upstream request: the upstream URL's own parameters, then the
    app's, except those the upstream URL already sets (the configured value wins).

    Both are raw (still percent-encoded) query strings without ``?``; so is the result.
    """
    if not app:
        return base
    if not base:
        return app
    names = {unquote_plus(pair.partition("=")[0]) for pair in base.split("&") if pair}
    kept = [pair for pair in app.split("&") if pair and unquote_plus(pair.partition("=")[0]) not in names]
    return "&".join([base, *kept]) if kept else base


def upstream_ws_url(upstream: str, app_query: str) -> str:
    """The upstream WebSocket URL of ``/responses`` for an app's raw query string.

    ``https://r.openai.azure.com/openai/v1?x=1`` and ``api-version=2`` give
    ``wss://r.openai.azure.com/openai/v1/responses?x=1&api-version=2``.
    """
    parts = urlsplit(upstream)
    scheme = {"https": "wss", "http": "ws"}.get(parts.scheme, parts.scheme)
    query = merge_query(parts.query, app_query)
    url = f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}/responses"
    return f"{url}?{query}" if query else url


# --------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------

ENV_PREFIX = "UPSHIFT_"
"""Prefix of every environment variable the loader reads."""
CONFIG_ENV = "UPSHIFT_CONFIG"
"""Environment variable naming the YAML file (``--config`` wins over it)."""
BUILD_ENV = frozenset({"UPSHIFT_COMPILE", "UPSHIFT_EXPECT_BUILD"})
"""Read by the build (``hatch_build.py``) and its tests (``tests/test_build.py``), not by the
sidecar: set in a shell that then runs it, they are no typo."""

_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

# Kubernetes injects ``<SERVICE>_SERVICE_HOST``, ``<SERVICE>_PORT_8080_TCP`` ... for every
# Service in the namespace (enableServiceLinks); a Service called "upshift..." must not make
# the strict env check crash every sidecar in that namespace.
_SERVICE_LINK = re.compile(r"^UPSHIFT_\w*?(?:SERVICE_HOST|SERVICE_PORT(?:_\w+)?|PORT_\d+_(?:TCP|UDP|SCTP)\w*)$")
_SERVICE_LINK_PORT = re.compile(r"^(?:tcp|udp|sctp)://")
"""``<SERVICE>_PORT`` is matched by its value, so ``UPSHIFT_LISTEN_PORT=8080`` is still an error."""

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
class _Leaf:
    """One settable field of the tree."""

    key: str
    """Dotted path, e.g. ``pool.max_sockets_per_identity``."""
    type: Any
    """Resolved type hint (``int``, ``float``, ``bool``, ``str``, a ``Literal`` or
    ``tuple[str, ...]``, a list)."""


def _collect_leaves(cls: type[Any], prefix: str = "") -> dict[str, _Leaf]:
    leaves: dict[str, _Leaf] = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            leaves.update(_collect_leaves(hint, f"{prefix}{f.name}."))
        else:
            leaves[prefix + f.name] = _Leaf(prefix + f.name, hint)
    return leaves


def env_name(key: str) -> str:
    """The environment variable for a dotted key.

    Args:
        key: A dotted setting path such as ``pool.max_sockets_per_identity``.

    Returns:
        ``UPSHIFT_`` + the path upper-cased, dots as underscores
        (``UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY``).
    """
    return ENV_PREFIX + key.replace(".", "_").upper()


_LEAVES = _collect_leaves(Settings)
_SECTIONS = frozenset(key.rpartition(".")[0] for key in _LEAVES if "." in key)
_BY_ENV = {env_name(key): leaf for key, leaf in _LEAVES.items()}
# Underscores join both section and key names, so two paths could map to one variable; fail
# at import rather than silently shadowing one setting with another.
if len(_BY_ENV) != len(_LEAVES) or CONFIG_ENV in _BY_ENV:
    raise RuntimeError("two settings map to the same UPSHIFT_* variable")


def setting_keys() -> tuple[str, ...]:
    """Every dotted setting key, in declaration order (``listen``, ..., ``shutdown.grace_seconds``)."""
    return tuple(_LEAVES)


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    # A truncated name names its completions first; then the closest spellings.
    close = [c for c in choices if c.startswith(word)][:3]
    close = close or difflib.get_close_matches(word, choices, n=2, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


def parse_hostport(value: str) -> tuple[str, int]:
    """Split ``host:port`` into its parts.

    Args:
        value: ``127.0.0.1:8080``, ``0.0.0.0:9090``, ``localhost:8080`` or ``[::1]:8080``
            (an IPv6 address needs brackets). Port 0 means "any free port".

    Returns:
        ``(host, port)`` with the brackets of an IPv6 host removed.

    Raises:
        ConfigError: The value is not a valid ``host:port``.
    """
    text = value.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"invalid host:port {value!r}: expected '[ipv6]:port'")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"invalid host:port {value!r}: {host!r} is not an IPv6 address") from None
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ConfigError(f"invalid host:port {value!r}: expected 'host:port'")
        if ":" in host:
            raise ConfigError(f"invalid host:port {value!r}: write an IPv6 address as '[{host}]:port'")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"invalid host:port {value!r}: port must be a number in 0..65535")
    return host, int(port_text)


def _coerce(leaf: _Leaf, raw: object, *, text: bool) -> object:
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
                raise ValueError(f"expected a list of {', '.join(names)}; got {value!r}{_suggest(value, names)}")
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
                raise ValueError(f"expected a list of {', '.join(kinds)}; got {value!r}{_suggest(value, kinds)}")
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


def _value(leaf: _Leaf, raw: object, *, text: bool, where: str) -> object:
    try:
        return _coerce(leaf, raw, text=text)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}", param=leaf.key) from None


def _from_file(path: str) -> dict[str, object]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:  # an empty or all-comments file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    out: dict[str, object] = {}
    _flatten(data, "", path, out)
    return out


def _flatten(data: dict[Any, Any], prefix: str, path: str, out: dict[str, object]) -> None:
    for name, raw in data.items():
        key = f"{prefix}{name}"
        if key in _SECTIONS:
            if raw is None:  # "pool:" with every key commented out
                continue
            if not isinstance(raw, dict):
                raise ConfigError(f"{path}: key '{key}' must be a mapping", param=key)
            _flatten(raw, key + ".", path, out)
        elif key in _LEAVES:
            out[key] = _value(_LEAVES[key], raw, text=False, where=f"{path}: key '{key}'")
        else:
            hint = _suggest(key, [*_LEAVES, *_SECTIONS])
            raise ConfigError(f"{path}: unknown key '{key}'{hint}", param=key)


def _is_service_link(name: str, value: str) -> bool:
    if _SERVICE_LINK.match(name):
        return True
    return name.endswith("_PORT") and bool(_SERVICE_LINK_PORT.match(value))


def _from_env(env: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV or name in BUILD_ENV or _is_service_link(name, raw):
            continue
        leaf = _BY_ENV.get(name)
        if leaf is None:
            hint = _suggest(name, [*_BY_ENV, CONFIG_ENV])
            raise ConfigError(f"environment: unknown variable {name}{hint}", param=name)
        out[leaf.key] = _value(leaf, raw, text=True, where=f"environment: {name} ({leaf.key})")
    return out


def _from_flags(values: Mapping[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, raw in values.items():
        if raw is None:  # argparse default: flag not given
            continue
        leaf = _LEAVES.get(key)
        if leaf is None:
            raise ConfigError(f"command line: unknown setting '{key}'{_suggest(key, list(_LEAVES))}")
        out[key] = _value(leaf, raw, text=True, where=f"command line: {key}")
    return out


def _build(cls: type[Any], values: Mapping[str, object], prefix: str = "") -> Any:
    hints = get_type_hints(cls)
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, key + ".")
        elif key in values:
            kwargs[f.name] = values[key]
    return cls(**kwargs)


def _check_settings(s: Settings) -> None:
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


def peer_urls(value: str) -> tuple[str, ...]:
    """``cluster.peers`` as a tuple of normalised base URLs (no trailing slash)."""
    return tuple(sorted({u.strip().rstrip("/") for u in value.split(",") if u.strip()}))


ADMIN_LISTEN_IN_KUBERNETES = "0.0.0.0:9090"
"""``admin_listen`` when no flag, variable or file sets it and ``KUBERNETES_SERVICE_HOST`` is set
(every container of a Pod has it): the kubelet's probes and Prometheus reach the pod IP. Outside
Kubernetes the default stays loopback, so a laptop's LAN never sees the status page."""


def load_settings(
    argv_values: Mapping[str, object] | None,
    env: Mapping[str, str],
    config_path: str | None,
) -> Settings:
    """Build the effective settings: flags > env > YAML file > defaults.

    Args:
        argv_values: Flag values by dotted key (``"listen"``, ``"logging.level"``); ``None``
            values mean "not given". Strings are parsed like env values.
        env: The environment (``os.environ``). Every ``UPSHIFT_*`` variable must map to a key,
            except ``UPSHIFT_CONFIG`` and Kubernetes service-link variables.
        config_path: YAML file to read; when ``None``, ``env["UPSHIFT_CONFIG"]`` if set, else
            no file.

    Returns:
        The validated, frozen settings.

    Raises:
        ConfigError: Unknown key or variable, mistyped or out-of-range value, unreadable file.
            The message names the source and the key.
    """
    path = config_path if config_path is not None else env.get(CONFIG_ENV) or None
    values: dict[str, object] = {}
    if path is not None:
        values.update(_from_file(os.path.expanduser(path)))
    values.update(_from_env(env))
    values.update(_from_flags(argv_values or {}))
    if "admin_listen" not in values and env.get("KUBERNETES_SERVICE_HOST"):
        values["admin_listen"] = ADMIN_LISTEN_IN_KUBERNETES
    settings: Settings = _build(Settings, values)
    _check_settings(settings)
    return settings


def settings_to_dict(settings: Settings) -> dict[str, Any]:
    """The settings as nested plain dicts in declaration order (the shape of ``config.yaml``).

    No setting holds a secret today (the key itself is only ever read from a file or env var,
    never stored here); a field named like one is still left out, so adding one later cannot
    leak it through ``--print-config``.
    """
    return _to_dict(settings)


_SECRET_NAME = re.compile(r"(^|_)(secret|password|token)$")


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _to_dict(value)
        elif not _SECRET_NAME.search(f.name):
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, str) and "://" in value:
                # a URL's credentials (userinfo, key= in its query) never reach --print-config
                value = redact_urls(redact_url(value))
            out[f.name] = value
    return out
