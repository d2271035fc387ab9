"""Handing the app's connection itself to the worker that owns its conversation (``--workers N``).

A request that reaches a worker not owning its conversation (:mod:`proxy.ingress.cluster`) would
otherwise be forwarded as bytes over the owner's private unix socket, its answer relayed back:
two processes' CPU for every such turn. Instead the non-owner (the *sender*) passes the client's
TCP connection to the owner with ``SCM_RIGHTS``, with the bytes of the request it already read
(request line and raw headers as received, the body with a ``Content-Length``). The owner
adopts the socket into its own API listener (the same protocol, :mod:`proxy.ingress.listener`), feeds it
those bytes, and answers that request and every later one on the keep-alive connection. An app
keeping one connection per conversation (one SDK client each) then reaches the owner directly
from its second turn on.

Exchange, over a fresh connection to the owner's private handoff socket:

1. sender → owner: ``UPH1`` + prefix length (8 bytes, big-endian) with the descriptor attached,
   then the prefix;
2. owner → sender: ``\\x01`` (ready: it holds the descriptor and has room) or ``\\x00`` (no);
3. sender → owner: ``\\x01`` (commit). Only on reading it does the owner adopt the socket; the
   sender then lets go of its descriptor and has no role left.

Rules:

* **Once, never a loop.** The first request of an adopted connection is never handed off or
  forwarded again; that knowledge lives on the adopted connection (``adopted`` on its
  protocol), never in a header an app could forge. A later request on it owned by another
  worker may be handed off again, once.
* **Only a connection holding exactly this request.** The sender stops reading
  (``transport.pause_reading()``) and hands off only when the bytes the connection delivered are
  exactly this request's head and body and aiohttp holds nothing of a next one (pipelining, a
  chunked body, a head it could not track): otherwise the byte forward applies.
* **No FIN, no RST, no second answer.** The sender closes its descriptor only (the owner holds
  the same socket, so nothing reaches the client; ``shutdown()`` is never called) by aborting
  its transport, and its handler returns a response whose ``prepare`` raises
  ``ConnectionResetError``, so aiohttp writes nothing.
* **Nothing started, nothing lost.** The owner must answer ready within
  ``cluster.connect_timeout_seconds``; on any failure before that (owner down, refused,
  timeout) the byte forward or local handling applies exactly as without handoffs, so no app
  sees an error for a turn that had not started. Because the owner adopts only on the commit, a
  late ready can never make two processes answer one request.
* **Bounded.** At most ``cluster.max_forwards_per_peer`` handoffs in flight per peer (more take
  the byte forward at once); an owner runs at most that many sessions per peer and reads a
  prefix of at most ``limits.max_body_bytes`` plus 64 KiB; an adopted connection counts in the
  owner's ``listener.max_connections`` (it left the sender's), a ready is refused when the
  owner is at that limit. Outcomes: ``upshift_handoffs_total{outcome}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from aiohttp import web

from proxy.ingress.listener import Guard, GuardedHandler
from proxy.ingress.private import PeerRefused, Trust, check_peer, peer_credentials

__all__ = ["HANDED_OFF", "Handoff", "HandoffOutcome", "Receiver", "arrived_by_handoff"]

log = logging.getLogger(__name__)

_MAGIC = b"UPH1"
_HEADER = struct.Struct(">4sQ")
_READY, _NO, _COMMIT = b"\x01", b"\x00", b"\x01"
_HEAD_SLACK = 64 * 1024
_COMMIT_WAIT = 30.0
"""Seconds an owner waits for the commit after its ready (the sender sends it at once)."""


class _Invalid(Exception):
    """Not a well-formed handoff."""


_DROP = frozenset({b"content-length", b"transfer-encoding", b"content-encoding", b"expect"})
"""Rewritten: the body is passed decoded, with its length; a ``100 Continue`` was already sent."""


class HandoffOutcome(enum.StrEnum):
    """How an offered handoff ended (``upshift_handoffs_total{outcome}``)."""

    ADOPTED = "adopted"
    """The owner took the connection: it answers this request and the later ones."""
    INELIGIBLE = "ineligible"
    """The connection holds more than this request (pipelining) or its bytes could not be
    accounted for: byte forward."""
    BUSY = "busy"
    """``cluster.max_forwards_per_peer`` handoffs to this owner in flight: byte forward."""
    REFUSED = "refused"
    """The owner said no (at ``listener.max_connections``, draining): byte forward."""
    OWNER_DOWN = "owner_down"
    """No handoff socket, or it closed before ready: the owner is skipped as for a forward."""
    TIMEOUT = "timeout"
    """No ready within ``cluster.connect_timeout_seconds``: the owner is skipped."""


class _HandedOff(web.StreamResponse):
    """The sender's answer to a handed-off request: aiohttp writes nothing of it."""

    async def prepare(self, request: web.BaseRequest) -> Any:
        raise ConnectionResetError("connection handed off to the owning worker")


