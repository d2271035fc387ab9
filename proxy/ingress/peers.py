"""The peers of one process: who they are, and whether one is trusted.

Replicas are named by base URL (``cluster.peers``, or the addresses of ``cluster.peers_dns``
through a :data:`Resolver`), compared as :func:`peer_key` spells them, and reached over the TLS
of :func:`tls_client`; the workers of one machine by their place (:class:`WorkerPlacement`).
Trust between replicas rests on the cluster secret (:mod:`proxy.ingress.peerauth`): a replica is
sent a forward only after :func:`ask_proof` got its proof, a question is answered only when it
names this replica (:func:`is_me`), and an unsigned forward gets :func:`refused_forward`.
Without a secret only addresses count (:func:`member_address`). How the peers are used (owners,
forwards) is :mod:`proxy.ingress.cluster`'s.

With ``cluster.secret_file`` every replica forward is signed (an HMAC over method, path, time,
nonce and body digest) and an owner refuses (403, counted in ``upshift_forwards_received_total{verified="false"}``) a
marked request that is not; a replica is sent a forward only after it proved it holds the
secret, so a process that merely got into the peer set receives no traffic. Forwards go over
TLS (``https://`` peers, verified against ``cluster.tls_ca_file``; the owner's
``cluster.peer_listen`` serves ``cluster.tls_cert_file``); plain HTTP between replicas needs
``cluster.plain_http_peers: true`` (loopback tests), said in the log. Without a secret the
marker only turns forwarding off, so a forged one gets its request served where it landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from yarl import URL

from proxy.config import Settings
from proxy.errors import ConfigError
from proxy.ingress.forward import REFUSED_HEADER, Peer
from proxy.ingress.peerauth import PROOF_HEADER, PROOF_PATH, PeerAuth
from proxy.ingress.private import Trust
from proxy.serve.streaming import json_body

__all__ = [
    "MARKER",
    "Resolver",
    "WorkerPlacement",
    "address_of",
    "ask_proof",
    "is_me",
    "member_address",
    "peer_key",
    "refused_forward",
    "resolve_peers",
    "system_resolver",
    "tls_client",
]

log = logging.getLogger("proxy.ingress.cluster")  # the cluster's lines keep their logger

MARKER = "x-upshift-forwarded"
"""Request header of a replica forward: ``replica;<hop>;<time>;<nonce>;<signature>``."""
_REFUSAL_BODY = {
    "error": {
        "message": "This forward is not signed with the cluster secret.",
        "type": "invalid_request_error",
        "param": None,
        "code": "forward_unauthenticated",
    }
}


Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> peer base URLs``: how ``cluster.peers_dns`` is resolved."""


def system_resolver(scheme: str) -> Resolver:
    """A :data:`Resolver` giving ``scheme://`` URLs (the system resolver)."""

    async def resolve(host: str, port: int) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        urls = set()
        for family, _, _, _, address in infos:
            ip = str(address[0])
            urls.add(f"{scheme}://[{ip}]:{port}" if family == socket.AF_INET6 else f"{scheme}://{ip}:{port}")
        return sorted(urls)

    return resolve


resolve_peers = system_resolver("http")
"""The addresses of ``host`` as peer base URLs (``http://10.1.2.3:8080``, ``http://[fd00::1]:8080``)."""


def peer_key(url: str) -> tuple[str, str, int | None]:
    """A replica URL as compared to find this replica in the peer set: scheme and host without
    case, an IP address in its canonical form (``[fd00:0::5]`` is ``[fd00::5]``), the scheme's
    default port spelled out. ``cluster.self_url`` is written by hand, the peer set comes from
    DNS: a replica that missed itself in it would forward its own conversations to itself."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    with contextlib.suppress(ValueError):
        host = str(ipaddress.ip_address(host))
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, host, port or {"http": 80, "https": 443}.get(scheme)


@dataclass(frozen=True, slots=True)
class WorkerPlacement:
    """This process's place among the workers of one machine."""

    index: int
    """This worker (0..count-1)."""
    sockets: tuple[str, ...]
    """Private API socket of every worker (filesystem paths in a 0700 runtime directory)."""
    handoffs: tuple[str, ...] = ()
    """Private handoff socket of every worker (:mod:`proxy.ingress.handoff`; empty: no handoffs)."""
    supervisor: int = 0
    """Pid of the supervisor: its children are the workers this one trusts on private sockets
    (0: only this process itself, workers run in one process by tests)."""

    @property
    def count(self) -> int:
        return len(self.sockets)

    @property
    def trust(self) -> Trust:
        return Trust(supervisor=self.supervisor)


def address_of(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address in ``text`` (brackets, a zone and an IPv4-mapped form taken off), if any."""
    try:
        address = ipaddress.ip_address((text or "").strip("[]").partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def member_address(remote: str | None, members: tuple[str, ...], self_url: str) -> bool:
    """Whether ``remote`` is the address of a replica in ``members`` (other than this one; a
    member named by a host name is never matched: without a secret only addresses count)."""
    caller = address_of(remote)
    if caller is None or len(members) < 2:
        return False
    return any(address_of(urlsplit(m).hostname) == caller for m in members if m != self_url)


def tls_client(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context forwards to replicas verify against (``cluster.tls_ca_file``; ``None``: none set)."""
    ca = settings.cluster.tls_ca_file
    if not ca:
        return None
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cluster.tls_ca_file: cannot load {ca}: {exc}") from None


def is_me(request: web.Request, prover: str, self_url: str) -> bool:
    """Whether ``prover`` (a peer URL) names this replica: its ``self_url``, or the address
    and port the question reached it at (what the asker dialled)."""
    prover = prover.rstrip("/")
    if not prover:
        return False
    if self_url and prover.lower() == self_url.lower():
        return True
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return False
    try:
        parts = urlsplit(prover)
        port = parts.port
    except ValueError:
        return False
    local = address_of(str(sockname[0]))
    return local is not None and address_of(parts.hostname) == local and port == int(sockname[1])


async def ask_proof(peer: Peer, auth: PeerAuth, asker: str, timeout: float) -> str | None:
    """Ask replica ``peer`` to prove it holds the cluster secret: ``None`` when it did, else why
    it did not (the caller skips it as down)."""
    challenge = auth.challenge()
    prover = peer.name
    raw = str(URL(PROOF_PATH).with_query({"asker": asker, "prover": prover, "challenge": challenge}))
    marker = auth.marker("GET", raw, b"", "proof-" + os.urandom(8).hex())
    try:
        async with peer.client().get(
            peer.url(raw),
            headers={MARKER: marker},
            timeout=aiohttp.ClientTimeout(total=timeout),
            allow_redirects=False,
            server_hostname=peer.server_name,
        ) as resp:
            await resp.read()
            proof = resp.headers.get(PROOF_HEADER, "")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"no proof of the cluster secret: {type(exc).__name__}"
    if not auth.check_proof(asker, prover, challenge, proof):
        return "it could not prove it holds the cluster secret"
    return None


def refused_forward(request: web.BaseRequest) -> web.Response:
    """The 403 of a replica forward that is not signed with the cluster secret (logged)."""
    peer = request.remote or "?"
    log.warning("cluster: refused a forward from %s that is not signed with the cluster secret", peer)
    return web.Response(
        body=json_body(_REFUSAL_BODY),
        status=403,
        content_type="application/json",
        headers={REFUSED_HEADER: "forward_unauthenticated"},
    )
