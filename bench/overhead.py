"""Proxy-added latency per history size, measured against direct requests in the same run.

Zero-latency emulator. For each size, conversations of that size run continuation turns (the
steady state: each request extends the previous one by the echoed output and one tool output).
Every turn, in random order:

* **sidecar**: the full-history body, POSTed to the sidecar (which sends a continuation frame);
* **direct HTTP**: the *same body bytes*, POSTed straight to the emulator;
* **direct WS**: the same turn as a native WebSocket-mode client sends it (new items +
  ``previous_response_id``) on its own chain of identical content.

Reported, per size, p50/p99 over turns of: sidecar − direct WS (**added latency**: same upstream
work, so what remains is the sidecar's ingest, diff and relay hop, plus the loopback upload of the
body), sidecar − direct HTTP (the brief's "same body" view: net of the emulator's own full-body
processing, which the sidecar spares it), the same for time to first byte, the sidecar's own
``x-upshift-overhead-ms``, and the sidecar's CPU time per request. The first turn of each
conversation (no head yet: a full send) is reported apart.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import websockets

from .clients import API_KEY, READ_TIMEOUT, echo_items, post_sse, sdk_headers, ws_create
from .procs import EmulatorProc, SidecarProc
from .stats import summary
from .workload import body_fields, corpus, history_of_size

__all__ = ["SizeResult", "parse_size", "run_overhead"]

JSON = Any


def parse_size(text: str) -> int:
    """``1k`` → 1,000; ``1m`` → 1,000,000; plain integers are bytes."""
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


@dataclass(slots=True)
class SizeResult:
    """Raw samples for one history size (milliseconds)."""

    label: str
    target_bytes: int
    body_bytes: list[int] = field(default_factory=list)
    added_total: list[float] = field(default_factory=list)
    added_ttfb: list[float] = field(default_factory=list)
    vs_http_total: list[float] = field(default_factory=list)
    vs_http_ttfb: list[float] = field(default_factory=list)
    sidecar_total: list[float] = field(default_factory=list)
    direct_ws_total: list[float] = field(default_factory=list)
    direct_http_total: list[float] = field(default_factory=list)
    header_ms: list[float] = field(default_factory=list)
    first_turn_added: list[float] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)
    cpu_ms_per_request: float = 0.0

    def report(self) -> dict[str, JSON]:
        """Summaries for the JSON report."""
        return {
            "label": self.label,
            "target_bytes": self.target_bytes,
            "turns": len(self.added_total),
            "body_bytes": summary([float(b) for b in self.body_bytes]),
            "added_ms": summary(self.added_total),
            "added_ttfb_ms": summary(self.added_ttfb),
            "vs_direct_http_ms": summary(self.vs_http_total),
            "vs_direct_http_ttfb_ms": summary(self.vs_http_ttfb),
            "sidecar_ms": summary(self.sidecar_total),
            "direct_ws_ms": summary(self.direct_ws_total),
            "direct_http_ms": summary(self.direct_http_total),
            "header_overhead_ms": summary(self.header_ms),
            "first_turn_added_ms": summary(self.first_turn_added),
            "modes": self.modes,
            "sidecar_cpu_ms_per_request": round(self.cpu_ms_per_request, 3),
        }


class _Chain:
    """One conversation of a given size, run both through the sidecar and natively over WS."""

    def __init__(self, size: int, tag: str, steps: int, seed: int) -> None:
        self.fields = body_fields(stream=True, light=True)
        self.ws_fields = {k: v for k, v in self.fields.items() if k != "stream"}
        self.input: list[JSON] = history_of_size(size, seed, tag, steps)
        self.ws_new: list[JSON] = list(self.input)
        self.previous: str | None = None
        self.rng = random.Random(tag)
        self.text = corpus(seed)
        self.out_bytes = max(100, min(1000, size // 20))

    def tool_output(self, call_id: str) -> JSON:
        start = self.rng.randrange(0, len(self.text) - self.out_bytes)
        return {"type": "function_call_output", "call_id": call_id, "output": self.text[start : start + self.out_bytes]}

    def body(self) -> bytes:
        return orjson.dumps({"input": self.input, **self.fields})

    def frame(self) -> bytes:
        event = {
            "type": "response.create",
            **self.ws_fields,
            "input": self.ws_new,
            "previous_response_id": self.previous,
        }
        return orjson.dumps(event)


def _calls(response: JSON) -> list[JSON]:
    return [o for o in (response or {}).get("output") or [] if o.get("type") == "function_call"]


async def _measure_size(
    label: str, size: int, reps: int, per_chain: int, emu: EmulatorProc, side: SidecarProc, seed: int
) -> SizeResult:
    result = SizeResult(label, size)
    headers = sdk_headers()
    side_url, emu_url = side.base_url + "/responses", emu.base_url + "/responses"
    connector = aiohttp.TCPConnector(limit=4)
    rng = random.Random(size)
    sidecar_requests = 0
    cpu_before = side.cpu_seconds()
    timeout = aiohttp.ClientTimeout(total=300, sock_read=READ_TIMEOUT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        chain_no = 0
        while len(result.added_total) < reps:
            chain = _Chain(size, f"{label}-{seed}-{chain_no}-{time.monotonic_ns()}", per_chain + 1, seed)
            chain_no += 1
            ws = await websockets.connect(
                emu.base_url.replace("http://", "ws://") + "/responses",
                additional_headers={"Authorization": f"Bearer {API_KEY}"},
                compression=None, max_size=None, ping_interval=None,
            )  # fmt: skip
            try:
                for turn in range(per_chain + 1):
                    body, frame = chain.body(), chain.frame()
                    order = ["s", "h", "w"]
                    rng.shuffle(order)
                    got: dict[str, Any] = {}
                    for what in order:
                        if what == "s":
                            got["s"] = await post_sse(session, side_url, body, headers)
                            sidecar_requests += 1
                        elif what == "h":
                            got["h"] = await post_sse(session, emu_url, body, headers)
                        else:
                            got["w"] = await ws_create(ws, frame)
                    s, h, (w_ttfb, w_total, w_event, _, _) = got["s"], got["h"], got["w"]
                    ms = 1000.0
                    if turn == 0:
                        result.first_turn_added.append((s.total - w_total) * ms)
                    else:
                        result.body_bytes.append(len(body))
                        result.added_total.append((s.total - w_total) * ms)
                        result.added_ttfb.append((s.ttfb - w_ttfb) * ms)
                        result.vs_http_total.append((s.total - h.total) * ms)
                        result.vs_http_ttfb.append((s.ttfb - h.ttfb) * ms)
                        result.sidecar_total.append(s.total * ms)
                        result.direct_ws_total.append(w_total * ms)
                        result.direct_http_total.append(h.total * ms)
                        header = s.headers.get("x-upshift-overhead-ms")
                        if header is not None:
                            result.header_ms.append(float(header))
                        mode = s.headers.get("x-upshift-mode", "?")
                        result.modes[mode] = result.modes.get(mode, 0) + 1
                    # advance both chains with the same (sized) tool output
                    side_calls, ws_response = _calls(s.response), w_event.get("response") or {}
                    ws_calls = _calls(ws_response)
                    if not side_calls or not ws_calls or len(result.added_total) >= reps:
                        break
                    chain.input += echo_items(s.response.get("output") or [])
                    out = chain.tool_output(side_calls[0]["call_id"])
                    chain.input.append(out)
                    chain.previous = ws_response.get("id")
                    chain.ws_new = [{**out, "call_id": ws_calls[0]["call_id"]}]
            finally:
                await ws.close()
    cpu = side.cpu_seconds() - cpu_before
    result.cpu_ms_per_request = cpu * 1000.0 / max(1, sidecar_requests)
    return result


async def run_overhead(
    emu: EmulatorProc,
    side: SidecarProc,
    sizes: list[str],
    *,
    reps: int,
    seed: int,
    warmup: int = 6,
    log: Any = print,
    per_chain: int | None = None,
) -> list[SizeResult]:
    """Measure every size in ``sizes`` (``1k``, ``200k``, ``1m``, ``3m``); emulator at zero latency."""
    await emu.set_latency({})
    await _measure_size("warmup", 20_000, warmup, 3, emu, side, seed)
    results = []
    for label in sizes:
        size = parse_size(label)
        turns = per_chain or (3 if size < 20_000 else 10)
        n = reps if size < 2_000_000 else max(10, reps // 2)
        started = time.perf_counter()
        res = await _measure_size(label, size, n, turns, emu, side, seed)
        rep = res.report()
        log(
            f"  overhead {label}: added p50 {rep['added_ms']['p50']:.2f} ms p99 {rep['added_ms']['p99']:.2f} ms "
            f"(vs same-body HTTP p50 {rep['vs_direct_http_ms']['p50']:.2f} ms; header p50 "
            f"{rep['header_overhead_ms'].get('p50', float('nan')):.2f} ms) in {time.perf_counter() - started:.0f} s"
        )
        results.append(res)
        await emu.reset()
        await asyncio.sleep(0.2)
    return results
