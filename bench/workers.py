"""Relayed turns per second at saturation with 1, 2, 3 ... worker processes (``--workers N``).

    python -m bench.workers                       # workers 1,2,3; 64 agents; 8 s per point
    python -m bench.workers --workers 1,2 --duration 5 --concurrency 96 --json out.json
    python -m bench.workers --shared-pool         # all agents share one connection pool

The emulator (zero latency) and the sidecar run as separate processes on 127.0.0.1; this process
drives ``--concurrency`` agents, each running 6-turn tool loops back to back over plain HTTP
(small bodies, so the client costs little). Each agent keeps its own connection, as one SDK
client per agent does (``--shared-pool``: one pool for all, so a conversation's turns ride
whichever connection is free). Handoffs (``upshift_handoffs_total{outcome="adopted"}``) and
byte forwards (``upshift_forwards_total{outcome="ok"}``) per turn in the window are reported
next to turns/s. Turns completed in the measuring window (after a
warm-up) give turns/s; the ``x-upshift-mode`` of each answer gives the continuation rate (a
forwarded answer carries its owner's mode). CPU seconds of the sidecar (supervisor + workers),
the emulator and this client are read with psutil: on a small machine they compete for the
same cores, so the figures say how far the sidecar itself scales, not a clean per-core rate.
Efficiency = turns/s with N workers / (N x turns/s with 1), capped by the cores available.
``capacity/s`` = N x 1000 / (sidecar CPU ms per turn): what N workers could relay with N idle
cores, the figure that matters where the load generator does not share the machine.

Register it in ``python -m bench`` as a phase by calling :func:`main` with its own arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from .procs import EmulatorProc, SidecarProc, install_signal_handlers, stop_all

JSON = Any
KEY = "sk-bench-workers"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
TOOLS = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
]
STEPS = 5


class Load:
    """Counts turns (and continuations) completed inside the measuring window."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.turns = 0
        self.continued = 0
        self.later_turns = 0
        self.errors = 0

    def count(self, turn: int, mode: str | None) -> None:
        now = time.monotonic()
        if self.start <= now <= self.end:
            self.turns += 1
            if turn > 0:
                self.later_turns += 1
                self.continued += mode == "continuation"


