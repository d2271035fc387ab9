"""Where a turn's CPU goes: the sidecar and the aiohttp floor relay, sampled by ``perf`` in one run.

    python -m bench.budget                             # the build this checkout imports (pure by default)
    python -m proxy.build && python -m bench.budget && python -m proxy.build --clean
    python -m bench.budget --size 200k --turns 400 --tls --json /tmp/budget.json

One emulator (zero latency) serves the sidecar and :mod:`bench.floor`'s aiohttp relay, one after
the other. Each runs the overhead phase's conversations (:class:`bench.overhead._Chain`: the
reasoning agent's 19 events per turn) from a history of ``--size``; ``perf record`` samples the
relay's process (``cpu-clock``, every thread, kernel included) only while its *continuation*
turns run: it is enabled and disabled through its control FIFO around them, so each chain's first
turn (a full send, no head yet) is left out. Each sample's time goes to one row by the shared
object and the symbol it hit (:func:`row`):

* upshift's compiled modules (the mypyc library; one row per module: ``core.planner``, …);
* the interpreted code: on Python 3.12+ the relays run with ``-X perf`` and perf takes call
  chains, so an interpreter sample goes to the file of its innermost Python function (upshift's
  I/O shells one by one, aiohttp, websockets, asyncio, logging, …); on 3.11 (no perf
  trampolines) it is one row, "Python interpreter";
* the C parts under it: aiohttp's HTTP parser and multidict/yarl, orjson, uvloop, websockets'
  masking, OpenSSL, libc (allocation, copies), and the kernel (system calls, loopback TCP).

The rows are then summed into the steps of a turn (:data:`STEPS`: the app side, the upstream
socket, matching, events to the app, bookkeeping, …), the floor's own relay code being one step.
Reported per row: µs per turn (sampled time / continuation turns), beside the process CPU per
turn measured without perf (``/proc`` schedstat around each turn, as the overhead phase reads it)
as the check that the rows add up. Needs ``perf`` (Debian: ``linux-perf``) and permission to
sample another process (root, or ``kernel.perf_event_paranoid`` ≤ 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import websockets

from proxy.build import COMPILED, build_kind

from .clients import API_KEY, READ_TIMEOUT, echo_items, post_sse, sdk_headers, ws_turn
from .floor import FloorProc
from .overhead import _calls, _Chain, parse_size
from .procs import EmulatorProc, Managed, SidecarProc, install_signal_handlers, stop_all, track
from .tls import LoopbackCA

__all__ = ["STEPS", "main", "row", "rows_of", "steps_of"]

JSON = Any

_C_PARTS: tuple[tuple[str, str], ...] = (
    ("_http_parser", "aiohttp C (HTTP parser, writer, WebSocket reader)"),
    ("_http_writer", "aiohttp C (HTTP parser, writer, WebSocket reader)"),
    ("aiohttp/_websocket", "aiohttp C (HTTP parser, writer, WebSocket reader)"),
    ("multidict", "multidict, yarl, propcache (headers, URLs)"),
    ("yarl", "multidict, yarl, propcache (headers, URLs)"),
    ("propcache", "multidict, yarl, propcache (headers, URLs)"),
    ("frozenlist", "multidict, yarl, propcache (headers, URLs)"),
    ("orjson", "orjson (JSON)"),
    ("uvloop", "uvloop / libuv (event loop)"),
    ("loop.cpython", "uvloop / libuv (event loop)"),
    ("websockets", "websockets C (masking)"),
    ("libssl", "OpenSSL (TLS, sha256)"),
    ("libcrypto", "OpenSSL (TLS, sha256)"),
    ("_ssl", "OpenSSL (TLS, sha256)"),
    ("_hashlib", "OpenSSL (TLS, sha256)"),
    ("libc.so", "libc (allocation, copies)"),
    ("libc-", "libc (allocation, copies)"),
    ("libm.so", "libc (allocation, copies)"),
    ("ld-linux", "libc (allocation, copies)"),
    ("libpthread", "libc (allocation, copies)"),
)
INTERPRETER = "Python interpreter (the interpreted code: upshift's shells, aiohttp, websockets, asyncio)"
KERNEL = "kernel (system calls, loopback TCP, scheduling)"
PYTHON_FRAMES = sys.version_info >= (3, 12)
"""``python -X perf`` (3.12+) makes Python functions visible to perf: the relays run with it, and
samples are taken with call chains (DWARF unwinding: the interpreter has no frame pointers)."""
MYPYC_RUNTIME = "upshift compiled: mypyc runtime (boxing, dict/list helpers)"
_SHORT = {name.rsplit(".", 1)[1]: name.removeprefix("proxy.") for name in COMPILED}
"""A compiled module's short name (mypyc's symbols use it where it is unique) → ``core.planner``."""
_NATIVE = re.compile(r"^(?:CPyDef_|CPyPy_|CPyL?_?)(?P<path>[A-Za-z0-9_]+)")


def _module(symbol: str) -> str:
    """The upshift module of a mypyc symbol (``CPyDef_proxy___core___planner___Planner___plan``
    → ``core.planner``; a short ``CPyDef_planner___…`` → ``planner``)."""
    match = _NATIVE.match(symbol)
    if match is None:
        return ""
    parts = match.group("path").split("___")
    if parts[0] == "proxy" and len(parts) >= 3:
        return f"{parts[1]}.{parts[2]}"
    if parts[0] in ("core", "wire") and len(parts) >= 3:
        return f"{parts[0]}.{parts[1]}"  # a name two packages may share
    if len(parts) < 2:
        return ""
    return _SHORT.get(parts[0], parts[0])


def _is_compiled(dso: str) -> bool:
    """Whether ``dso`` is upshift's mypyc library (``proxy/_compiled__mypyc….so``)."""
    return "_compiled" in dso


