"""``--workers 3`` hands the app's connection to the worker owning its conversation (SCM_RIGHTS):
one SDK client per conversation reaches the owner directly from its second turn on."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import psutil
import pytest

from proxy.config import Settings, ShutdownSettings
from proxy.ingress.peers import WorkerPlacement
from proxy.ingress.private import runtime_dir
from proxy.observe.metrics import FORWARDS, HANDOFFS
from proxy.server import Server
from tests.clients.support import Capture, assert_fidelity, run_loop_async, task_text
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

from .support import HEADERS, KEY, STEPS, first_body, free_ports, owner_of, wait_ready
from .test_workers import Samples, metrics, start_workers

CONVERSATIONS = 200
SPREAD = 2.0
"""Seconds over which the conversations start, and resume after the first turns."""
WORKERS = ("worker-0", "worker-1", "worker-2")


def total(seen: Samples, name: str, **labels: str) -> float:
    return sum(v for ls, v in seen.get(name, []) if all(ls.get(k) == want for k, want in labels.items()))


def handoffs(seen: Samples, outcome: str) -> float:
    return total(seen, "upshift_handoffs_total", outcome=outcome)


def owned(
    worker: str, upstream: str, workers: tuple[str, ...], label: str, count: int, steps: int = STEPS
) -> list[str]:
    """``count`` task texts whose conversations ``worker`` owns."""
    tasks = [task_text(steps, f"{label}-{n}") for n in range(50 * count)]
    return [t for t in tasks if owner_of(t, upstream, workers) == worker][:count]


def forwards(seen: Samples) -> float:
    return total(seen, "upshift_forwards_total")


async def test_one_sdk_client_per_conversation_lands_on_its_owner_after_turn_one(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    # A loaded CI machine must not turn a slow "ready" into a fallback forward here (that path
    # has its own test below): the owner gets ample time to answer.
    proc = await start_workers(spawn, emulator.base_url, env={"UPSHIFT_CLUSTER_CONNECT_TIMEOUT_SECONDS": "10"})
    tasks = [task_text(STEPS, f"handoff-conv-{i}") for i in range(CONVERSATIONS)]
    first_done = 0
    all_first = asyncio.Event()
    snapshot: Samples = {}

    async with aiohttp.ClientSession() as session:

        async def barrier(conversation: int, turn: int) -> None:
            # Every conversation's first turn completes, the metrics are read, then the rest run.
            # The 200 loops start (and resume) spread over 2 s, as an app's would, not in one
            # instant: 200 SDK clients in this one event loop, let go at once, delay their own
            # request bodies behind each other's work by seconds on a loaded machine, past the
            # sidecar's 5 s body grace (a 408 the SDK would retry; these clients do not retry).
            nonlocal first_done, snapshot
            if turn == 1:
                first_done += 1
                if first_done == CONVERSATIONS:
                    snapshot = await metrics(proc, session)
                    all_first.set()
                await all_first.wait()
            if turn <= 1:
                await asyncio.sleep(conversation * SPREAD / CONVERSATIONS)

        captures = [Capture() for _ in tasks]
        clients = [c.async_client(proc.base_url, api_key=KEY) for c in captures]
        runs = await asyncio.gather(
            *(
                run_loop_async(client, t, before_turn=functools.partial(barrier, i))
                for i, (client, t) in enumerate(zip(clients, tasks, strict=True))
            )
        )
        seen = await metrics(proc, session)
    for client in clients:
        await client.close()

    direct = Capture().async_client(emulator.base_url)
    want = await asyncio.gather(*(run_loop_async(direct, t) for t in tasks))
    for capture, run, ref in zip(captures, runs, want, strict=True):
        assert run.contents == ref.contents  # every answer correct
        assert [e.status for e in capture.exchanges] == [200] * (STEPS + 1)
        assert_fidelity(emulator, capture.bodies, run.response_ids)  # the model saw the app's input
        # turns 2..N continued (all of them: each conversation's connection is on its owner)
        assert capture.modes[1:] == ["continuation"] * STEPS, capture.modes
        for prev, rid in zip(run.response_ids, run.response_ids[1:], strict=False):
            rec = emulator.record(rid)
            assert rec is not None and rec["continuation"] and rec["cache_hit"]
            assert rec["previous_response_id"] == prev
    # Turn 1 of about two thirds of the conversations landed on a non-owner: handed off, once.
    adopted = handoffs(snapshot, "adopted")
    assert CONVERSATIONS * 0.4 < adopted <= CONVERSATIONS, snapshot.get("upshift_handoffs_total")
    assert forwards(snapshot) == 0, snapshot.get("upshift_handoffs_total")
    # After turn 1 nothing moved any more: no handoff and no forward of any outcome.
    assert total(seen, "upshift_handoffs_total") == total(snapshot, "upshift_handoffs_total") == adopted
    assert forwards(seen) == 0
    served = {w: 0.0 for w in ("0", "1", "2")}
    for labels, value in seen["upshift_requests_total"]:
        if labels["route"] == "responses" and labels["mode"] != "forwarded":
            served[labels["worker"]] += value
    assert all(v > 0 for v in served.values()), served  # all three workers carry traffic
    assert sum(served.values()) == CONVERSATIONS * (STEPS + 1)
    assert await proc.terminate() == 0


# -- an owner that cannot take the connection ---------------------------------------------------


def worker_process(proc: SidecarProcess, index: int) -> psutil.Process:
    """The worker process ``index`` of a ``--workers`` supervisor (found by its handoff socket)."""
    for child in psutil.Process(proc.proc.pid).children():
        for conn in child.net_connections(kind="unix"):
            if isinstance(conn.laddr, str) and conn.laddr.endswith(f"/handoff-{index}.sock"):
                return child
    raise AssertionError(f"no worker {index}")


@pytest.mark.parametrize("fault", ["killed", "stopped"])
async def test_an_owner_that_is_gone_or_stuck_leaves_the_turn_to_the_sender(
    emulator: Emulator, spawn: Callable[..., SidecarProcess], fault: str
) -> None:
    """Killed (the handoff socket refuses) or stopped (no ready within the connect timeout):
    every turn is answered (the owner is skipped as for a forward: the next owner in rendezvous
    order, or the worker the connection landed on); a stopped owner that wakes up later does not
    adopt a connection its sender kept, and every connection keeps working."""
    proc = await start_workers(spawn, emulator.base_url)
    supervisor = psutil.Process(proc.proc.pid)
    victim = worker_process(proc, 2)
    tasks = [
        t for n in range(400) if owner_of(t := task_text(2, f"gone-{n}"), emulator.base_url, WORKERS) == "worker-2"
    ]
    tasks = tasks[:12]
    supervisor.suspend()  # no restart meanwhile
    if fault == "killed":
        victim.send_signal(signal.SIGKILL)
        while victim.is_running() and victim.status() != psutil.STATUS_ZOMBIE:  # not reaped: suspended parent
            await asyncio.sleep(0.01)
    else:
        victim.suspend()
    try:
        captures = [Capture() for _ in tasks]
        clients = [c.async_client(proc.base_url, api_key=KEY) for c in captures]
        loops = asyncio.gather(*(run_loop_async(c, t) for c, t in zip(clients, tasks, strict=True)))
        if fault == "stopped":
            # Connections the kernel gave the stopped worker itself wait for it: wake it once the
            # handoffs to it have timed out (0.75 s), and they go on.
            await asyncio.sleep(2.0)
            victim.resume()
        runs = await loops
    finally:
        if fault == "stopped":
            victim.resume()
        supervisor.resume()
    for capture, run in zip(captures, runs, strict=True):
        assert [e.status for e in capture.exchanges] == [200] * 3
        assert run.final_text
    async with aiohttp.ClientSession() as session:
        await wait_ready(proc, session)
        if fault == "stopped":
            await asyncio.sleep(0.5)  # the woken owner reads the stale handoffs: it must not adopt them
        seen = await metrics(proc, session)
        # Every connection still works (a new conversation on it may now be handed off).
        for client, task in zip(clients, tasks, strict=True):
            again = await client.responses.with_raw_response.create(model="gpt-6.1-sol", input=task)
            assert again.http_response.status_code == 200
    for client in clients:
        await client.close()
    outcome = "owner_down" if fault == "killed" else "timeout"
    assert handoffs(seen, outcome) >= 1, seen.get("upshift_handoffs_total")
    if fault == "killed":  # its conversations moved to their next owner in rendezvous order
        assert total(seen, "upshift_requests_total", worker="2") == 0
    assert await proc.terminate() == 0


# -- the handed-off connection, byte by byte (in-process workers, both event loops) -----------------


def _request(body: bytes, extra: bytes = b"") -> bytes:
    head = (
        b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + HEADERS["Authorization"].encode()
        + b"\r\nContent-Type: application/json\r\n" + extra + b"Content-Length: " + str(len(body)).encode()
        + b"\r\n\r\n"
    )  # fmt: skip
    return head + body


def _read_response(sock: socket.socket, buffered: bytes = b"") -> tuple[dict[str, str], bytes, bytes]:
    """One HTTP/1.1 response (Content-Length framed): headers, body, and any bytes after it."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 200"), lines[0]
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a body"
        rest += chunk
    return headers, rest[:length], rest[length:]


