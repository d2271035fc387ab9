"""The kernel's receipt time of a connection's bytes (proxy/kernel.py), on real sockets."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import pytest
from aiohttp import web

from proxy.config import ListenerSettings
from proxy.ingress.listener import Guard, HardenedTCPSite, HardenedUnixSite
from proxy.kernel import KERNEL_TICK_MS, AcceptDrain, received_ago, tcp_socket
from tests.loops import LOOP_KINDS, loop_runner


class _Transport:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get_extra_info(self, name: str) -> object:
        return self.sock if name == "socket" else None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO's receipt age is Linux's")
def test_bytes_that_waited_in_the_kernel_are_aged_by_their_wait() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            sock = tcp_socket(_Transport(conn))
            assert sock is conn
            client.sendall(b"GET / HTTP/1.1\r\n\r\n")
            time.sleep(0.2)  # the bytes wait for a reader that is busy elsewhere
            waited = received_ago(sock)
            assert 0.2 - 2 * KERNEL_TICK_MS / 1000 <= waited <= 0.2 + 0.1, waited
            conn.recv(100)
            client.sendall(b"more")
            time.sleep(0.001)
            assert received_ago(sock) < waited  # the latest segment's age, not the first's


def test_a_unix_socket_has_no_kernel_age() -> None:
    left, right = socket.socketpair()
    with left, right:
        assert tcp_socket(_Transport(left)) is None
        assert received_ago(None) == 0.0


class _Counted(asyncio.Protocol):
    made: list[float] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _Counted.made.append(time.perf_counter())


async def _burst(drain: bool, n: int) -> tuple[int, int]:
    """``n`` connections queued in the kernel while the loop was busy, then a few turns of the
    loop: how many it took, and how many the drain accepted."""
    _Counted.made = []
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Counted, "127.0.0.1", 0, backlog=1024)
    accept = AcceptDrain(server.sockets[0], _Counted) if drain else None
    port = server.sockets[0].getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]  # the loop is busy here
    try:
        for _ in range(10):
            await asyncio.sleep(0)
        return len(_Counted.made), accept.accepted if accept is not None else 0
    finally:
        if accept is not None:
            accept.close()
        server.close()
        await server.wait_closed()
        for client in clients:
            client.close()


@pytest.mark.parametrize("loop_kind", LOOP_KINDS)
def test_a_burst_of_connections_is_accepted_in_a_few_turns_of_the_loop(loop_kind: str) -> None:
    # uvloop's server alone accepts one connection per turn (libuv): ten turns, ten of them;
    # the drain takes the whole queue in one.
    with loop_runner(loop_kind) as runner:
        taken, by_drain = runner.run(_burst(True, 60))
        assert taken == 60
        assert by_drain > 0
        if loop_kind == "uvloop":
            alone, _ = runner.run(_burst(False, 60))
            assert alone <= 15, alone  # what the drain is for


@pytest.mark.parametrize("loop_kind", LOOP_KINDS)
def test_a_closed_drain_accepts_nothing_and_leaves_the_server_listening(loop_kind: str) -> None:
    async def scenario() -> None:
        _Counted.made = []
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Counted, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        drain = AcceptDrain(server.sockets[0], _Counted)
        drain.close()
        with socket.create_connection(("127.0.0.1", port)):
            for _ in range(10):
                await asyncio.sleep(0)
            assert len(_Counted.made) == 1  # the server's own accept
        assert drain.accepted == 0
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectionRefusedError):  # the drain's duplicate kept nothing open
            socket.create_connection(("127.0.0.1", port), timeout=1).close()

    with loop_runner(loop_kind) as runner:
        runner.run(scenario())


@pytest.mark.parametrize("loop_kind", LOOP_KINDS)
def test_the_api_listener_takes_a_burst_of_connections_at_once_and_closes_its_drain(loop_kind: str) -> None:
    async def scenario() -> None:
        runner = web.AppRunner(web.Application(), handle_signals=False)
        await runner.setup()
        guard = Guard(ListenerSettings())
        site = HardenedTCPSite(runner, "127.0.0.1", 0, guard)
        await site.start()
        clients = [socket.create_connection(("127.0.0.1", site.port)) for _ in range(60)]  # the loop is busy
        try:
            for _ in range(10):
                await asyncio.sleep(0)
            assert guard.open == 60  # uvloop's server alone: about one a turn
        finally:
            for client in clients:
                client.close()
            await runner.cleanup()
        with pytest.raises(ConnectionRefusedError):  # no descriptor of the listener left open
            socket.create_connection(("127.0.0.1", site.port), timeout=1).close()

    with loop_runner(loop_kind) as runner:
        runner.run(scenario())


@pytest.mark.parametrize("loop_kind", LOOP_KINDS)
def test_the_private_unix_listener_takes_a_burst_at_once_and_its_connections_stay_private(
    loop_kind: str, tmp_path: object
) -> None:
    path = f"{tmp_path}/w.sock"
    seen: list[bool] = []

    async def hello(request: web.Request) -> web.Response:
        transport = request.transport
        seen.append(transport is not None and isinstance(transport.get_extra_info("sockname"), str | bytes))
        return web.Response(text="ok")

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/", hello)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        guard = Guard(ListenerSettings())
        await HardenedUnixSite(runner, path, guard).start()
        clients = []
        for _ in range(60):  # the loop is busy: they wait in the accept queue
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(path)
            clients.append(client)
        try:
            for _ in range(10):
                await asyncio.sleep(0)
            assert guard.open == 60  # the loop's server alone: about one a turn
            clients[-1].sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            clients[-1].setblocking(False)
            loop = asyncio.get_running_loop()
            answer = await asyncio.wait_for(loop.sock_recv(clients[-1], 4096), 5)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            assert seen == [True]  # accepted by the drain or the server alike: a unix connection
        finally:
            for client in clients:
                client.close()
            await runner.cleanup()
        with pytest.raises((ConnectionRefusedError, FileNotFoundError)):  # no descriptor left listening
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with probe:
                probe.connect(path)

    with loop_runner(loop_kind) as runner:
        runner.run(scenario())
