"""Many conversations of one key over a per-key socket cap: lanes at scale.

    python -m bench.lanes                                  # 300 and 1,000 conversations, both upstreams
    python -m bench.lanes --conversations 1000 --json out.json
    python -m bench.lanes --upstreams no-lanes --conversations 30,300

Two upstreams side by side (``--upstreams``): ``laned`` multiplexes ``stream_id`` lanes and caps
a key at 32 sockets (``store: false`` conversations); ``no-lanes`` refuses ``stream_id``
("Unknown parameter: 'stream_id'", the socket stays usable) and caps a key at 8 sockets, with
stored (``store: true``) conversations, as xAI (it queues, protocol.md §1.8) and gateways behave. The sidecar runs
with its default settings against both: nothing tells it the cap or the lanes.

The emulator (``fast`` model preset: 50 ms overhead, 150 ms to first token, 1,000 tokens/s) runs
as its own process and refuses a key's 33rd open WebSocket with 429 + ``retry-after`` (the field's
~32 connections per key); the sidecar runs with its defaults. Each conversation is a 6-turn tool
loop, full history every turn (``stream: false``), with 50–400 ms of client tool time between
turns. Reported: continuation rate of turns 2..6, HTTP fallbacks, errors, p50/p99 added latency
read from the app's clock (the time the app waited for each answer minus the upstream's own time
for it, from the sidecar's access line), beside what the sidecar itself reported
(``x-upshift-overhead-ms``), peak sockets and busy lanes (sampled from ``/metrics``), refused
upgrades, and the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from .direct import access_lines
from .procs import EmulatorProc, SidecarProc, install_signal_handlers, stop_all

KEY = "sk-bench-lanes-0123456789abcdef"


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _gauge(text: str, name: str, state: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{state="{state}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


UPSTREAMS: dict[str, tuple[list[str], bool]] = {
    "laned": (["--ws-max-connections-per-key", "32"], False),
    "no-lanes": (["--ws-stream-ids", "reject", "--ws-max-connections-per-key", "8"], True),
}
"""Emulator flags and the conversations' ``store`` of each upstream kind."""


async def one_run(conversations: int, turns: int, seed: int, upstream: str = "laned") -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="bench-lanes-"))
    flags, store = UPSTREAMS[upstream]
    emu = EmulatorProc(logs, {}, ["--latency-preset", "fast", *flags])
    emu.start()
    await emu.ready()
    side = SidecarProc(logs, emu.base_url, env={})  # the defaults a user has
    side.start()
    await side.ready()
    rng = random.Random(seed)
    added: list[float] = []
    """What the sidecar reported (``x-upshift-overhead-ms``)."""
    seen: list[tuple[str, float]] = []
    """``(request_id, ms)``: what the app waited for each answer."""
    modes: dict[str, int] = {}
    continued = later = errors = 0
    peaks = {"sockets": 0.0, "lanes": 0.0}
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            text = await side.metrics()
            peaks["sockets"] = max(peaks["sockets"], _gauge(text, "upshift_upstream_sockets", "open"))
            peaks["lanes"] = max(peaks["lanes"], _gauge(text, "upshift_upstream_lanes", "busy"))
            await asyncio.sleep(0.2)

    async def loop(http: aiohttp.ClientSession, i: int) -> None:
        nonlocal continued, later, errors
        items: list[Any] = [{"role": "user", "content": f"conversation {i}: fix the bug"}]
        await asyncio.sleep(rng.uniform(0, 0.5))
        for turn in range(turns):
            body = {"model": "gpt-6.1-sol", "input": items, "store": store}
            began = time.perf_counter()
            async with http.post(side.base_url + "/responses", json=body,
                                 headers={"Authorization": f"Bearer {KEY}"}) as resp:  # fmt: skip
                data = await resp.json()
                waited = (time.perf_counter() - began) * 1000
                mode = resp.headers.get("x-upshift-mode", "?")
                if resp.status != 200:
                    errors += 1
                    return
                added.append(float(resp.headers.get("x-upshift-overhead-ms", "0")))
                seen.append((resp.headers.get("x-request-id", ""), waited))
            modes[mode] = modes.get(mode, 0) + 1
            if turn:
                later += 1
                continued += mode == "continuation"
            items = items + data["output"] + [{"role": "user", "content": f"tool result {turn}"}]
            await asyncio.sleep(rng.uniform(0.05, 0.4))

    sampler = asyncio.ensure_future(sample())
    load0 = os.getloadavg()
    started = time.perf_counter()
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as http:
            await asyncio.gather(*(loop(http, i) for i in range(conversations)))
    finally:
        done.set()
        await sampler
    wall = time.perf_counter() - started
    stats = await emu.stats()
    refused = sum(k.get("refused", 0) for k in stats.get("keys", {}).values())
    side.stop()
    emu.stop()
    lines = access_lines(side.log_path)
    app = [ms - lines[rid]["upstream_ms"] for rid, ms in seen if rid in lines]
    return {
        "upstream": upstream,
        "store": store,
        "conversations": conversations,
        "turns": sum(modes.values()),
        "continued_turns_2_to_n": round(continued / later, 4) if later else 0.0,
        "modes": modes,
        "http_fallbacks": modes.get("passthrough", 0),
        "errors": errors,
        "added_ms_p50": round(statistics.median(app), 3) if app else 0.0,
        "added_ms_p99": round(_q(app, 0.99), 3),
        "reported_added_ms_p50": round(statistics.median(added), 3) if added else 0.0,
        "reported_added_ms_p99": round(_q(added, 0.99), 3),
        "peak_sockets": peaks["sockets"],
        "peak_busy_lanes": peaks["lanes"],
        "refused_upgrades": refused,
        "wall_s": round(wall, 1),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


async def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m bench.lanes", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", default="300,1000")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--upstreams", default="laned,no-lanes", help="laned, no-lanes, or both (comma-separated)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    install_signal_handlers()
    results = []
    try:
        for n in (int(x) for x in args.conversations.split(",")):
            for upstream in (u for u in args.upstreams.split(",") if u):
                result = await one_run(n, args.turns, args.seed, upstream)
                print(json.dumps(result))
                results.append(result)
    finally:
        stop_all()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    asyncio.run(main())
