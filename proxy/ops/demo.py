"""``python -m proxy demo``: see upshift cut upstream bytes and wall time, offline, in ~15 s.

The demo starts two child processes on free loopback ports: the emulated OpenAI upstream
(``python -m upshift_emulator``, with a latency model) and a sidecar in front of it
(``python -m proxy``). It then runs the same coding-agent loop twice with a plain aiohttp
client, the way an unmodified app talks to the Responses API (full history on every turn,
streaming): once straight to the emulator over HTTP, once through the sidecar. Between the runs
the emulator's counters are reset, so the table compares what reached the upstream each time.

No API key, no network: every socket is on 127.0.0.1, and the children are stopped on every
path out (normal exit, error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

import aiohttp
import orjson

from proxy.wire import sse

__all__ = ["LoopResult", "main", "run_agent_loop"]

MODEL = "gpt-6.1-sol"
DEMO_KEY = "sk-upshift-demo-not-a-real-key"
"""The emulator accepts any key; this one only shows that the app's own key goes upstream."""
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
LATENCIES = ("realistic", "fast", "zero")

INSTRUCTIONS = (
    "You are a coding agent working in a Python repository. Use the tools to inspect files and run "
    "commands; keep going until the task is done, then summarise what you changed. "
) * 8

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a shell command in the repository and return its output.",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "workdir": {"type": "string"},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
        "strict": False,
    },
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
        "strict": False,
    },
]

_LOG_WORDS = (
    "collected passed failed error warning import module function assert expected actual "
    "traceback line self value config request response socket stream buffer handler"
).split()


class DemoError(Exception):
    """Something the demo needs did not work; the message says what."""


class _ChildExited(DemoError):
    """A child exited before it was ready (e.g. its port was taken meanwhile)."""


@dataclass(frozen=True, slots=True)
class LoopResult:
    """One run of the agent loop, as seen by the upstream."""

    label: str
    turns: int
    upstream_bytes: int
    continuations: int
    wall_s: float


# -- the agent loop (a plain aiohttp client, as an unmodified app would behave) -----------------


def tool_output(step: int, size: int) -> str:
    """A deterministic, log-like tool output of about ``size`` bytes."""
    rng = random.Random(step)
    lines = [f"$ pytest -x tests/test_step_{step}.py"]
    length = len(lines[0])
    while length < size:
        words = " ".join(rng.choice(_LOG_WORDS) for _ in range(rng.randint(6, 14)))
        line = f"tests/test_step_{step}.py:{rng.randint(1, 999)}: {words} ({rng.randint(0, 1 << 30):x})"
        lines.append(line)
        length += len(line) + 1
    return "\n".join(lines)[:size]


async def _stream_response(session: aiohttp.ClientSession, url: str, body: bytes, api_key: str) -> dict[str, Any]:
    """POST one streaming ``/responses`` request; return the completed response object."""
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            text = (await resp.text())[:500]
            raise DemoError(f"POST {url} answered {resp.status}: {text}")
        decoder = sse.Decoder()
        async for chunk in resp.content.iter_any():
            for sse_event in decoder.feed(chunk):
                event = orjson.loads(sse_event.data)
                kind = event.get("type")
                if kind == "response.completed":
                    response: dict[str, Any] = event["response"]
                    return response
                if kind in ("response.failed", "response.incomplete", "error"):
                    raise DemoError(f"POST {url}: {kind}: {orjson.dumps(event).decode()[:500]}")
    raise DemoError(f"POST {url}: the stream ended without response.completed")