HANDED_OFF = _HandedOff
"""Return an instance of this from the handler of a request whose connection was handed off."""


def arrived_by_handoff(request: web.BaseRequest) -> bool:
    """Whether ``request`` is the first request of a connection handed over here (it says so
    once: the flag is cleared)."""
    handler = request.protocol
    if isinstance(handler, GuardedHandler) and handler.adopted:
        handler.adopted = False
        return True
    return False


def _prefix_head(request: web.BaseRequest, length: int) -> bytes:
    version = request.version
    parts = [f"{request.method} {request.raw_path} HTTP/{version.major}.{version.minor}\r\n".encode("latin-1")]
    for name, value in request.raw_headers:
        if name.lower() not in _DROP:
            parts += [name, b": ", value, b"\r\n"]
    parts += [b"Content-Length: ", str(length).encode(), b"\r\n\r\n"]
    return b"".join(parts)


def _holds_only_this(request: web.BaseRequest) -> bool:
    handler = request.protocol
    if not isinstance(handler, GuardedHandler) or request.content_length is None:
        return False
    if "Transfer-Encoding" in request.headers:
        return False
    version = request.version
    line = f"{request.method} {request.raw_path} HTTP/{version.major}.{version.minor}".encode("latin-1")
    return handler.request_line == line and handler.holds_only(request.content_length)


async def _wait_readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


class Handoff:
    """The sender side: offers connections to the other workers' handoff sockets.

    Args:
        paths: Handoff socket of every worker, by index (this worker's own entry unused).
        limit: Handoffs in flight per peer.
        timeout: Seconds for connect, send and the owner's ready.
        trust: Who may listen on a handoff socket: checked (``SO_PEERCRED``) after connecting,
            before the descriptor or a byte is sent.
    """

    def __init__(self, paths: tuple[str, ...], limit: int, timeout: float, trust: Trust | None = None) -> None:
        self.paths = paths
        self.timeout = timeout
        self.trust = trust or Trust()
        self._slots = [asyncio.Semaphore(limit) for _ in paths]

    async def offer(self, index: int, request: web.BaseRequest, body: bytes) -> HandoffOutcome:
        """Hand the connection of ``request`` (its ``body`` read) to worker ``index``."""
        transport = request.transport  # uvloop's is no asyncio.Transport subclass, but quacks like one
        if transport is None or transport.is_closing() or not isinstance(transport.get_extra_info("peername"), tuple):
            return HandoffOutcome.INELIGIBLE
        slots = self._slots[index]
        if slots.locked():
            return HandoffOutcome.BUSY
        async with slots:
            transport.pause_reading()  # from here on nothing more is read on this side
            if not _holds_only_this(request):
                transport.resume_reading()
                return HandoffOutcome.INELIGIBLE
            head = _prefix_head(request, len(body))
            outcome = await self._send(self.paths[index], transport, head, body)
            if outcome is HandoffOutcome.ADOPTED:
                transport.abort()  # closes this process's descriptor only: nothing is sent
            else:
                transport.resume_reading()
            return outcome

    async def _send(self, path: str, transport: asyncio.Transport, head: bytes, body: bytes) -> HandoffOutcome:
        loop = asyncio.get_running_loop()
        fd = transport.get_extra_info("socket").fileno()  # uvloop: a pseudo-socket; its fileno is real
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(self.timeout):
                await loop.sock_connect(sock, path)
                check_peer(sock, self.trust)  # before the descriptor or a byte goes anywhere
                socket.send_fds(sock, [_HEADER.pack(_MAGIC, len(head) + len(body))], [fd])
                await loop.sock_sendall(sock, head)
                await loop.sock_sendall(sock, body)
                answer = await loop.sock_recv(sock, 1)
            if answer == _NO:
                return HandoffOutcome.REFUSED
            if answer != _READY:
                return HandoffOutcome.OWNER_DOWN
            sock.send(_COMMIT)  # one byte into an empty socket buffer: sent, or an error
            return HandoffOutcome.ADOPTED
        except TimeoutError:
            return HandoffOutcome.TIMEOUT
        except PeerRefused as exc:
            log.warning("handoff to %r refused: %s", path, exc)
            return HandoffOutcome.OWNER_DOWN
        except OSError as exc:
            log.debug("handoff to %r failed: %s", path, exc)
            return HandoffOutcome.OWNER_DOWN
        finally:
            sock.close()


