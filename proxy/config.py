"""Settings: the frozen dataclass tree of every key with its default and meaning.

Every key of ``config.yaml`` maps to one leaf field below; the attribute docstrings are the
reference (``python -m proxy.ops.refdocs --write`` generates ``docs/reference/configuration.md``
and ``config.yaml`` from them). Adding a field to a dataclass below is all it takes to add a
setting: :mod:`proxy.config_load` reads it from the file, the environment and the flags
(precedence: CLI flags > env (``UPSHIFT_*``) > YAML file > defaults), :mod:`proxy.config_check`
checks its value. Also here: the two value formats other modules parse (``host:port``, the peer
list) and the upstream URL a setting names.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import unquote_plus, urlsplit

from proxy.errors import ConfigError
from proxy.reasons import Tolerance

__all__ = [
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
    "merge_query",
    "parse_hostport",
    "peer_urls",
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
    ``uploads``): their list routes are answered and their ids are not checked; ``untracked``:
    the ``/v1`` routes of objects the sidecar does not track (fine-tuning jobs, evals, assistants,
    threads, ...) are forwarded unchecked, so every tenant sees every other's objects on them. Not
    listed (the default): each object is its creator's tenant's (an ``item_reference`` input names
    an item the sidecar saw created for the caller, else it is refused as an unknown id), a list
    route is refused (403 ``not_shared``), and so is every ``/v1`` route that is neither a
    ``/v1/responses`` route, a known collection's nor one naming no stored object (models,
    embeddings, moderations, completions, audio, images, realtime client secrets)."""


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


def peer_urls(value: str) -> tuple[str, ...]:
    """``cluster.peers`` as a tuple of normalised base URLs (no trailing slash)."""
    return tuple(sorted({u.strip().rstrip("/") for u in value.split(",") if u.strip()}))
