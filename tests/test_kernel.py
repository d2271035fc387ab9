"""The kernel's receipt time of a connection's bytes (proxy/kernel.py), on real sockets."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from proxy.kernel import KERNEL_TICK_MS, received_ago, tcp_socket


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
