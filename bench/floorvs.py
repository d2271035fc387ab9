"""Upshift against the floor relay at scale: 300 conversations of one key, alternately.

    python -m bench.floorvs                         # 300 conversations, 2 rounds, 6 turns
    python -m bench.floorvs --rounds 3 --json out.json

One emulator (its own process, the ``fast`` latency preset, ``stream_id`` lanes, no socket cap)
serves both relays, run one after the other in the same minutes, ``--rounds`` times: the floor
relay (:mod:`bench.floor`, one upstream WebSocket per app connection, every turn continued, the
least work a Python relay does) and upshift with the defaults a user has, which caps a key at
32 sockets and multiplexes the 300 conversations over their lanes. The workload: tool loops of
one key, full history every turn (``stream: true``, SSE read to the terminal event), 0-300 ms of
tool time between turns.

Reported per run: per-turn p50/p99 at the app (its own clock) and the whole run's time, errors,
the relay's CPU seconds, and for upshift the share of later turns continued and its added time
read from the app's clock (the app's time minus the upstream's own time from the access line),
the time its turns waited for a lane or a handshake (the access line's ``wait_ms``: how many
turns waited 1 ms or more, their mean wait, p50/p99 over all turns), the access lines' reasons, and the
added time of the conversations' first turns (new connections, new heads) apart.
``--upstream-nice -10`` (as root) runs the emulator ahead of the app and the relay: on a
2-core machine the relay's CPU otherwise delays the emulator's own pacing, which a remote
upstream would not feel; the results say which niceness it had (``upstream_nice``).
The emulator's time for a continued turn is the same for both relays (the context is cached on
its connection either way), so the difference of the app's per-turn times is the difference of
the relays' added times. The machine's load is read before and after each run.
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
import orjson

from .direct import DEFAULTS, KEY, NICE_HELP, access_lines, q, run_summary
from .floor import FloorProc
from .procs import EmulatorProc, SidecarProc, install_signal_handlers, stop_all


async def _turn(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, Any]:
    """POST one streamed turn; the completed response (``None``: it failed) and the answer."""
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
        if resp.status != 200:
            await resp.read()
            return None, resp
        done: dict[str, Any] | None = None
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"response.completed"' in line:
                event = orjson.loads(line[6:])
                if event.get("type") == "response.completed":
                    done = event["response"]
        return done, resp


async def workload(base_url: str, conversations: int, turns: int, seed: int) -> dict[str, Any]:
    """The tool loops against ``base_url``; per-turn times at the app."""
    rng = random.Random(seed)
    took: list[float] = []
    ids: list[tuple[str, float]] = []
    continued = later = errors = 0

    async def loop(http: aiohttp.ClientSession, i: int) -> None:
        nonlocal continued, later, errors
        items: list[Any] = [{"role": "user", "content": f"conversation {i}: fix the bug in module {i} " * 20}]
        for turn in range(turns):
            await asyncio.sleep(rng.uniform(0.0, 0.3))  # the app's tool time
            body = {"model": "gpt-6.1-sol", "input": items, "stream": True}
            began = time.perf_counter()
            done, resp = await _turn(http, base_url + "/responses", body)
            seconds = time.perf_counter() - began
            if done is None:
                errors += 1
                return
            took.append(seconds * 1000)
            ids.append((resp.headers.get("x-request-id", ""), seconds * 1000))
            if turn:
                later += 1
                continued += resp.headers.get("x-upshift-mode") == "continuation"
            items = items + done["output"] + [{"role": "user", "content": f"tool result {turn} " * 20}]

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False) as http:
        await asyncio.gather(*(loop(http, i) for i in range(conversations)))
    return {**run_summary(took, started, errors, continued, later), "_ids": ids}


async def run(relay: str, emu: EmulatorProc, logs: Path, n: int, turns: int, seed: int) -> dict[str, Any]:
    """One run through ``relay`` (``floor`` or ``upshift``), a fresh relay process."""
    await emu.reset()
    proc: FloorProc | SidecarProc = (
        FloorProc(logs, emu.base_url) if relay == "floor" else SidecarProc(logs, emu.base_url, env=DEFAULTS)
    )
    proc.start()
    await proc.ready()
    load = os.getloadavg()[0]
    cpu = proc.cpu_seconds()
    result = await workload(proc.base_url, n, turns, seed)
    result["relay_cpu_s"] = round(proc.cpu_seconds() - cpu, 2)
    proc.stop()
    ids = result.pop("_ids")
    if isinstance(proc, SidecarProc):
        lines = access_lines(proc.log_path)
        kept = [(rid, ms) for rid, ms in ids if rid in lines]
        added = [ms - lines[rid]["upstream_ms"] for rid, ms in kept]
        reported = [lines[rid]["added_ms"] for rid, _ in kept]
        waited = [float(lines[rid].get("wait_ms") or 0.0) for rid, _ in kept]
        first = [ms - lines[rid]["upstream_ms"] for rid, ms in kept if lines[rid]["reason"] == "no_head"]
        waits = [w for w in waited if w >= 1.0]  # a turn's plan always takes some microseconds
        reasons: dict[str, int] = {}
        for rid, _ in kept:
            reason = str(lines[rid].get("reason"))
            reasons[reason] = reasons.get(reason, 0) + 1
        result.update(
            waited_turns=len(waits),
            wait_ms_mean_of_waits=round(statistics.fmean(waits), 1) if waits else 0.0,
            reasons=reasons,
            wait_ms_p50=round(statistics.median(waited), 1) if waited else None,
            wait_ms_p99=round(q(waited, 0.99), 1) if waited else None,
            first_turn_added_ms_p99=round(q(first, 0.99), 1) if first else None,
            added_ms_p50=round(statistics.median(added), 1) if added else None,
            added_ms_p99=round(q(added, 0.99), 1) if added else None,
            reported_added_ms_p50=round(statistics.median(reported), 1) if reported else None,
            reported_added_ms_p99=round(q(reported, 0.99), 1) if reported else None,
        )
    return {"relay": relay, "conversations": n, "load_before": load, "load_after": os.getloadavg()[0], **result}


async def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m bench.floorvs", description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=300)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--upstream-nice", type=int, default=0, help=NICE_HELP)
    args = p.parse_args(argv)
    install_signal_handlers()
    logs = Path(tempfile.mkdtemp(prefix="bench-floorvs-"))
    emu = EmulatorProc(logs, {}, ["--latency-preset", "fast", "--ws-max-connections-per-key", "0"])
    emu.start()
    upstream_nice = emu.stand_apart(args.upstream_nice) if args.upstream_nice else 0
    results: list[dict[str, Any]] = []
    try:
        await emu.ready()
        for _ in range(args.rounds):
            for relay in ("floor", "upshift"):
                result = await run(relay, emu, logs, args.conversations, args.turns, args.seed)
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        emu.stop()
        stop_all()
    floor = [r for r in results if r["relay"] == "floor"]
    ours = [r for r in results if r["relay"] == "upshift"]
    summary = {
        "p99_over_floor_ms": [round(u["turn_ms_p99"] - f["turn_ms_p99"], 1) for f, u in zip(floor, ours, strict=True)],
        "p50_over_floor_ms": [round(u["turn_ms_p50"] - f["turn_ms_p50"], 1) for f, u in zip(floor, ours, strict=True)],
        "floor_p99_noise_ms": round(max(f["turn_ms_p99"] for f in floor) - min(f["turn_ms_p99"] for f in floor), 1),
        "upstream_nice": upstream_nice,
    }
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=2) + "\n")
    return results


if __name__ == "__main__":
    asyncio.run(main())