def row(dso: str, symbol: str) -> str:
    """The budget row of one sample: by its shared object, and for upshift's compiled library by
    the module its symbol belongs to."""
    if dso.startswith("[kernel") or dso.startswith("[vdso"):
        return KERNEL
    if _is_compiled(dso):
        module = _module(symbol)
        return f"upshift compiled: {module}" if module else MYPYC_RUNTIME
    for needle, name in _C_PARTS:
        if needle in dso:
            return name
    if "libpython" in dso or re.match(r"python3(\.\d+)?$", dso) or dso.startswith("[JIT]") or "perf-" in dso:
        return INTERPRETER
    return f"other: {Path(dso).name}"


_FRAME = re.compile(r"^\s*[0-9a-f]+\s+(?P<sym>.*?)\s+\((?P<dso>[^()]*)\)\s*$")
_PY = re.compile(r"^py::(?P<func>.*?):(?P<file>.*)$")
_REPO = str(Path(__file__).resolve().parent.parent) + os.sep


def python_row(file: str, func: str = "", *, functions: bool = False) -> str:
    """The row of interpreted code in ``file`` (the innermost Python frame of a sample whose
    leaf is the interpreter): upshift's module, a package, or the standard library."""
    if file.startswith(_REPO):
        return f"upshift interpreted: {file[len(_REPO) :]}" + (f" {func}" if functions else "")
    parts = Path(file).parts
    if "site-packages" in parts:
        return f"{parts[parts.index('site-packages') + 1]} (Python)"
    if file == "<string>":
        # Generated code (dataclass methods), and, in practice, samples whose unwinding stopped
        # at such a trampoline: cProfile counts a handful of these calls in 300 turns.
        return "Python frames perf could not place (<string>)"
    if file.startswith("<frozen"):
        return "importlib (Python)"
    stdlib = [i for i, part in enumerate(parts) if re.fullmatch(r"python3\.\d+", part)]
    if stdlib and len(parts) > stdlib[-1] + 1:
        return f"{parts[stdlib[-1] + 1].removesuffix('.py')} (stdlib, Python)"
    return f"other Python: {file}"


def _samples(script: str) -> list[tuple[int, list[re.Match[str]]]]:
    """``(period, frames leaf first)`` of each sample in ``perf script -F period,ip,sym,dso``
    text: a sample's line starts with its period (and, without call chains, holds its one
    frame); each frame of a call chain follows on its own line, indented by a tab."""
    samples: list[tuple[int, list[re.Match[str]]]] = []
    for line in script.splitlines():
        if line.startswith("\t"):
            frame = _FRAME.match(line)
            if samples and frame is not None:
                samples[-1][1].append(frame)
            continue
        period, _, rest = line.strip().partition(" ")
        if not period.isdigit():
            continue
        frame = _FRAME.match(rest)
        samples.append((int(period), [frame] if frame is not None else []))
    return samples