class Receiver:
    """The owner side: a private unix socket adopting the connections other workers hand over.

    Args:
        path: This worker's handoff socket (a filesystem path in the private runtime directory).
        factory: The API listener's protocol factory for adopted connections.
        guard: The API listener's connection count and limit.
        max_prefix: Largest request (head and body) accepted.
        sessions: Handoffs processed at once (more are refused).
        timeout: Seconds a session may take from accept to commit.
        trust: Which processes may hand connections over (the same uid, our workers).
    """

    def __init__(
        self,
        path: str,
        factory: Callable[[], asyncio.Protocol],
        guard: Guard,
        *,
        max_prefix: int,
        sessions: int,
        timeout: float,
        trust: Trust | None = None,
    ) -> None:
        self.path = path
        self.trust = trust or Trust()
        self.factory = factory
        self.guard = guard
        self.max_prefix = max_prefix + _HEAD_SLACK
        self.max_sessions = sessions
        self.timeout = timeout
        self.accepting = True
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._sessions: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # left by this worker's previous life (the directory is ours alone)
        sock.bind(self.path)
        sock.listen(256)
        self._sock = sock
        self._accept = asyncio.create_task(self._accept_loop())

    async def close(self) -> None:
        """Stop taking handoffs (a sender in the middle of one falls back)."""
        self.accepting = False
        tasks = [t for t in (self._accept, *self._sessions) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and the like: try again shortly
                log.warning("handoff socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            if len(self._sessions) >= self.max_sessions:
                conn.close()  # the sender reads EOF: served by the byte forward or locally
                continue
            task = asyncio.create_task(self._session(conn))
            self._sessions.add(task)
            task.add_done_callback(self._sessions.discard)

    async def _session(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(self.timeout):
                received = await self._receive(loop, conn)
                if received is None:
                    return
                sock, prefix = received
                if not self.accepting or self.guard.open >= self.guard.max_connections:
                    await loop.sock_sendall(conn, _NO)  # the sender still holds the connection
                    return
                await loop.sock_sendall(conn, _READY)
            # The sender commits at once after reading ready, or closes (EOF) if it gave up.
            async with asyncio.timeout(_COMMIT_WAIT):
                commit = await loop.sock_recv(conn, 1)
            if commit == _COMMIT:
                adopt, sock = sock, None
                await self._adopt(loop, adopt, prefix)
        except (OSError, TimeoutError) as exc:
            log.debug("handoff session failed: %s", exc)
        finally:
            if sock is not None:
                sock.close()  # a duplicate: closing it sends nothing while the sender holds one
            conn.close()

    async def _receive(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket
    ) -> tuple[socket.socket, bytes] | None:
        """The descriptor and the request bytes of one handoff (``None``: not a valid one)."""
        creds = peer_credentials(conn)
        if creds is not None and not self.trust.allows(*creds):
            log.warning("handoff socket: refused pid %d uid %d (not one of our workers)", *creds)
            return None  # only our own workers hand over connections
        await _wait_readable(loop, conn)
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 1, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return None
        sock = socket.socket(fileno=fds[0])
        try:
            while header and len(header) < _HEADER.size:
                more = await loop.sock_recv(conn, _HEADER.size - len(header))
                if not more:
                    break
                header += more
            if len(header) < _HEADER.size or sock.type != socket.SOCK_STREAM:
                raise _Invalid
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                raise _Invalid
            magic, length = _HEADER.unpack(header)
            if magic != _MAGIC or length > self.max_prefix:
                raise _Invalid
            prefix = bytearray(length)
            view, got = memoryview(prefix), 0
            while got < length:
                n = await loop.sock_recv_into(conn, view[got:])
                if not n:
                    raise _Invalid
                got += n
        except BaseException as exc:
            sock.close()
            if isinstance(exc, _Invalid):
                return None
            raise
        return sock, bytes(prefix)

    async def _adopt(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, prefix: bytes) -> None:
        sock.setblocking(False)
        try:
            transport, protocol = await loop.connect_accepted_socket(self.factory, sock)
        except OSError as exc:  # the client went away meanwhile
            log.debug("handoff: cannot adopt the connection: %s", exc)
            sock.close()
            return
        if transport.is_closing():
            return
        protocol.data_received(prefix)
