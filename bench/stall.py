"""Event-loop stall: does one large request freeze the other conversations' streams?

K conversations stream long replies through the sidecar while K more stream the same replies
straight from the emulator (the control group: any stall of the emulator or of this client shows
there too). The emulator paces output at ``tokens_per_second`` (one delta event every
``delta_chars / 4 / tps`` seconds). Mid-stream, one large request (default 3 MB) goes to the
sidecar, in three rounds:

Each round runs ``repeats`` times (3); medians are reported, with the worst loop stall.

* ``control``: no large request (the baseline jitter);
* ``new``: a 3 MB conversation the sidecar has never seen (full parse, full frame upstream,
  which also makes the emulator parse 3 MB: the control group shows that part);
* ``continuation``: the next turn of a 3 MB conversation established beforehand (the
  steady state: only the new items go upstream, so the emulator is not loaded).

For each round: the longest gap between two events of any sidecar stream and of any direct
stream, minus the nominal inter-event interval; and the sidecar's excess over the control group.
Stream gaps mix the sidecar's stall with the emulator's and the machine's (2 cores, 3 busy
processes), so the sidecar's own event loop is also probed directly: ``GET /healthz`` on its admin
listener (served by the same loop) every ~2 ms; the **loop stall** is the slowest probe sent
while the large request was in flight, minus the control round's median probe.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import aiohttp
import orjson

from .clients import echo_items, post_sse, sdk_headers
from .procs import EmulatorProc, SidecarProc
from .workload import history_of_size

__all__ = ["run_stall"]

JSON = Any
_FIELDS: dict[str, JSON] = {"model": "gpt-6.1-sol", "instructions": "You are a coding agent.", "store": False}
_BIG_FIELDS: dict[str, JSON] = {
    **_FIELDS,
    "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
}


def _stream_body(tag: str, reply_bytes: int) -> bytes:
    text = f"[{tag}] Explain the design of the relay in detail. reply_bytes={reply_bytes}"
    return orjson.dumps({"input": [{"role": "user", "content": text}], **_FIELDS, "stream": True})


async def _probe(session: aiohttp.ClientSession, url: str, out: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """Hit the sidecar's admin ``/healthz`` (same event loop as the API) every ~2 ms; keep (sent, latency)."""
    while not stop.is_set():
        sent = time.perf_counter()
        async with session.get(url) as resp:
            await resp.read()
        out.append((sent, time.perf_counter() - sent))
        await asyncio.sleep(0.002)


def _window_gap(times: list[float], lo: float, hi: float) -> float:
    """Longest gap between consecutive events that overlaps [lo, hi]."""
    best = 0.0
    for a, b in zip(times, times[1:], strict=False):
        if b >= lo and a <= hi:
            best = max(best, b - a)
    return best


async def _continuation_body(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], size: int, seed: int, tag: str
) -> bytes:
    """Establish a ``size`` conversation through the sidecar (first turn, full) and build its next turn."""
    history = history_of_size(size, seed, tag, 2)
    first = await post_sse(session, url, orjson.dumps({"input": history, **_BIG_FIELDS, "stream": True}), headers)
    echoed = echo_items((first.response or {}).get("output") or [])
    call_id = next(o["call_id"] for o in echoed if o.get("type") == "function_call")
    history += [*echoed, {"type": "function_call_output", "call_id": call_id, "output": "ok\n" * 200}]
    return orjson.dumps({"input": history, **_BIG_FIELDS, "stream": True})


