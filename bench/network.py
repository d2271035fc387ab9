"""Network distance: a remote API's round trip and connection setup, through upshift vs direct HTTP.

A second emulator runs with a round-trip time per message and a connection-setup delay (TCP +
TLS + upgrade), given as its own command-line flags (``--network-flags``, a template with
``{rtt}`` and ``{connect}``, so the phase follows whatever the emulator names them). The model's
own latency (``--network-latency``, ``fast`` by default) is the same for both, so a first turn
differs only by what the path adds, and a later turn also by the history the upstream re-reads
over HTTP. ``conversations`` times, alternating which goes first:

* **first turn** of a new conversation through upshift (no head: a full send on whatever socket
  the sidecar has or opens) vs the same body sent directly over a kept-alive HTTP connection
  (the connection was opened and used before, as an app's HTTP client keeps it);
* **later turns**: through upshift (continuations) vs direct HTTP with the full history.

Reported: medians (and p90) per turn index, and whether upshift's first turn is no slower.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .clients import READ_TIMEOUT, echo_items, post_sse, sdk_headers
from .procs import EmulatorProc, SidecarProc
from .stats import percentile, summary
from .workload import AgentHistory, body_fields

__all__ = ["DEFAULT_FLAGS", "emulator_flags", "run_network"]

JSON = Any
Log = Callable[[str], None]
DEFAULT_FLAGS = "--rtt-ms {rtt} --connect-ms {connect}"
"""Emulator flags for the network model (override with ``--network-flags``)."""


def emulator_flags(template: str, rtt_ms: float, connect_ms: float) -> list[str]:
    """The flags, formatted; an empty list if the emulator does not know them (checked with --help)."""
    flags = shlex.split(template.format(rtt=rtt_ms, connect=connect_ms))
    names = [f.split("=", 1)[0] for f in flags if f.startswith("--")]
    helptext = subprocess.run(
        [sys.executable, "-m", "upshift_emulator", "--help"], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout  # fmt: skip
    return flags if all(name in helptext for name in names) else []


def _calls(response: JSON) -> list[JSON]:
    return [o for o in (response or {}).get("output") or [] if o.get("type") == "function_call"]


async def run_network(
    logs: Path,
    *,
    rtt_ms: float,
    connect_ms: float,
    template: str,
    conversations: int,
    later_turns: int,
    first_bytes: int,
    seed: int,
    log: Log,
    latency: dict[str, float] | None = None,
) -> JSON:
    """The whole phase, with its own emulator (model ``latency`` plus the network) and sidecar."""
    flags = emulator_flags(template, rtt_ms, connect_ms)
    if not flags:
        note = f"emulator has no network flags ({template!r}); phase skipped"
        log(f"  network: {note}")
        return {"note": note}
    emu = EmulatorProc(logs, dict(latency or {}), extra=flags)
    emu.name = "emulator-network"
    emu.log_path = logs / "emulator-network.log"
    emu.start()
    side: SidecarProc | None = None
    try:
        await emu.ready()
        side = SidecarProc(logs, emu.base_url)
        side.name, side.log_path = "sidecar-network", logs / "sidecar-network.log"
        side.start()
        await side.ready()
        found = await _measure(emu, side, rtt_ms, connect_ms, flags, conversations, later_turns, first_bytes, seed, log)
        found["latency_model"] = latency or {}
        return found
    finally:
        if side is not None:
            side.stop()
        emu.stop()


async def _measure(
    emu: EmulatorProc,
    side: SidecarProc,
    rtt_ms: float,
    connect_ms: float,
    flags: list[str],
    conversations: int,
    later_turns: int,
    first_bytes: int,
    seed: int,
    log: Log,
) -> JSON:
    headers = sdk_headers()
    fields = body_fields(stream=True, light=False)
    urls = {"upshift": side.base_url + "/responses", "direct": emu.base_url + "/responses"}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT)
    per_turn: dict[str, list[list[float]]] = {k: [[] for _ in range(later_turns + 1)] for k in urls}
    first_event: dict[str, list[float]] = {k: [] for k in urls}
    own_first: list[float] = []  # the sidecar's own time on first turns (x-upshift-overhead-ms)
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as up,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as direct,
    ):
        sessions = {"upshift": up, "direct": direct}
        # keep-alive HTTP connections to both, opened before anything is timed
        warm = AgentHistory(2_000, seed, f"net-warm-{time.monotonic_ns()}", 1).items
        for name in urls:
            await post_sse(sessions[name], urls[name], orjson.dumps({"input": warm, **fields}), headers)
        for i in range(conversations):
            order = ["upshift", "direct"] if i % 2 == 0 else ["direct", "upshift"]
            history = AgentHistory(first_bytes, seed, f"net-{seed}-{i}-{time.monotonic_ns()}", later_turns + 1)
            inputs = {name: list(history.items) for name in urls}
            for turn in range(later_turns + 1):
                for name in order:
                    body = orjson.dumps({"input": inputs[name], **fields})
                    res = await post_sse(sessions[name], urls[name], body, headers)
                    per_turn[name][turn].append(res.total * 1000)
                    if turn == 0:
                        first_event[name].append(res.ttfb * 1000)
                        own = res.headers.get("x-upshift-overhead-ms")
                        if name == "upshift" and own is not None:
                            own_first.append(float(own))
                    calls = _calls(res.response)
                    if calls:
                        inputs[name] += echo_items(res.response.get("output") or [])
                        inputs[name].append(
                            {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "ok " * 200}
                        )
                await asyncio.sleep(0)
    medians = {name: [round(percentile(t, 50), 2) for t in turns] for name, turns in per_turn.items()}
    out: JSON = {
        "rtt_ms": rtt_ms,
        "connect_ms": connect_ms,
        "emulator_flags": flags,
        "conversations": conversations,
        "first_turn_bytes": first_bytes,
        "first_turn_ms": {name: summary(per_turn[name][0]) for name in urls},
        "first_event_ms": {name: summary(first_event[name]) for name in urls},
        "first_turn_sidecar_own_ms": summary(own_first),
        "later_turn_ms": {name: summary([v for t in per_turn[name][1:] for v in t]) for name in urls},
        "median_per_turn_ms": medians,
        "first_turn_no_slower": medians["upshift"][0] <= medians["direct"][0],
        "later_turns_faster": all(u < d for u, d in zip(medians["upshift"][1:], medians["direct"][1:], strict=True)),
    }
    log(
        f"  network at {rtt_ms:g} ms RTT: first turn upshift {medians['upshift'][0]:.1f} ms vs direct HTTP "
        f"{medians['direct'][0]:.1f} ms (median of {conversations}); later turns upshift "
        f"{out['later_turn_ms']['upshift'].get('p50', float('nan')):.1f} vs "
        f"{out['later_turn_ms']['direct'].get('p50', float('nan')):.1f} ms"
    )
    return out
