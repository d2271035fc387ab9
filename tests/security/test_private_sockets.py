"""Private sockets nobody else can reach.

A squatter is a child process running as another uid (``os.setuid(65534)``: the suite runs as
root; skipped with the reason where the machine does not allow it). It can neither connect to
nor bind any of the workers' private sockets, and when it listens where a worker's socket is
expected, the senders' ``SO_PEERCRED`` check hands it nothing: no descriptor, no byte. The
control: conversations through real workers keep working (and tests/ingress/test_handoff.py,
test_workers.py cover the handoff between them).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from proxy.config import ClusterSettings, Settings, ShutdownSettings
from proxy.ingress.peers import WorkerPlacement
from proxy.ingress.private import runtime_dir
from proxy.server import Server
from tests.ingress.support import HEADERS, first_body, owner_of, task_text, tool_loop, wait_ready
from tests.ingress.test_workers import start_workers
from tests.sidecar import SidecarProcess
from upshift_emulator import Emulator

NOBODY = 65534


def _can_switch_uid() -> str | None:
    if not hasattr(os, "setuid") or sys.platform != "linux":
        return "needs Linux (SO_PEERCRED, setuid)"
    if os.getuid() != 0:
        return "needs root to start a child of another uid (os.setuid)"
    probe = subprocess.run([sys.executable, "-c", f"import os; os.setuid({NOBODY})"], capture_output=True)
    if probe.returncode != 0:
        return f"this machine refuses os.setuid({NOBODY}): {probe.stderr.decode()[-200:]}"
    return None


pytestmark = pytest.mark.skipif(bool(_can_switch_uid()), reason=_can_switch_uid() or "")

_PROBE = textwrap.dedent(
    """
    import errno, json, os, socket, sys
    os.setgid(65534); os.setuid(65534)
    out = {}
    for path in json.loads(sys.argv[1]):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            out["connect " + path] = "connected"
        except OSError as exc:
            out["connect " + path] = errno.errorcode.get(exc.errno, str(exc.errno))
        finally:
            s.close()
        acts = (("bind", lambda: socket.socket(socket.AF_UNIX).bind(path)), ("unlink", lambda: os.unlink(path)))
        for what, act in acts:
            try:
                act()
                out[what + " " + path] = "done"
            except OSError as exc:
                out[what + " " + path] = errno.errorcode.get(exc.errno, str(exc.errno))
    folder = os.path.dirname(json.loads(sys.argv[1])[0])
    try:
        socket.socket(socket.AF_UNIX).bind(os.path.join(folder, "squat.sock"))
        out["bind new"] = "done"
    except OSError as exc:
        out["bind new"] = errno.errorcode.get(exc.errno, str(exc.errno))
    print(json.dumps(out))
    """
)


def _as_nobody(paths: list[str]) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(paths)], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr.decode()
    result: dict[str, str] = json.loads(done.stdout)
    return result


def _private_sockets(proc: SidecarProcess) -> list[str]:
    """Every unix socket the supervisor and its workers have (an abstract name shows as
    ``\0...`` or ``@...``: none may)."""
    found: set[str] = set()
    for process in [psutil.Process(proc.proc.pid), *psutil.Process(proc.proc.pid).children()]:
        for conn in process.net_connections(kind="unix"):
            if conn.laddr:
                found.add(conn.laddr if isinstance(conn.laddr, str) else repr(conn.laddr))
    return sorted(found)


async def test_a_squatter_can_neither_connect_to_nor_bind_a_workers_socket(
    emulator: Emulator, spawn: Callable[..., SidecarProcess]
) -> None:
    proc = await start_workers(spawn, emulator.base_url, count=2)
    sockets = _private_sockets(proc)
    assert len(sockets) == 6, sockets  # api, admin, handoff of each worker
    assert all(s.startswith("/") for s in sockets), sockets  # filesystem paths, no abstract name
    folder = os.path.dirname(sockets[0])
    assert all(os.path.dirname(s) == folder for s in sockets)
    assert os.stat(folder).st_mode & 0o777 == 0o700
    seen = _as_nobody(sockets)
    for path in sockets:
        assert seen[f"connect {path}"] == "EACCES", seen
        assert seen[f"bind {path}"] in ("EACCES", "EADDRINUSE") and seen[f"unlink {path}"] == "EACCES", seen
    assert seen["bind new"] == "EACCES"

    # A killed worker's names stay out of reach while it is down (its supervisor held still).
    supervisor = psutil.Process(proc.proc.pid)
    victim = next(c for c in supervisor.children() if any(
        str(k.laddr).endswith("handoff-1.sock") for k in c.net_connections(kind="unix")
    ))  # fmt: skip
    supervisor.suspend()
    try:
        victim.send_signal(signal.SIGKILL)
        while victim.is_running() and victim.status() != psutil.STATUS_ZOMBIE:  # not reaped: suspended parent
            await asyncio.sleep(0.01)
        mine = [s for s in sockets if s.endswith("-1.sock")]
        seen = _as_nobody(mine)
        assert all(seen[f"bind {p}"] == "EACCES" and seen[f"unlink {p}"] == "EACCES" for p in mine), seen
    finally:
        supervisor.resume()
    # control: the worker comes back on its names and conversations go on through both
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            if len(_private_sockets(proc)) == 6:
                break
            await asyncio.sleep(0.05)
        await wait_ready(proc, session)
        convs = await asyncio.gather(*(tool_loop(session, [proc.api], task_text(2, f"sq-{i}")) for i in range(6)))
    assert all(m == "continuation" for c in convs for m in c.modes[1:]), [c.modes for c in convs]
    assert await proc.terminate() == 0


_SQUATTER = textwrap.dedent(
    """
    import array, json, os, select, socket, sys
    paths = json.loads(sys.argv[1])
    os.setgid(65534); os.setuid(65534)
    listeners = []
    for path in paths:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path); s.listen(16); listeners.append(s)
    print("ready", flush=True)
    seen = {"connections": 0, "bytes": 0, "fds": 0}
    conns = []
    while True:
        ready, _, _ = select.select([sys.stdin, *listeners, *conns], [], [], 30)
        if sys.stdin in ready or not ready:
            break
        for s in ready:
            if s in listeners:
                c, _ = s.accept(); conns.append(c); seen["connections"] += 1
                continue
            fds = array.array("i")
            data, anc, _, _ = s.recvmsg(65536, socket.CMSG_LEN(16 * fds.itemsize))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    seen["fds"] += len(payload) // fds.itemsize
            seen["bytes"] += len(data)
            if not data:
                conns.remove(s); s.close()
    print(json.dumps(seen), flush=True)
    """
)


@pytest.mark.parametrize("handoff", [True, False], ids=["handoff", "byte-forward"])
async def test_a_squatted_socket_is_handed_nothing(emulator: Emulator, handoff: bool) -> None:
    """Where a worker's API and handoff sockets are expected a process of another uid listens
    (as a squatter of the old abstract names did): the sender checks who listens, sends it no
    descriptor and no byte, and serves the request itself."""
    folder = tempfile.mkdtemp(prefix="squat-", dir="/tmp")
    os.chmod(folder, 0o777)  # a directory the squatter can write (never the product's)
    squat_api, squat_hand = os.path.join(folder, "api-1.sock"), os.path.join(folder, "handoff-1.sock")
    squatter = subprocess.Popen(
        [sys.executable, "-c", _SQUATTER, json.dumps([squat_api, squat_hand])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert squatter.stdout is not None and squatter.stdout.readline().strip() == b"ready"
    own = runtime_dir()
    api = (os.path.join(own, "api-0.sock"), squat_api)
    hand = (os.path.join(own, "handoff-0.sock"), squat_hand)
    settings = Settings(
        upstream=emulator.base_url,
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        shutdown=ShutdownSettings(grace_seconds=1.0),
        cluster=ClusterSettings(handoff=handoff),
    )
    server = Server(settings, worker=WorkerPlacement(0, api, hand))  # trusts only itself
    await server.start()
    seen: dict[str, Any] = {}
    try:
        tasks = [
            t
            for n in range(400)
            if owner_of(t := task_text(1, f"sq-{n}"), emulator.base_url, ("worker-0", "worker-1")) == "worker-1"
        ]  # noqa: E501
        url = f"http://127.0.0.1:{server.api_address[1]}/v1/responses"
        async with aiohttp.ClientSession() as session:
            for task in tasks[:3]:
                async with session.post(url, data=first_body(task), headers=HEADERS) as resp:
                    assert resp.status == 200 and resp.headers["x-upshift-mode"] == "full"
    finally:
        await server.stop()
        out, _ = squatter.communicate(b"", timeout=30)
        seen = json.loads(out.decode().strip().splitlines()[-1])
        for path in (squat_api, squat_hand):
            Path(path).unlink(missing_ok=True)
        os.rmdir(folder)
    assert seen["fds"] == 0 and seen["bytes"] == 0, seen  # connected to, then left: nothing sent
    assert seen["connections"] >= 1, seen  # it was asked (then refused): the check, not luck, held