async def run_agent_loop(base_url: str, *, turns: int, tool_output_kb: float, api_key: str = DEMO_KEY) -> int:
    """Run one agent loop of ``turns`` requests against ``base_url`` (``.../v1``).

    The task asks the emulated model for ``turns - 1`` tool calls, so the loop makes that many
    function calls (each answered with a tool output of ``tool_output_kb`` KiB) and ends with
    the final message. Every request carries the whole history, as agents do.

    Args:
        base_url: The app's ``OPENAI_BASE_URL``.
        turns: Requests to make (at least 2).
        tool_output_kb: Size of each tool output in KiB.
        api_key: Sent as ``Authorization: Bearer ...``.

    Returns:
        The number of requests made (``turns``).

    Raises:
        DemoError: A request failed, or the model did not follow the script.
    """
    url = base_url.rstrip("/") + "/responses"
    size = max(int(tool_output_kb * 1024), 1)
    history: list[Any] = [
        {
            "type": "message",
            "role": "user",
            "content": f"The test suite fails. Find the bug and fix it. steps={turns - 1}",
        }
    ]
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for turn in range(1, turns + 1):
            body = orjson.dumps(
                {
                    "model": MODEL,
                    "instructions": INSTRUCTIONS,
                    "tools": TOOLS,
                    "input": history,
                    "reasoning": {"effort": "low"},
                    "stream": True,
                }
            )
            response = await _stream_response(session, url, body, api_key)
            output = response.get("output") or []
            history.extend(output)
            calls = [item for item in output if item.get("type") == "function_call"]
            if not calls:
                if turn != turns:
                    raise DemoError(f"the model answered after {turn} of {turns} turns")
                return turn
            for call in calls:
                history.append(
                    {"type": "function_call_output", "call_id": call["call_id"], "output": tool_output(turn, size)}
                )
    raise DemoError(f"the model still called tools after {turns} turns")


