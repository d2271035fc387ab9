"""Capacity: what one core of sidecar relays, and its added latency under many conversations.

The sidecar is pinned to CPU 0, the emulator and this load generator to CPU 1 (restored
afterwards), so the sidecar's figures are per core. Two parts:

* **Saturation at 1 KB** (zero-latency emulator): ``concurrency`` lean clients loop continuation
  turns of the reasoning-agent workload on 1 KB histories (small tool outputs, fresh
  conversation every few turns) for ``seconds``. Reported: turns/s, the sidecar's CPU use over
  the window (%, of one core) and turns per sidecar CPU-second, which is the figure the core can
  reach when the load generator is not the limit. When the sidecar's CPU is well under 100 %,
  the other core (emulator + load generator) was the bottleneck. With a floor relay
  (:mod:`bench.floor` on aiohttp, pinned to the same core), the same clients then load it for the
  same time: its turns per CPU-second beside the sidecar's, and their ratio (a target
  as a ratio to the floor of the same run, not a figure of one machine).
* **Many conversations** (``fast`` preset, tool time 200–2,000 ms per call): N conversations
  through the sidecar, each running ``turns`` agent turns; every ``twin_every``-th of them has a
  native WebSocket-mode twin (same content, same tool times) talking to the emulator directly.
  Added latency is the paired difference per (conversation, turn) of twin pairs: same upstream
  work, same moment. Also first-event time, first-token time and total time of both, so the
  hold-back of ``response.created`` shows as ``first event`` close to ``first token``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import psutil
import websockets

from .clients import API_KEY, READ_TIMEOUT, echo_items, post_sse, sdk_headers, ws_turn
from .floor import FloorProc
from .procs import EmulatorProc, SidecarProc
from .stats import summary
from .workload import AgentHistory, body_fields

__all__ = ["pinned", "run_capacity", "saturate"]

JSON = Any
Log = Callable[[str], None]


@contextlib.contextmanager
def pinned(emu: EmulatorProc, side: SidecarProc, floor: FloorProc | None = None) -> Any:
    """Sidecar (and the floor relay) on CPU 0; emulator and this process on CPU 1 (when there are
    two CPUs)."""
    ncpu = psutil.cpu_count() or 1
    if ncpu < 2:
        yield False
        return
    everything = list(range(ncpu))
    me = psutil.Process()
    try:
        for relay in (side, floor):
            if relay is not None and relay.ps is not None:
                relay.ps.cpu_affinity([0])
        if emu.ps is not None:
            emu.ps.cpu_affinity([1])
        me.cpu_affinity([1])
        yield True
    finally:
        for proc in (side.ps, floor.ps if floor is not None else None, emu.ps, me):
            with contextlib.suppress(psutil.Error, AttributeError):
                if proc is not None:
                    proc.cpu_affinity(everything)


def _calls(response: JSON) -> list[JSON]:
    return [o for o in (response or {}).get("output") or [] if o.get("type") == "function_call"]


async def saturate(
    side: SidecarProc | FloorProc, concurrency: int, seconds: float, seed: int, chain_turns: int = 6
) -> dict[str, JSON]:
    """Lean clients hammer the relay ``side`` with 1 KB continuation turns for ``seconds``."""
    url = side.base_url + "/responses"
    headers = sdk_headers()
    fields = body_fields(stream=True, light=True)
    done = 0
    errors = 0
    stop_at = 0.0

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        chain = 0
        while time.perf_counter() < stop_at:
            history = AgentHistory(1_000, seed, f"sat-{seed}-{index}-{chain}-{time.monotonic_ns()}", chain_turns + 1)
            items = list(history.items)
            chain += 1
            for _ in range(chain_turns):
                if time.perf_counter() >= stop_at:
                    return
                try:
                    res = await post_sse(session, url, orjson.dumps({"input": items, **fields}), headers)
                except (TimeoutError, aiohttp.ClientError, RuntimeError):
                    errors += 1
                    break
                done += 1
                calls = _calls(res.response)
                if not calls:
                    break
                items += echo_items(res.response.get("output") or [])
                items.append({"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "ok " * 40})

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # warm-up: every client's first (full) turn and socket opening happen before the window
        stop_at = time.perf_counter() + 2.0
        await asyncio.gather(*(client(i, session) for i in range(concurrency)))
        done, errors = 0, 0
        cpu0, wall0 = side.cpu_seconds(), time.perf_counter()
        stop_at = wall0 + seconds
        await asyncio.gather(*(client(i + concurrency, session) for i in range(concurrency)))
        wall = time.perf_counter() - wall0
        cpu = side.cpu_seconds() - cpu0
    return {
        "concurrency": concurrency,
        "turns": done,
        "errors": errors,
        "seconds": round(wall, 2),
        "turns_per_s": round(done / wall, 1) if wall else 0.0,
        "sidecar_cpu_pct_of_one_core": round(cpu / wall * 100, 1) if wall else 0.0,
        "turns_per_sidecar_cpu_s": round(done / cpu, 1) if cpu else None,
        "sidecar_cpu_ms_per_turn": round(cpu * 1000 / done, 3) if done else None,
    }


def _beside_floor(found: dict[str, JSON], floor: dict[str, JSON]) -> None:
    """Put the floor relay's saturation figures beside the sidecar's in ``found``."""
    per_cpu = floor["turns_per_sidecar_cpu_s"]
    found["floor_aiohttp"] = {
        "turns": floor["turns"],
        "errors": floor["errors"],
        "turns_per_s": floor["turns_per_s"],
        "cpu_pct_of_one_core": floor["sidecar_cpu_pct_of_one_core"],
        "turns_per_cpu_s": per_cpu,
        "cpu_ms_per_turn": floor["sidecar_cpu_ms_per_turn"],
    }
    mine = found["turns_per_sidecar_cpu_s"]
    found["capacity_ratio_sidecar_over_floor"] = round(mine / per_cpu, 3) if mine and per_cpu else None


@dataclass(slots=True)
class _Turn:
    ttfb: float
    first_output: float
    total: float


@dataclass(slots=True)
class _Conv:
    side: list[_Turn] = field(default_factory=list)
    native: list[_Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def _conversation(
    index: int,
    seed: int,
    turns: int,
    tool_ms: tuple[float, float],
    session: aiohttp.ClientSession,
    side_url: str,
    ws_url: str | None,
    result: _Conv,
) -> None:
    """One agent through the sidecar, and (``ws_url`` set) its native twin, in lockstep."""
    rng = random.Random(f"cap:{seed}:{index}")
    fields = body_fields(stream=True, light=True)
    ws_fields = {k: v for k, v in fields.items() if k != "stream"}
    history = AgentHistory(1_000, seed, f"cap-{seed}-{index}-{time.monotonic_ns()}", turns + 1)
    items = list(history.items)
    ws_new = list(items)
    previous: str | None = None
    headers = sdk_headers()
    ws = None
    await asyncio.sleep(rng.uniform(0, tool_ms[1] / 1000.0))  # agents are not synchronised
    try:
        if ws_url is not None:
            ws = await websockets.connect(
                ws_url, additional_headers={"Authorization": f"Bearer {API_KEY}"},
                compression=None, max_size=None, ping_interval=None, open_timeout=60,
            )  # fmt: skip
        for _ in range(turns):
            body = orjson.dumps({"input": items, **fields})
            frame = orjson.dumps({"type": "response.create", **ws_fields, "input": ws_new,
                                  "previous_response_id": previous})  # fmt: skip
            jobs: list[Any] = [post_sse(session, side_url, body, headers)]
            if ws is not None:
                jobs.append(ws_turn(ws, frame))
            got = await asyncio.gather(*jobs)
            s = got[0]
            result.side.append(_Turn(s.ttfb, s.first_output, s.total))
            calls = _calls(s.response)
            if ws is not None:
                w = got[1]
                result.native.append(_Turn(w.ttfb, w.first_output, w.total))
                ws_calls = _calls(w.event.get("response") or {})
                previous = (w.event.get("response") or {}).get("id")
                if not ws_calls:
                    break
            if not calls:
                break
            output = history.tool_output(calls[0]["call_id"])
            items += echo_items(s.response.get("output") or [])
            items.append(output)
            if ws is not None:
                ws_new = [{**output, "call_id": ws_calls[0]["call_id"]}]
            await asyncio.sleep(rng.uniform(*tool_ms) / 1000.0)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        result.errors.append(f"{type(exc).__name__}: {exc}"[:200])
    finally:
        if ws is not None:
            await ws.close()


def _own_added(log_path: Any, offset: int) -> dict[str, JSON]:
    """Summaries of the access log's ``added_ms`` since ``offset``: continuations, first turns."""
    cont: list[float] = []
    first: list[float] = []
    with open(log_path, "rb") as log:
        log.seek(offset)
        for line in log:
            if b'"msg":"access"' not in line:
                continue
            row = orjson.loads(line)
            (cont if row.get("mode") == "continuation" else first).append(float(row.get("added_ms", 0.0)))
    return {"sidecar_own_added_ms": summary(cont), "sidecar_own_added_full_ms": summary(first)}