def _nothing_more(sock: socket.socket, wait: float = 0.3) -> None:
    sock.settimeout(wait)
    try:
        extra = sock.recv(65536)
    except TimeoutError:
        return
    finally:
        sock.settimeout(10)
    raise AssertionError(f"bytes after the answer: {extra!r}")


def _next_body(body: bytes, answer: bytes) -> bytes:
    request = orjson.loads(body)
    output = orjson.loads(answer)["output"]
    request["input"] += output
    request["input"] += [
        {"type": "function_call_output", "call_id": o["call_id"], "output": "ok"}
        for o in output
        if o["type"] == "function_call"
    ]
    return orjson.dumps(request)


async def _two_workers(upstream: str) -> tuple[list[Server], list[int]]:
    folder = runtime_dir()  # as the supervisor makes it: 0700, filesystem sockets
    api = tuple(os.path.join(folder, f"api-{i}.sock") for i in range(2))
    hand = tuple(os.path.join(folder, f"handoff-{i}.sock") for i in range(2))
    ports = free_ports(2)
    servers = []
    for i, port in enumerate(ports):
        settings = Settings(
            upstream=upstream,
            listen=f"127.0.0.1:{port}",
            admin_listen="127.0.0.1:0",
            shutdown=ShutdownSettings(grace_seconds=1.0),
        )
        server = Server(settings, worker=WorkerPlacement(i, api, hand))
        await server.start()
        servers.append(server)
    return servers, ports