def _caller(frames: list[re.Match[str]], functions: bool) -> str | None:
    """Whose work an interpreter (or mypyc runtime) sample is: the innermost compiled upshift
    function or Python function on its call chain, whichever is nearer the leaf."""
    for frame in frames:
        dso, symbol = frame.group("dso"), frame.group("sym")
        if _is_compiled(dso) and _module(symbol):
            return f"upshift compiled: {_module(symbol)}"
        py = _PY.match(symbol)
        if py is not None:
            return python_row(py.group("file"), py.group("func"), functions=functions)
    return None


def rows_of(script: str, *, functions: bool = False) -> Counter[str]:
    """Nanoseconds by row from ``perf script -F period,ip,sym,dso`` text: each sample's leaf
    frame decides its row (:func:`row`); with call chains, an interpreter sample goes to the
    innermost compiled upshift function or Python function (``python -X perf``, Python 3.12+:
    :func:`python_row`), whichever is nearer the leaf: the interpreter's own C code (allocation,
    dict and attribute lookups) is then charged to the code that asked for it."""
    out: Counter[str] = Counter()
    for period, frames in _samples(script):
        if not frames:
            out["unknown"] += period
            continue
        name = row(frames[0].group("dso"), frames[0].group("sym"))
        if name in (INTERPRETER, MYPYC_RUNTIME):
            name = _caller(frames, functions) or name
        out[name] += period
    return out