async def _many(
    emu: EmulatorProc,
    side: SidecarProc,
    conversations: int,
    *,
    turns: int,
    tool_ms: tuple[float, float],
    twin_every: int,
    seed: int,
) -> dict[str, JSON]:
    side_url = side.base_url + "/responses"
    ws_url = emu.base_url.replace("http://", "ws://") + "/responses"
    results = [_Conv() for _ in range(conversations)]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=READ_TIMEOUT)
    log_from = side.log_path.stat().st_size if side.log_path.exists() else 0
    cpu0, wall0 = side.cpu_seconds(), time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(
            *(
                _conversation(
                    i, seed, turns, tool_ms, session, side_url, ws_url if i % twin_every == 0 else None, results[i]
                )  # fmt: skip
                for i in range(conversations)
            )
        )
    wall = time.perf_counter() - wall0
    cpu = side.cpu_seconds() - cpu0
    ms = 1000.0
    added, added_first_event, added_first_output = [], [], []
    for conv in results:
        for b, c in list(zip(conv.side, conv.native, strict=False))[1:]:  # continuations only
            added.append((b.total - c.total) * ms)
            added_first_event.append((b.ttfb - c.ttfb) * ms)
            added_first_output.append((b.first_output - c.first_output) * ms)
    side_turns = [t for c in results for t in c.side[1:]]
    native_turns = [t for c in results for t in c.native[1:]]
    errors = [e for c in results for e in c.errors]
    return {
        "conversations": conversations,
        "twins": sum(1 for i in range(conversations) if i % twin_every == 0),
        "turns_per_conversation": turns,
        "tool_ms": list(tool_ms),
        "turns": sum(len(c.side) for c in results),
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": round(wall, 2),
        "sidecar_turns_per_s": round(sum(len(c.side) for c in results) / wall, 1) if wall else 0.0,
        "sidecar_cpu_pct_of_one_core": round(cpu / wall * 100, 1) if wall else 0.0,
        # paced output (the model streams): every event is its own wake-up, unlike the burst of a
        # zero-latency emulator, so this is the per-turn CPU an app's real traffic costs
        "sidecar_cpu_ms_per_turn": round(cpu * 1000 / max(1, sum(len(c.side) for c in results)), 3),
        "added_ms": summary(added),
        "added_first_event_ms": summary(added_first_event),
        "added_first_output_ms": summary(added_first_output),
        # The sidecar's own time per request (its access log's added_ms: wall time minus the
        # time spent waiting on the upstream), every conversation, not only the twins. The paired
        # difference above also holds the load generator's own lag on the shared core.
        **_own_added(side.log_path, log_from),
        "sidecar": {
            "first_event_ms": summary([t.ttfb * ms for t in side_turns]),
            "first_output_ms": summary([t.first_output * ms for t in side_turns]),
            "total_ms": summary([t.total * ms for t in side_turns]),
        },
        "native": {
            "first_event_ms": summary([t.ttfb * ms for t in native_turns]),
            "first_output_ms": summary([t.first_output * ms for t in native_turns]),
            "total_ms": summary([t.total * ms for t in native_turns]),
        },
    }


