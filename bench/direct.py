"""Never slower than direct: the same workload straight to the upstream, and through upshift.

    python -m bench.direct                                   # every condition
    python -m bench.direct --conditions no-lanes-300,store-false --json out.json

Each condition starts an emulator (its own process, the ``fast`` latency preset: 50 ms
overhead, 8 ms per KiB of context not in the connection cache, 150 ms to the first token,
1,000 tokens/s, so a continuation on a warm socket is cheaper than a full send) and runs one
workload four times, alternately: the app straight to the emulator over HTTP, the app through
a fresh sidecar with the defaults a user has, the app through the bare HTTP floor relay
(``python -m bench.floor --http``: aiohttp on both sides, every body and answer passed
unchanged: the least a Python hop adds), then straight again (the two direct runs give the
machine's noise in the same minutes). The workload: ``--conversations`` tool loops of one key,
``--turns`` turns each (full history every turn, ``stream: false``), 0-300 ms of tool time
between turns. Conditions:

- ``lanes``: an upstream with ``stream_id`` lanes, 32 sockets per key;
- ``no-lanes-30`` / ``no-lanes-300``: no lanes (``stream_id`` refused), 8 sockets per key,
  stored conversations, 30 and 300 of them;
- ``store-false``: no lanes, 8 sockets, ``store: false``;
- ``refused``: every WebSocket upgrade refused (403, a proxy that blocks WebSocket);
- ``burst-429``: the first 20 upgrades answered 429 + ``retry-after: 1``.

Reported per condition and run: per-turn p50/p99 at the app (its own clock), the p50 of the
conversations' first turns and of their later turns apart (the first turns arrive together, in
the first 0.3 s: new connections and new heads), the whole run's time, errors, and for upshift
the share of later turns continued, the sidecar's CPU seconds, its added time from the app's
clock (the app's time minus the upstream's own time, per request from the access line) beside
what its access line reported, and the machine's load before and after.
``--upstream-nice -10`` (as root) runs the emulator ahead of the app and the relay: on a
2-core machine the relay's CPU otherwise delays the emulator's own pacing, which a remote
upstream would not feel; the results say which niceness it had (``upstream_nice``).
``never_slower``: upshift's p50, p99 and whole run no higher than direct's plus the
noise of the two direct runs (and 5 ms, 0.1 s); ``floor_http_never_slower``: the same for the
bare HTTP relay, with its CPU seconds (``floor_http_cpu_s``) beside the sidecar's.
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

from .floor import FloorProc
from .procs import EmulatorProc, SidecarProc, install_signal_handlers, stop_all

KEY = "sk-bench-direct-0123456789abcdef"
DEFAULTS = {
    # SidecarProc raises these for the capacity benchmarks; here the user's defaults hold.
    "UPSHIFT_POOL_MAX_SOCKETS_PER_IDENTITY": "32",
    "UPSHIFT_POOL_MAX_SOCKETS_TOTAL": "256",
    "UPSHIFT_MATCHING_MAX_HEADS": "10000",
}
CONDITIONS: dict[str, tuple[list[str], bool, int, list[dict[str, Any]]]] = {
    "lanes": (["--ws-max-connections-per-key", "32"], True, 30, []),
    "no-lanes-30": (["--ws-stream-ids", "reject", "--ws-max-connections-per-key", "8"], True, 30, []),
    "no-lanes-300": (["--ws-stream-ids", "reject", "--ws-max-connections-per-key", "8"], True, 300, []),
    "store-false": (["--ws-stream-ids", "reject", "--ws-max-connections-per-key", "8"], False, 30, []),
    "refused": ([], True, 30, [{"kind": "refuse_upgrade", "status": 403, "count": 1_000_000}]),
    "burst-429": (
        [],
        True,
        30,
        [{"kind": "refuse_upgrade", "status": 429, "count": 20, "headers": {"retry-after": "1"}}],
    ),
}
"""Emulator flags, the conversations' ``store``, how many (unless ``--conversations``), faults."""
NICE_HELP = (
    "the emulator's niceness (e.g. -10, as root): on a small machine the relay's CPU otherwise delays "
    "the emulator's own pacing, which a remote upstream would not feel (0: unchanged, the default)"
)