# -- child processes -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _child_env() -> dict[str, str]:
    """The environment for the children: ``proxy`` importable, no stray ``UPSHIFT_*`` settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UPSHIFT_")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Child:
    """One child process whose output goes to a temporary file (shown if it fails)."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.name = name
        self.args = args
        self.log: IO[bytes] = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=_child_env(),
        )

    def output(self, limit: int = 2000) -> str:
        """The last ``limit`` characters the child wrote."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-limit:]

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL if needed; close the log."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(STOP_TIMEOUT_S)
        finally:
            self.log.close()


async def _wait_ready(child: Child, url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise _ChildExited(f"{child.name} exited with code {child.proc.returncode}:\n{child.output()}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise DemoError(f"{child.name} was not ready within {READY_TIMEOUT_S:g} s:\n{child.output()}")


async def _stats(session: aiohttp.ClientSession, emulator: str) -> dict[str, Any]:
    async with session.get(emulator + "/_emulator/stats") as resp:
        stats: dict[str, Any] = await resp.json()
        return stats


async def _measure(label: str, base_url: str, emulator: str, turns: int, kb: float) -> LoopResult:
    async with aiohttp.ClientSession() as session:
        async with session.post(emulator + "/_emulator/reset") as resp:
            resp.raise_for_status()
        started = time.perf_counter()
        made = await run_agent_loop(base_url, turns=turns, tool_output_kb=kb)
        wall = time.perf_counter() - started
        stats = await _stats(session, emulator)
    return LoopResult(
        label=label,
        turns=made,
        upstream_bytes=sum(stats["bytes_received"].values()),
        continuations=sum(stats["continuations"].values()),
        wall_s=wall,
    )


async def _start(latency: str, children: list[Child]) -> tuple[str, str]:
    """Start the emulator and the sidecar; return their base URLs (``.../v1``) once ready.

    Free ports are picked before the children bind them; if another process takes one in
    between, the child exits and the pair is started again on new ports.
    """
    for attempt in range(3):
        emu_port, api_port, admin_port = _free_port(), _free_port(), _free_port()
        emu = f"http://127.0.0.1:{emu_port}"
        emulator = Child(
            "emulator",
            ["-m", "upshift_emulator", "--listen", f"127.0.0.1:{emu_port}", "--latency-preset", latency,
             "--log-level", "WARNING"],
        )  # fmt: skip
        children.append(emulator)
        sidecar = Child(
            "sidecar",
            ["-m", "proxy", "--listen", f"127.0.0.1:{api_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
             "--upstream", emu + "/v1", "--log-level", "warning"],
        )  # fmt: skip
        children.append(sidecar)
        try:
            await _wait_ready(emulator, emu + "/_emulator/health")
            await _wait_ready(sidecar, f"http://127.0.0.1:{admin_port}/readyz")
        except _ChildExited:
            if attempt == 2:
                raise
            for child in (sidecar, emulator):
                child.stop()
                children.remove(child)
            continue
        return emu + "/v1", f"http://127.0.0.1:{api_port}/v1"
    raise AssertionError("unreachable")


async def _run(args: argparse.Namespace, children: list[Child]) -> tuple[LoopResult, LoopResult]:
    _progress("starting the emulated upstream and the sidecar ...")
    emulator_v1, sidecar_v1 = await _start(args.latency, children)
    emu = emulator_v1.removesuffix("/v1")
    _progress(f"run 1/2: straight to the emulator ({emulator_v1}) ...")
    direct = await _measure("direct (HTTP)", emulator_v1, emu, args.turns, args.tool_output_kb)
    _progress(f"run 2/2: through upshift ({sidecar_v1}) ...")
    through = await _measure("through upshift", sidecar_v1, emu, args.turns, args.tool_output_kb)
    return direct, through


def _progress(text: str) -> None:
    print("  " + text, flush=True)


# -- output --------------------------------------------------------------------------------------


def format_table(direct: LoopResult, through: LoopResult) -> str:
    """The result table (stable layout: tests parse it)."""
    rows = [("", "turns", "upstream bytes", "continuations", "wall time")]
    for r in (direct, through):
        rows.append((r.label, str(r.turns), f"{r.upstream_bytes:,}", str(r.continuations), f"{r.wall_s:.2f} s"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [
        "  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
        for row in rows
    ]
    saved = 1 - through.upstream_bytes / direct.upstream_bytes if direct.upstream_bytes else 0.0
    speedup = direct.wall_s / through.wall_s if through.wall_s > 0 else float("inf")
    lines.append("")
    lines.append(f"upstream bytes saved: {saved:.0%}    speed-up: {speedup:.2f}x")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="upshift demo",
        description="Run a sample agent loop against an emulated upstream, directly and through upshift, "
        "and compare upstream bytes and wall time. Offline: no key, no network.",
    )
    p.add_argument("--turns", type=int, default=15, help="requests per loop: turns-1 tool calls + the answer (15)")
    p.add_argument("--tool-output-kb", type=float, default=4.0, help="size of each tool output in KiB (4)")
    p.add_argument(
        "--latency",
        choices=LATENCIES,
        default="fast",
        help="emulated model latency (fast): realistic = GPT-5-class, fast = fast coding model, zero = instant",
    )
    return p


class _Signals:
    """SIGINT and SIGTERM raise KeyboardInterrupt (so the cleanup runs) and are remembered.

    Ctrl-C in a terminal reaches the children too; they may exit before the demo notices the
    signal, and the demo must then report an interruption rather than a failed connection.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            raise KeyboardInterrupt

    def __enter__(self) -> _Signals:
        with contextlib.suppress(ValueError):  # not the main thread: leave the handlers alone
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def main(argv: list[str]) -> int:
    """Run the demo; returns the exit code (0 ok, 1 failed, 2 usage, 130 interrupted)."""
    args = _parser().parse_args(argv)
    if args.turns < 2:
        _parser().error("--turns must be at least 2")
    if args.tool_output_kb <= 0:
        _parser().error("--tool-output-kb must be > 0")
    print(
        f"upshift demo: a {args.turns}-turn agent loop ({args.turns - 1} tool calls, "
        f"{args.tool_output_kb:g} KiB per tool output), emulated upstream with {args.latency} latency; "
        "no key, no network.",
        flush=True,
    )
    children: list[Child] = []
    with _Signals() as signals:
        try:
            try:
                direct, through = asyncio.run(_run(args, children))
            finally:
                for child in reversed(children):
                    child.stop()
        except KeyboardInterrupt:
            signals.received = signals.received or signal.SIGINT
        except (DemoError, OSError, aiohttp.ClientError) as exc:
            if signals.received is None:
                print(f"upshift demo failed: {exc}", file=sys.stderr)
                return 1
        if signals.received is not None:
            print("\ninterrupted", file=sys.stderr)
            return 130
    print()
    print(format_table(direct, through))
    if args.latency == "zero":
        print("(zero latency: the model costs nothing, so the wall times only show the extra local hop)")
    return 0