async def run_capacity(
    emu: EmulatorProc,
    side: SidecarProc,
    *,
    latency: dict[str, float],
    saturation: list[int],
    seconds: float,
    conversations: list[int],
    turns: int,
    tool_ms: tuple[float, float],
    twin_every: int,
    seed: int,
    log: Log,
    floor: FloorProc | None = None,
) -> JSON:
    """Both parts; ``latency`` is the model for the many-conversations part (``fast``); the
    saturation part also loads ``floor`` (the aiohttp floor relay) after the sidecar."""
    out: JSON = {"saturation": [], "many": []}
    with pinned(emu, side, floor) as was_pinned:
        out["pinned"] = was_pinned
        await emu.set_latency({})
        for conc in saturation:
            found = await saturate(side, conc, seconds, seed)
            out["saturation"].append(found)
            log(
                f"  capacity 1k x{conc}: {found['turns_per_s']:.0f} turns/s, sidecar at "
                f"{found['sidecar_cpu_pct_of_one_core']:.0f} % of its core "
                f"({found['turns_per_sidecar_cpu_s']} turns per CPU-second), {found['errors']} errors"
            )
            await emu.reset()
            if floor is not None:
                _beside_floor(found, await saturate(floor, conc, seconds, seed))
                log(
                    f"  capacity 1k x{conc}, aiohttp floor: {found['floor_aiohttp']['turns_per_cpu_s']} turns per "
                    f"CPU-second; sidecar / floor {found['capacity_ratio_sidecar_over_floor']}"
                )
                await emu.reset()
        await emu.set_latency(latency)
        for n in conversations:
            found = await _many(emu, side, n, turns=turns, tool_ms=tool_ms, twin_every=twin_every, seed=seed)
            out["many"].append(found)
            a, fe, own = found["added_ms"], found["added_first_event_ms"], found["sidecar_own_added_ms"]
            log(
                f"  capacity x{n} conversations: added p50 {a.get('p50', float('nan')):.2f} ms p99 "
                f"{a.get('p99', float('nan')):.2f} ms; first event +{fe.get('p50', float('nan')):.1f} ms (p50) vs "
                f"native; {found['sidecar_turns_per_s']:.0f} turns/s, sidecar "
                f"{found['sidecar_cpu_pct_of_one_core']:.0f} % of its core ({found['sidecar_cpu_ms_per_turn']:.2f} ms "
                f"CPU per paced turn), {found['errors']} errors; the sidecar's own time per continuation p50 "
                f"{own.get('p50', float('nan')):.2f} ms p99 {own.get('p99', float('nan')):.2f} ms"
            )
            await emu.reset()
        await emu.set_latency({})
    return out