class _Perf:
    """``perf record`` on one process, started disabled, toggled through its control FIFO."""

    def __init__(self, pid: int, workdir: Path, freq: int, *, stacks: bool) -> None:
        self.data = workdir / f"perf-{pid}.data"
        self.ctl, self.ack = workdir / f"ctl-{pid}", workdir / f"ack-{pid}"
        os.mkfifo(self.ctl)
        os.mkfifo(self.ack)
        exe = shutil.which("perf")
        assert exe is not None
        argv = [exe, "record", "-F", str(freq), "-e", "cpu-clock", "-p", str(pid), "-o", str(self.data), "-D", "-1",
                f"--control=fifo:{self.ctl},{self.ack}", "-q",
                *(["--call-graph", "dwarf,32768"] if stacks else [])]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        track(self.proc)
        # perf opens the FIFOs itself: open ours after it, without blocking the loop meanwhile.
        self._ctl_fd = os.open(self.ctl, os.O_WRONLY)
        self._ack_fd = os.open(self.ack, os.O_RDONLY)

    def _command(self, text: str) -> None:
        os.write(self._ctl_fd, text.encode() + b"\n")
        os.read(self._ack_fd, 16)  # "ack\n": the counters are switched

    def enable(self) -> None:
        self._command("enable")

    def disable(self) -> None:
        self._command("disable")

    def stop(self) -> str:
        """Stop recording; the ``perf script`` text (period, then each frame's symbol and object)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        for fd in (self._ctl_fd, self._ack_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        if not self.data.exists():
            raise RuntimeError(f"perf record wrote nothing: {err.decode(errors='replace')[-400:]}")
        argv = ["perf", "script", "--no-inline", "-i", str(self.data), "-F", "period,ip,sym,dso"]
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


async def _turns(
    relay: SidecarProc | FloorProc, emu: EmulatorProc, size: int, turns: int, per_chain: int, perf: _Perf | None
) -> tuple[int, float]:
    """Run conversations through ``relay`` until ``turns`` continuation turns are done; perf
    records only while they run. Returns the turns and the relay's CPU seconds over them."""
    headers, url = sdk_headers(), relay.base_url + "/responses"
    done, cpu = 0, 0.0
    timeout = aiohttp.ClientTimeout(total=300, sock_read=READ_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=4)
    tls: dict[str, Any] = {"ssl": emu.ssl_context} if emu.ssl_context is not None else {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        chain_no = 0
        while done < turns:
            chain = _Chain(size, f"budget-{chain_no}-{time.monotonic_ns()}", per_chain + 1, 7 + chain_no, False)
            chain_no += 1
            # The native client's chain is not measured; it only gives the echoes their ids.
            async with websockets.connect(
                emu.ws_url, additional_headers={"Authorization": f"Bearer {API_KEY}"},
                compression=None, max_size=None, ping_interval=None, **tls,
            ) as ws:  # fmt: skip
                for turn in range(per_chain + 1):
                    body = chain.body()
                    if turn and perf is not None:
                        perf.enable()
                    before = relay.cpu_seconds()
                    got = await post_sse(session, url, body, headers)
                    after = relay.cpu_seconds()
                    if turn and perf is not None:
                        perf.disable()
                    if turn:
                        done, cpu = done + 1, cpu + after - before
                    calls = _calls(got.response)
                    if not calls or done >= turns:
                        break
                    if turn == 0:
                        await asyncio.sleep(0.05)  # the first turn's after-answer work (explain)
                    chain.input += echo_items(got.response.get("output") or [])
                    chain.input.append(chain.history.tool_output(calls[0]["call_id"]))
                    w = await ws_turn(ws, chain.frame())
                    chain.previous = (w.event.get("response") or {}).get("id")
    return done, cpu


async def _profile(
    name: str, relay: SidecarProc | FloorProc, emu: EmulatorProc, args: argparse.Namespace, work: Path
) -> JSON:
    size = parse_size(args.size)
    per_chain = 2 if size < 20_000 else 10
    await _turns(relay, emu, size, 30, per_chain, None)  # warm up (imports, caches, sockets)
    perf = _Perf(relay.pid, work, args.freq, stacks=PYTHON_FRAMES)
    try:
        turns, cpu = await _turns(relay, emu, size, args.turns, per_chain, perf)
    finally:
        report = perf.stop()
    rows = rows_of(report, functions=args.functions)
    sampled = sum(rows.values())
    print(f"  {name}: {turns} turns, CPU/turn {cpu / turns * 1e3:.3f} ms, sampled {sampled / turns / 1e3:.0f} µs/turn")
    return {
        "turns": turns,
        "cpu_us_per_turn": round(cpu / turns * 1e6, 1),
        "sampled_us_per_turn": round(sampled / turns / 1e3, 1),
        "rows_us_per_turn": {k: round(v / turns / 1e3, 1) for k, v in rows.most_common()},
    }


STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("app side: HTTP in and out (aiohttp; upshift's listener, reception, body, identity, arrival clock)",
     ("aiohttp (Python)", "aiohttp C", "multidict", "yarl (Python)", "aiosignal", "proxy/ingress/",
      "proxy/intake/identity.py", "proxy/intake/body.py", "proxy/intake/keys.py", "proxy/kernel.py",
      "socket (stdlib", "compiled: ingress.", "compiled: intake.identity")),
    ("kernel: system calls, loopback TCP, scheduling", (KERNEL,)),
    ("event loop (uvloop, asyncio)", ("uvloop", "asyncio (stdlib", "_asyncio", "_weakrefset")),
    ("upstream socket: frames in and out, demux (upshift's ws shell, wsframe, demux; websockets)",
     ("proxy/upstream/ws.py", "core.demux", "wire.wsframe", "websockets (Python)", "proxy/core/demux.py",
      "proxy/wire/wsframe.py")),
    ("events to the app: channel, SSE encoding, pump, writes", ("proxy/serve/streaming.py", "core.channel",
     "wire.sse", "core.answer", "serve.streaming", "proxy/core/channel.py", "proxy/wire/sse.py",
     "proxy/core/answer.py")),
    ("the turn's bookkeeping: handler, pool, memory budget, record, access log, metrics",
     ("proxy/serve/", "proxy/upstream/", "core.budget", "proxy/core/budget.py", "proxy/intake/", "proxy/observe/",
      "proxy/ops/", "prometheus_client", "logging (stdlib", "proxy/server.py", "proxy/contracts.py",
      "secrets (stdlib", "random (stdlib", "collections (stdlib", "compiled: serve.", "compiled: intake.")),
    ("matching and heads: parse, plan, record (conversation, items, fastparse, request, planner, …)",
     ("core.conversation", "core.items", "core.fastparse", "core.request", "core.planner", "core.explain",
      "core.tenants", "core.creators", "core.rawjson", "core.lanes", "core.reseed", "core.retry", "core.affinity",
      "proxy/core/", "compiled: core.")),
    ("the rest of upshift's modules (configuration, errors, reasons, loop)", ("upshift interpreted: proxy/",
     "upshift compiled: ")),
    ("the rest of the standard library (its Python and C modules)",
     ("(stdlib, Python)", "importlib (Python)", "other: _")),
    ("JSON (orjson)", ("orjson",)),
    ("libc: allocation, copies", ("libc",)),
    ("OpenSSL (TLS; sha256 of the prefix digests)", ("OpenSSL",)),
    ("the floor relay's own code (bench/floor.py: its match, frame and SSE)", ("bench/floor.py",)),
    ("interpreter, not placed (3.11: all interpreted code; 3.12+: frames perf could not unwind)",
     (INTERPRETER, "could not place", "mypyc runtime")),
)  # fmt: skip
"""The steps of a turn, each a list of row-name fragments (the first step that matches a row
takes it; rows no step names go to "other")."""