async def agent(session: aiohttp.ClientSession, url: str, index: int, load: Load) -> None:
    conversation = 0
    while time.monotonic() < load.end:
        conversation += 1
        task = f"Task agent-{index}-{conversation}: inspect the repository, steps={STEPS}, then summarise."
        history: list[JSON] = [{"role": "user", "content": task}]
        for turn in range(STEPS + 2):
            body = orjson.dumps({"model": "gpt-6.1-sol", "input": history, "tools": TOOLS})
            try:
                async with session.post(url, data=body, headers=HEADERS) as resp:
                    data = await resp.read()
                    mode = resp.headers.get("x-upshift-mode")
                    if resp.status != 200:
                        load.errors += 1
                        break
            except aiohttp.ClientError:
                load.errors += 1
                break
            load.count(turn, mode)
            output = orjson.loads(data)["output"]
            history += output
            calls = [o for o in output if o.get("type") == "function_call"]
            if not calls:
                break
            history += [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok"} for c in calls]


def _cpu(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _moves(text: str) -> tuple[float, float]:
    """(handoffs adopted, forwards ok) in a ``/metrics`` exposition."""
    handed = forwarded = 0.0
    for line in text.splitlines():
        if line.startswith("upshift_handoffs_total{") and 'outcome="adopted"' in line:
            handed += float(line.rsplit(" ", 1)[1])
        elif line.startswith("upshift_forwards_total{") and 'outcome="ok"' in line:
            forwarded += float(line.rsplit(" ", 1)[1])
    return handed, forwarded


async def measure(
    workers: int, concurrency: int, duration: float, warmup: float, log_dir: Path, *, shared: bool = False
) -> dict[str, JSON]:
    emulator = EmulatorProc(log_dir, {})
    emulator.start()
    await emulator.ready()
    sidecar = SidecarProc(log_dir, emulator.base_url, env={"UPSHIFT_WORKERS": str(workers)})
    sidecar.start()
    try:
        await sidecar.ready()
        assert sidecar.ps is not None and emulator.ps is not None
        me = psutil.Process()
        now = time.monotonic()
        load = Load(now + warmup, now + warmup + duration)
        # One connection per agent (one SDK client each), or one pool for all (--shared-pool).
        sessions = [
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0 if shared else 1))
            for _ in range(1 if shared else concurrency)
        ]
        try:
            url = sidecar.base_url + "/responses"
            tasks = [asyncio.create_task(agent(sessions[i % len(sessions)], url, i, load)) for i in range(concurrency)]
            await asyncio.sleep(max(load.start - time.monotonic(), 0))
            cpu0 = (_cpu(sidecar.ps), _cpu(emulator.ps), _cpu(me))
            moves0 = _moves(await sidecar.metrics())
            psutil.cpu_percent()
            await asyncio.sleep(max(load.end - time.monotonic(), 0))
            cpu1 = (_cpu(sidecar.ps), _cpu(emulator.ps), _cpu(me))
            machine = psutil.cpu_percent()
            moves1 = _moves(await sidecar.metrics())
            await asyncio.gather(*tasks)
        finally:
            for session in sessions:
                await session.close()
        turns = max(load.turns, 1)
        return {
            "workers": workers,
            "concurrency": concurrency,
            "seconds": duration,
            "turns": load.turns,
            "turns_per_s": round(load.turns / duration, 1),
            "continuation_rate": round(load.continued / load.later_turns, 4) if load.later_turns else None,
            "errors": load.errors,
            "connections": "shared pool" if shared else "one per agent",
            "handoffs_per_turn": round((moves1[0] - moves0[0]) / turns, 4),
            "forwards_per_turn": round((moves1[1] - moves0[1]) / turns, 4),
            "cpu_cores": {
                "sidecar": round((cpu1[0] - cpu0[0]) / duration, 2),
                "emulator": round((cpu1[1] - cpu0[1]) / duration, 2),
                "client": round((cpu1[2] - cpu0[2]) / duration, 2),
            },
            "sidecar_cpu_ms_per_turn": round((cpu1[0] - cpu0[0]) / load.turns * 1000, 3) if load.turns else None,
            "machine_cpu_percent": machine,
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
    finally:
        sidecar.stop()
        emulator.stop()


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.workers", description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2,3", help="comma-separated worker counts (default 1,2,3)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent agents (default 64)")
    p.add_argument("--duration", type=float, default=8.0, help="measuring window per point, s (default 8)")
    p.add_argument("--warmup", type=float, default=2.0, help="warm-up before the window, s (default 2)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument(
        "--shared-pool",
        action="store_true",
        help="all agents share one connection pool (default: one connection per agent, as one SDK client each)",
    )
    args = p.parse_args(argv)
    install_signal_handlers()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        for n in (int(x) for x in args.workers.split(",")):
            point = await measure(n, args.concurrency, args.duration, args.warmup, Path(tmp), shared=args.shared_pool)
            results.append(point)
            print(json.dumps(point), flush=True)
    base = results[0]["turns_per_s"] if results and results[0]["workers"] == 1 else None
    cores = psutil.cpu_count() or 1
    print(
        f"\n{'workers':>7} {'turns/s':>8} {'speedup':>8} {'efficiency':>10} {'cont.':>6} {'sidecar cores':>13}"
        f" {'ms CPU/turn':>11} {'capacity/s':>10} {'handoffs/turn':>13} {'forwards/turn':>13}"
    )
    for r in results:
        speedup = r["turns_per_s"] / base if base else float("nan")
        efficiency = speedup / min(r["workers"], cores) if base else float("nan")
        r["speedup"], r["efficiency"] = round(speedup, 3), round(efficiency, 3)
        per_turn = r["sidecar_cpu_ms_per_turn"] or float("nan")
        # What N workers could relay with N free cores: the sidecar's own CPU per turn decides.
        r["capacity_turns_per_s"] = round(r["workers"] * 1000 / per_turn, 0)
        print(
            f"{r['workers']:>7} {r['turns_per_s']:>8} {speedup:>8.2f} {efficiency:>10.0%} "
            f"{r['continuation_rate']:>6} {r['cpu_cores']['sidecar']:>13} {per_turn:>11}"
            f" {r['capacity_turns_per_s']:>10} {r['handoffs_per_turn']:>13} {r['forwards_per_turn']:>13}"
        )
    print(f"(machine: {cores} cores, load average {os.getloadavg()[0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": cores, "results": results}, indent=2))
    stop_all()
    return 0


def run() -> int:
    """Entry point (uvloop for the load generator when installed: the client is the costliest
    process of the three on a small machine)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    result: int = uvloop.run(main())
    return result


if __name__ == "__main__":
    sys.exit(run())