def q(values: list[float], quantile: float) -> float:
    """The ``quantile`` of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] if ordered else 0.0


def run_summary(
    took: list[float],
    started: float,
    errors: int,
    continued: int,
    later: int,
    apart: tuple[list[float], list[float]] | None = None,
) -> dict[str, Any]:
    """One workload's figures: per-turn p50/p99 (ms), the whole run's time, turns, errors and
    the share of later turns continued; with ``apart`` (the times of the conversations' first
    turns and of their later turns, which ``took`` holds together), the p50 of each."""
    medians: dict[str, float] = {}
    if apart is not None:
        for key, times in zip(("first_turn_ms_p50", "later_turn_ms_p50"), apart, strict=True):
            medians[key] = round(statistics.median(times), 1) if times else 0.0
    return {
        **medians,
        "turn_ms_p50": round(statistics.median(took), 1) if took else 0.0,
        "turn_ms_p99": round(q(took, 0.99), 1),
        "run_s": round(time.perf_counter() - started, 2),
        "turns": len(took),
        "errors": errors,
        "continued_later": round(continued / later, 4) if later else 0.0,
    }


def access_lines(log: Path) -> dict[str, dict[str, Any]]:
    """The sidecar's access lines in its log, by ``request_id``."""
    found: dict[str, dict[str, Any]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"logger":"upshift.access"' in line:
            try:
                fields = json.loads(line)
            except ValueError:
                continue
            found[fields["request_id"]] = fields
    return found


async def workload(base_url: str, conversations: int, turns: int, store: bool, seed: int) -> dict[str, Any]:
    """Run the tool loops against ``base_url``; per-turn times at the app."""
    rng = random.Random(seed)
    took: list[float] = []
    first: list[float] = []
    rest: list[float] = []
    ids: list[tuple[str, float]] = []
    modes: dict[str, int] = {}
    continued = later = errors = 0

    async def loop(http: aiohttp.ClientSession, i: int) -> None:
        nonlocal continued, later, errors
        items: list[Any] = [{"role": "user", "content": f"conversation {i}: fix the bug in module {i} " * 20}]
        for turn in range(turns):
            await asyncio.sleep(rng.uniform(0.0, 0.3))  # the app's tool time
            body = {"model": "gpt-6.1-sol", "input": items, "store": store}
            began = time.perf_counter()
            async with http.post(
                base_url + "/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as resp:
                data = await resp.json()
                seconds = time.perf_counter() - began
                mode = resp.headers.get("x-upshift-mode", "direct")
                if resp.status != 200:
                    errors += 1
                    return
            took.append(seconds * 1000)
            (rest if turn else first).append(seconds * 1000)
            ids.append((resp.headers.get("x-request-id", ""), seconds * 1000))
            modes[mode] = modes.get(mode, 0) + 1
            if turn:
                later += 1
                continued += mode == "continuation"
            items = items + data["output"] + [{"role": "user", "content": f"tool result {turn} " * 20}]

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False) as http:
        await asyncio.gather(*(loop(http, i) for i in range(conversations)))
    return {**run_summary(took, started, errors, continued, later, (first, rest)), "modes": modes, "_ids": ids}


def _never_slower(relayed: dict[str, Any], direct: dict[str, Any], noise: dict[str, Any]) -> bool:
    """p50, p99 and the whole run no higher than direct's plus the noise of the two direct runs
    (and 5 ms, 0.1 s)."""
    return all(
        relayed[k] <= direct[k] + noise[k] + (5.0 if k != "run_s" else 0.1)
        for k in ("turn_ms_p50", "turn_ms_p99", "run_s")
    )


async def _through(
    relay: SidecarProc | FloorProc, n: int, turns: int, store: bool, seed: int
) -> tuple[dict[str, Any], float]:
    """The workload through ``relay`` (started here, stopped after): its figures and the
    relay's CPU seconds meanwhile."""
    relay.start()
    await relay.ready()
    cpu = relay.cpu_seconds()
    try:
        return await workload(relay.base_url, n, turns, store, seed), relay.cpu_seconds() - cpu
    finally:
        relay.stop()


async def condition(name: str, conversations: int | None, turns: int, seed: int, nice: int = 0) -> dict[str, Any]:
    """One condition: direct, upshift, the bare HTTP relay, direct, on one emulator."""
    flags, store, default_n, faults = CONDITIONS[name]
    n = conversations or default_n
    logs = Path(tempfile.mkdtemp(prefix=f"bench-direct-{name}-"))
    emu = EmulatorProc(logs, {}, ["--latency-preset", "fast", *flags])
    emu.start()
    upstream_nice = emu.stand_apart(nice) if nice else 0
    await emu.ready()
    result: dict[str, Any] = {"condition": name, "conversations": n, "store": store, "load_before": os.getloadavg()[0]}
    result["upstream_nice"] = upstream_nice
    try:
        first = await workload(emu.base_url, n, turns, store, seed)
        await emu.reset()
        for fault in faults:
            await emu._call("POST", "/_emulator/faults", fault)
        side = SidecarProc(logs, emu.base_url, env=DEFAULTS)
        through, cpu = await _through(side, n, turns, store, seed)
        lines = access_lines(side.log_path)
        ids = [(rid, ms) for rid, ms in through.pop("_ids") if rid in lines]
        added = [ms - lines[rid]["upstream_ms"] for rid, ms in ids]
        reported = [lines[rid]["added_ms"] for rid, _ in ids]
        await emu.reset()
        bare, floor_cpu = await _through(FloorProc(logs, emu.base_url, http=True), n, turns, store, seed)
        await emu.reset()
        second = await workload(emu.base_url, n, turns, store, seed)
    finally:
        emu.stop()
    first.pop("_ids"), second.pop("_ids"), bare.pop("_ids")
    noise = {k: round(abs(first[k] - second[k]), 1) for k in ("turn_ms_p50", "turn_ms_p99", "run_s")}
    apart = ("first_turn_ms_p50", "later_turn_ms_p50")
    direct = {k: round((first[k] + second[k]) / 2, 2) for k in ("turn_ms_p50", "turn_ms_p99", "run_s", *apart)}
    result.update(
        direct=direct,
        direct_noise=noise,
        direct_errors=first["errors"] + second["errors"],
        upshift={
            k: through[k] for k in ("turn_ms_p50", "turn_ms_p99", "run_s", *apart, "errors", "modes", "continued_later")
        },
        upshift_added_ms_p50=round(statistics.median(added), 1) if added else None,
        upshift_added_ms_p99=round(q(added, 0.99), 1) if added else None,
        reported_added_ms_p50=round(statistics.median(reported), 1) if reported else None,
        reported_added_ms_p99=round(q(reported, 0.99), 1) if reported else None,
        sidecar_cpu_s=round(cpu, 2),
        floor_http={k: bare[k] for k in ("turn_ms_p50", "turn_ms_p99", "run_s", *apart, "errors")},
        floor_http_cpu_s=round(floor_cpu, 2),
        load_after=os.getloadavg()[0],
        never_slower=_never_slower(through, direct, noise),
        floor_http_never_slower=_never_slower(bare, direct, noise),
    )
    return result


async def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m bench.direct", description=__doc__.split("\n\n")[0])
    p.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated: " + ", ".join(CONDITIONS))
    p.add_argument("--conversations", type=int, help="instead of each condition's own count")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--upstream-nice", type=int, default=0, help=NICE_HELP)
    args = p.parse_args(argv)
    install_signal_handlers()
    results = []
    try:
        for name in (c for c in args.conditions.split(",") if c):
            result = await condition(name, args.conversations, args.turns, args.seed, args.upstream_nice)
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        stop_all()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    asyncio.run(main())