def _count(metric: Any, **labels: str) -> float:
    return sum(  # type: ignore[no-any-return]
        s.value
        for m in metric.collect()
        for s in m.samples
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def _handed_off_connection(upstream: str) -> None:
    """Worker 0 takes the connection of a conversation worker 1 owns, hands it off; then the
    same socket carries three more turns, each answered once, all by worker 1."""
    servers, ports = await _two_workers(upstream)
    loop = asyncio.get_running_loop()
    try:
        (task,) = owned("worker-1", upstream, WORKERS[:2], "fd", 1)
        adopted, forwarded = _count(HANDOFFS, outcome="adopted"), _count(FORWARDS)
        sock = socket.create_connection(("127.0.0.1", ports[0]))
        sock.settimeout(10)
        body = first_body(task)
        modes = []
        for turn in range(4):
            await loop.run_in_executor(None, sock.sendall, _request(body))
            headers, answer, extra = await loop.run_in_executor(None, _read_response, sock)
            assert extra == b""
            await loop.run_in_executor(None, _nothing_more, sock)  # exactly one answer per request
            modes.append(headers["x-upshift-mode"])
            if turn == 0:
                assert _count(HANDOFFS, outcome="adopted") == adopted + 1
                assert servers[0].guard.open == 0 and servers[1].guard.open == 1  # it lives on worker 1
            body = _next_body(body, answer)
        assert modes == ["full", "continuation", "continuation", "continuation"], modes
        assert _count(HANDOFFS, outcome="adopted") == adopted + 1  # once: later turns land on the owner
        assert _count(FORWARDS) == forwarded
        # Pipelined: a second request already read with the first is never handed off.
        (other,) = owned("worker-1", upstream, WORKERS[:2], "pipe", 1, steps=1)
        before, forwarded = _count(HANDOFFS, outcome="ineligible"), _count(FORWARDS, outcome="ok")
        with socket.create_connection(("127.0.0.1", ports[0])) as pipe:
            pipe.settimeout(10)
            one = _request(first_body(other))
            await loop.run_in_executor(None, pipe.sendall, one + one)
            first, _, rest = await loop.run_in_executor(None, _read_response, pipe)
            second, _, rest = await loop.run_in_executor(None, _read_response, pipe, rest)
            assert rest == b"" and first["x-upshift-mode"] == second["x-upshift-mode"] == "full"
        # Both were forwarded as bytes: the first had the second behind it, and the second's head
        # arrived with the first's body (not tracked), so the connection stays where it is.
        assert _count(HANDOFFS, outcome="ineligible") == before + 2
        assert _count(FORWARDS, outcome="ok") == forwarded + 2
        sock.close()
    finally:
        for server in servers:
            await server.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_the_handed_off_connection_keeps_working_with_one_answer_per_request(
    emulator: Emulator, loop: str
) -> None:
    import uvloop

    run = asyncio.run if loop == "asyncio" else uvloop.run
    # Its own loop in a thread (the emulator stays on the test's loop).
    await asyncio.to_thread(run, _handed_off_connection(emulator.base_url))