def steps_of(rows: dict[str, float]) -> dict[str, float]:
    """µs per turn by :data:`STEPS` (plus ``other``) from µs per turn by row."""
    out = {name: 0.0 for name, _ in STEPS}
    out["other"] = 0.0
    for key, value in rows.items():
        step = next((name for name, needles in STEPS if any(n in key for n in needles)), "other")
        out[step] += value
    return out


def _steps_table(result: JSON) -> str:
    names = list(result["relays"])
    steps = {n: steps_of(result["relays"][n]["rows_us_per_turn"]) for n in names}
    lines = ["| step of a turn (µs per turn) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for step in steps[names[0]]:
        cells = [steps[n][step] for n in names]
        if any(c >= 1.0 for c in cells):
            lines.append(f"| {step} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    return "\n".join(lines)


def _table(result: JSON) -> str:
    """The Markdown table: one row per budget row, µs per turn for each relay."""
    names = list(result["relays"])
    every = Counter[str]()
    for name in names:
        every.update(result["relays"][name]["rows_us_per_turn"])
    lines = [
        "| where the time goes (µs per turn) | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for key, _ in every.most_common():
        cells = [result["relays"][n]["rows_us_per_turn"].get(key) for n in names]
        if all(c is None or c < 1.0 for c in cells):
            continue
        lines.append(f"| {key} | " + " | ".join("" if c is None else f"{c:.0f}" for c in cells) + " |")
    lines.append(
        "| **sampled, all rows** | "
        + " | ".join(f"**{result['relays'][n]['sampled_us_per_turn']:.0f}**" for n in names)
        + " |"
    )
    lines.append(
        "| CPU per turn without perf (schedstat) | "
        + " | ".join(f"{result['relays'][n]['cpu_us_per_turn']:.0f}" for n in names)
        + " |"
    )
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> JSON:
    work = Path(tempfile.mkdtemp(prefix="upshift-budget-"))
    ca = LoopbackCA.create(work / "ca") if args.tls else None
    emu = EmulatorProc(work, {}, tls=ca)
    emu.start()
    await emu.ready()
    relays: dict[str, Managed] = {}
    result: JSON = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "build": str(build_kind()),
        "python": platform.python_version(),
        "size": args.size,
        "tls": bool(args.tls),
        "load_before": os.getloadavg(),
        "relays": {},
    }
    side = SidecarProc(work, emu.base_url, tls=ca)
    floor = FloorProc(work, emu.base_url, with_aiohttp=True, tls=ca)
    for name, relay in ((f"sidecar ({result['build']})", side), ("aiohttp floor", floor)):
        if PYTHON_FRAMES:
            relay.argv[1:1] = ["-X", "perf"]
        relay.start()
        await relay.ready()
        relays[name] = relay
        result["relays"][name] = await _profile(name, relay, emu, args, work)
        relay.stop()
    result["load_after"] = os.getloadavg()
    emu.stop()
    if args.keep:
        print(f"  perf data kept in {work} (perf report -i {work}/perf-PID.data)")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.budget", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1k", help="history size of each conversation (default: 1k)")
    p.add_argument("--turns", type=int, default=300, help="continuation turns sampled per relay (default: 300)")
    p.add_argument("--freq", type=int, default=2999, help="perf samples per second (default: 2999)")
    p.add_argument("--tls", action="store_true", help="the emulator behind TLS on loopback (wss://)")
    p.add_argument("--json", help="also write the result as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the perf data (and the processes' logs)")
    p.add_argument("--functions", action="store_true", help="one row per upshift function, not per file (3.12+)")
    args = p.parse_args(argv)
    if shutil.which("perf") is None:
        sys.exit("bench.budget needs perf (Debian: apt-get install linux-perf)")
    install_signal_handlers()
    try:
        result = asyncio.run(_run(args))
    finally:
        stop_all()
    tls = ", TLS" if args.tls else ""
    load = f"load {result['load_before'][0]:.2f} → {result['load_after'][0]:.2f}"
    print(f"\n{result['build']} build, Python {result['python']}, {args.size} history{tls}, {load}\n")
    print(_steps_table(result) + "\n")
    print(_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