async def run_stall(
    emu: EmulatorProc,
    side: SidecarProc,
    *,
    streams: int = 8,
    big_bytes: int = 3_000_000,
    tokens_per_second: float = 1000.0,
    stream_seconds: float = 1.5,
    repeats: int = 3,
    seed: int = 1,
) -> JSON:
    """Run ``repeats`` × (control, new, continuation) rounds; medians (and maxima) in milliseconds."""
    interval = 16 / 4.0 / tokens_per_second  # the emulator's 16-character deltas = 4 tokens
    reply = int(stream_seconds / interval * 16)
    await emu.set_latency({"tokens_per_second": tokens_per_second})
    headers = sdk_headers()
    side_url, emu_url = side.base_url + "/responses", emu.base_url + "/responses"
    admin_url = f"http://127.0.0.1:{side.admin_port}/healthz"
    runs: dict[str, list[JSON]] = {"control": [], "new": [], "continuation": []}
    baselines: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120, sock_read=60)
    ) as session:
        for rep in range(repeats):
            continuation = await _continuation_body(session, side_url, headers, big_bytes, seed, f"stall-big-{rep}")
            history = history_of_size(big_bytes, seed, f"stall-new-{rep}", 2)
            fresh = orjson.dumps({"input": history, **_BIG_FIELDS, "stream": True})
            for name, big in (("control", None), ("new", fresh), ("continuation", continuation)):
                tag = f"{name}-{rep}"
                found, probes = await _round(session, (side_url, emu_url, admin_url), headers, big, streams,
                                             reply, stream_seconds, tag, interval)  # fmt: skip
                if name == "control":
                    baselines.append(statistics.median(probes))
                runs[name].append(found)
    baseline = statistics.median(baselines)
    rounds: dict[str, JSON] = {}
    for name, items in runs.items():
        for item in items:
            item["loop_stall_ms"] = round(max(0.0, item["probe_max_ms"] - baseline * 1000), 2)
        rounds[name] = {key: _med(items, key) for key in items[0] if key != "big_request_mode"}
        rounds[name]["loop_stall_max_ms"] = max(item["loop_stall_ms"] for item in items)
        rounds[name]["big_request_mode"] = items[0]["big_request_mode"]
    return {
        "streams": streams,
        "big_bytes": big_bytes,
        "repeats": repeats,
        "nominal_interval_ms": round(interval * 1000, 3),
        "probe_baseline_ms": round(baseline * 1000, 3),
        "rounds": rounds,
        "runs": runs,
    }


def _med(items: list[JSON], key: str) -> JSON:
    values = [item[key] for item in items if item[key] is not None]
    return round(statistics.median(values), 2) if values else None


async def _round(
    session: aiohttp.ClientSession,
    urls: tuple[str, str, str],
    headers: dict[str, str],
    big: bytes | None,
    streams: int,
    reply: int,
    stream_seconds: float,
    tag: str,
    interval: float,
) -> tuple[JSON, list[float]]:
    """One round: streams through the sidecar and direct, the probe, and (maybe) the large request."""
    side_url, emu_url, admin_url = urls
    tasks = [
        asyncio.create_task(post_sse(session, url, _stream_body(f"{tag}-{kind}-{i}", reply), headers, keep_times=True))
        for i in range(streams)
        for kind, url in (("s", side_url), ("d", emu_url))
    ]
    probes: list[tuple[float, float]] = []
    stop = asyncio.Event()
    prober = asyncio.create_task(_probe(session, admin_url, probes, stop))
    await asyncio.sleep(stream_seconds / 3)
    lo = time.perf_counter()
    big_result = await post_sse(session, side_url, big, headers) if big is not None else None
    if big is None:
        await asyncio.sleep(0.05)
    hi = time.perf_counter()
    results = await asyncio.gather(*tasks)
    stop.set()
    await prober
    in_window = [lat for sent, lat in probes if lo - 0.01 <= sent <= hi]
    side_gap = max(_window_gap(r.times or [], lo, hi) for r in results[0::2])
    direct_gap = max(_window_gap(r.times or [], lo, hi) for r in results[1::2])
    header = big_result.headers.get("x-upshift-overhead-ms") if big_result is not None else None
    found = {
        "big_request_ms": round((hi - lo) * 1000, 2) if big is not None else None,
        "big_request_mode": big_result.headers.get("x-upshift-mode") if big_result is not None else None,
        "big_overhead_header_ms": float(header) if header is not None else None,
        "probe_max_ms": round(max(in_window, default=0.0) * 1000, 2),
        "max_gap_sidecar_ms": round(side_gap * 1000, 2),
        "max_gap_direct_ms": round(direct_gap * 1000, 2),
        "stall_sidecar_ms": round((side_gap - interval) * 1000, 2),
        "stall_excess_over_direct_ms": round((side_gap - direct_gap) * 1000, 2),
        "events_per_stream": min(r.events for r in results),
    }
    return found, [lat for _, lat in probes]
