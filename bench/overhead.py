"""Proxy-added latency per history size, measured against a native client in the same run.

Zero-latency emulator; the workload is a reasoning coding agent's (:class:`~bench.workload.
AgentHistory`): every live turn streams a reasoning item with ``encrypted_content`` and one
``function_call`` (about 19 events), histories hold reasoning items, commentary messages and
heavy-tailed tool outputs (0.1–16 KB). For each size, fresh conversations of that size run
continuation turns (each request extends the previous one by the echoed output and one tool
output). Every turn, in random order:

* **sidecar**: the full-history body, POSTed to the sidecar (which sends a continuation frame);
* **direct HTTP**: the *same body bytes*, POSTed straight to the emulator;
* **direct WS**: the same turn as a native WebSocket-mode client sends it (new items +
  ``previous_response_id``) on its own chain of identical content.

Reported, per size, p50/p99 over turns of: sidecar − direct WS (**added latency**: same upstream
work, so what remains is the sidecar's ingest, diff and relay hop, plus the loopback upload of the
body), sidecar − direct HTTP (net of the emulator's own full-body processing, which the sidecar
spares it), the same for time to first byte and to the first output event, the sidecar's own
``x-upshift-overhead-ms``, and **CPU per turn**: the sidecar's process CPU time (psutil, read
around each of its requests) per turn, next to the emulator's CPU per native WS turn it served in
the same run. The machine's speed drifts, so the ratio of the two is the stable figure. The first
turn of each conversation (no head yet: a full send) is reported apart; :func:`slopes` fits the
per-MB cost across sizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import websockets

from .clients import API_KEY, READ_TIMEOUT, echo_items, post_json, post_sse, sdk_headers, ws_turn
from .floor import FloorProc
from .procs import EmulatorProc, Managed, SidecarProc
from .stats import percentile, summary
from .workload import AgentHistory, body_fields

__all__ = ["SizeResult", "parse_size", "run_overhead", "slopes"]

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
    added_first_output: list[float] = field(default_factory=list)
    events: list[float] = field(default_factory=list)
    vs_http_total: list[float] = field(default_factory=list)
    vs_http_ttfb: list[float] = field(default_factory=list)
    sidecar_total: list[float] = field(default_factory=list)
    direct_ws_total: list[float] = field(default_factory=list)
    direct_http_total: list[float] = field(default_factory=list)
    header_ms: list[float] = field(default_factory=list)
    first_turn_added: list[float] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)
    cpu_ms_per_request: float = 0.0
    emulator_cpu_ms_per_ws_turn: float = 0.0
    emulator_cpu_ms_per_sidecar_turn: float = 0.0
    emulator_cpu_ms_per_http_turn: float = 0.0
    chain_starts: list[float] = field(default_factory=list)
    """``time.monotonic()`` as each conversation began (whether relays took turns)."""
    floors: dict[str, SizeResult] = field(default_factory=dict)
    """The same size through :mod:`bench.floor` (the least a Python relay does: ``floor`` bare,
    ``floor_aiohttp`` with aiohttp serving the app side), if measured."""

    def report(self) -> dict[str, JSON]:
        """Summaries for the JSON report."""
        return {
            "label": self.label,
            "target_bytes": self.target_bytes,
            "turns": len(self.added_total),
            "body_bytes": summary([float(b) for b in self.body_bytes]),
            "added_ms": summary(self.added_total),
            "added_ttfb_ms": summary(self.added_ttfb),
            "added_first_output_ms": summary(self.added_first_output),
            "events_per_turn": summary(self.events, 1),
            "vs_direct_http_ms": summary(self.vs_http_total),
            "vs_direct_http_ttfb_ms": summary(self.vs_http_ttfb),
            "sidecar_ms": summary(self.sidecar_total),
            "direct_ws_ms": summary(self.direct_ws_total),
            "direct_http_ms": summary(self.direct_http_total),
            "header_overhead_ms": summary(self.header_ms),
            "first_turn_added_ms": summary(self.first_turn_added),
            "modes": self.modes,
            "sidecar_cpu_ms_per_request": round(self.cpu_ms_per_request, 3),
            "emulator_cpu_ms_per_ws_turn": round(self.emulator_cpu_ms_per_ws_turn, 3),
            "emulator_cpu_ms_per_sidecar_turn": round(self.emulator_cpu_ms_per_sidecar_turn, 3),
            "emulator_cpu_ms_per_http_turn": round(self.emulator_cpu_ms_per_http_turn, 3),
            "cpu_ratio_sidecar_over_emulator_ws": _ratio(self.cpu_ms_per_request, self.emulator_cpu_ms_per_ws_turn),
            **{name: self._floor_report(name) for name in self.floors},
        }

    def _floor_report(self, name: str) -> JSON:
        floor = self.floors[name]
        if not floor.added_total:
            return None
        return {
            "turns": len(floor.added_total),
            "added_ms": summary(floor.added_total),
            "cpu_ms_per_request": round(floor.cpu_ms_per_request, 3),
            "emulator_cpu_ms_per_ws_turn": round(floor.emulator_cpu_ms_per_ws_turn, 3),
            "cpu_ratio_floor_over_emulator_ws": _ratio(floor.cpu_ms_per_request, floor.emulator_cpu_ms_per_ws_turn),
            "cpu_ratio_sidecar_over_floor": _ratio(self.cpu_ms_per_request, floor.cpu_ms_per_request),
            # The floor's conversations ran between the sidecar's, not after them (same machine).
            "interleaved": bool(floor.chain_starts and self.chain_starts)
            and floor.chain_starts[0] < self.chain_starts[-1],
        }


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator else None


class _Chain:
    """One conversation of a given size, run both through the sidecar and natively over WS."""

    def __init__(self, size: int, tag: str, steps: int, seed: int, light: bool, stream: bool = True) -> None:
        self.fields = body_fields(stream=stream, light=light)
        self.ws_fields = {k: v for k, v in self.fields.items() if k != "stream"}
        self.history = AgentHistory(size, seed, tag, steps)
        self.input: list[JSON] = list(self.history.items)
        self.ws_new: list[JSON] = list(self.input)
        self.previous: str | None = None

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


class _Cpu:
    """CPU seconds of the sidecar and the emulator, attributed to the request that ran between reads."""

    def __init__(self, emu: EmulatorProc, side: SidecarProc | FloorProc) -> None:
        self.procs: dict[str, Managed] = {"s": side, "e": emu}
        self.spent: dict[tuple[str, str], float] = {}
        self.count: dict[str, int] = {}

    def read(self) -> dict[str, float]:
        return {k: p.cpu_seconds() for k, p in self.procs.items()}

    def add(self, what: str, before: dict[str, float], after: dict[str, float]) -> None:
        self.count[what] = self.count.get(what, 0) + 1
        for proc in before:
            key = (proc, what)
            self.spent[key] = self.spent.get(key, 0.0) + after[proc] - before[proc]

    def per_request_ms(self, proc: str, what: str) -> float:
        return self.spent.get((proc, what), 0.0) * 1000.0 / max(1, self.count.get(what, 0))


class _Measure:
    """The turns of one relay (the sidecar or a floor) at one size, a chain at a time, so that
    relays can take turns (:func:`_interleaved`): each keeps its own client session, CPU meter and
    random order of the three requests of a turn."""

    def __init__(
        self, label: str, size: int, reps: int, per_chain: int, emu: EmulatorProc, side: SidecarProc | FloorProc,
        seed: int, light: bool, stream: bool = True,
    ) -> None:  # fmt: skip
        self.result = SizeResult(label, size)
        self.stream = stream
        self.reps, self.per_chain, self.seed, self.light = reps, per_chain, seed, light
        self.emu, self.side = emu, side
        self.rng = random.Random(size)
        self.cpu = _Cpu(emu, side)
        self.session: aiohttp.ClientSession | None = None

    @property
    def done(self) -> bool:
        return len(self.result.added_total) >= self.reps

    @property
    def progress(self) -> float:
        return len(self.result.added_total) / max(1, self.reps)

    async def __aenter__(self) -> _Measure:
        connector = aiohttp.TCPConnector(limit=4, ssl=self.emu.ssl_context or True)
        timeout = aiohttp.ClientTimeout(total=300, sock_read=READ_TIMEOUT)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()
        r, cpu = self.result, self.cpu
        r.cpu_ms_per_request = cpu.per_request_ms("s", "s")
        r.emulator_cpu_ms_per_ws_turn = cpu.per_request_ms("e", "w")
        r.emulator_cpu_ms_per_sidecar_turn = cpu.per_request_ms("e", "s")
        r.emulator_cpu_ms_per_http_turn = cpu.per_request_ms("e", "h")

    async def chain(self) -> None:
        """One fresh conversation: a first turn (reported apart), then continuation turns."""
        assert self.session is not None
        session, result, cpu, emu, per_chain = self.session, self.result, self.cpu, self.emu, self.per_chain
        headers = sdk_headers()
        side_url, emu_url = self.side.base_url + "/responses", emu.base_url + "/responses"
        tag = f"{result.label}-{self.seed}-{len(result.chain_starts)}-{time.monotonic_ns()}"
        chain = _Chain(result.target_bytes, tag, per_chain + 1, self.seed, self.light, self.stream)
        post = post_sse if self.stream else post_json
        result.chain_starts.append(time.monotonic())
        tls: dict[str, Any] = {"ssl": emu.ssl_context} if emu.ssl_context is not None else {}
        ws = await websockets.connect(
            emu.ws_url, additional_headers={"Authorization": f"Bearer {API_KEY}"},
            compression=None, max_size=None, ping_interval=None, **tls,
        )  # fmt: skip
        try:
            for turn in range(per_chain + 1):
                body, frame = chain.body(), chain.frame()
                order = ["s", "h", "w"]
                self.rng.shuffle(order)
                got: dict[str, Any] = {}
                for what in order:
                    before = cpu.read()
                    if what == "s":
                        got["s"] = await post(session, side_url, body, headers)
                    elif what == "h":
                        got["h"] = await post(session, emu_url, body, headers)
                    else:
                        got["w"] = await ws_turn(ws, frame)
                    if turn > 0:
                        cpu.add(what, before, cpu.read())
                s, h, w = got["s"], got["h"], got["w"]
                ms = 1000.0
                if turn == 0:
                    result.first_turn_added.append((s.total - w.total) * ms)
                else:
                    result.body_bytes.append(len(body))
                    result.events.append(float(s.events))
                    result.added_total.append((s.total - w.total) * ms)
                    result.added_ttfb.append((s.ttfb - w.ttfb) * ms)
                    result.added_first_output.append((s.first_output - w.first_output) * ms)
                    result.vs_http_total.append((s.total - h.total) * ms)
                    result.vs_http_ttfb.append((s.ttfb - h.ttfb) * ms)
                    result.sidecar_total.append(s.total * ms)
                    result.direct_ws_total.append(w.total * ms)
                    result.direct_http_total.append(h.total * ms)
                    header = s.headers.get("x-upshift-overhead-ms")
                    if header is not None:
                        result.header_ms.append(float(header))
                    mode = s.headers.get("x-upshift-mode", "?")
                    result.modes[mode] = result.modes.get(mode, 0) + 1
                # advance both chains with the same (sized) tool output
                side_calls, ws_response = _calls(s.response), w.event.get("response") or {}
                ws_calls = _calls(ws_response)
                if not side_calls or not ws_calls or self.done:
                    break
                chain.input += echo_items(s.response.get("output") or [])
                out = chain.history.tool_output(side_calls[0]["call_id"])
                chain.input.append(out)
                chain.previous = ws_response.get("id")
                chain.ws_new = [{**out, "call_id": ws_calls[0]["call_id"]}]
                if turn == 0:
                    # The first turn (a full send, not measured) leaves work for after its
                    # answer (the miss's explanation): let it finish before turn 1's CPU
                    # window opens, so that each turn's CPU is its own.
                    await asyncio.sleep(0.05)
        finally:
            await ws.close()


async def _interleaved(measures: list[_Measure]) -> None:
    """Run every relay's turns, taking turns a conversation at a time (the first is the
    sidecar): each floor runs a chain whenever its share of its turns lags the sidecar's, so
    all of them see the same machine within a second of each other, all along the run (the
    machine's speed drifts by a fifth within minutes; one relay's minute against another's
    next minute would measure the drift)."""
    lead, rest = measures[0], measures[1:]
    async with contextlib.AsyncExitStack() as stack:
        for m in measures:
            await stack.enter_async_context(m)
        while not all(m.done for m in measures):
            if not lead.done:
                await lead.chain()
            for m in rest:
                if not m.done and (lead.done or m.progress <= lead.progress):
                    await m.chain()


def _fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares line ``y = a + b·x``: returns ``(a, b)``, or None with fewer than two x values."""
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def slopes(results: list[SizeResult]) -> JSON:
    """Per-MB cost across sizes: added p50 and sidecar CPU per turn against the body's MB (median)."""
    out: JSON = {}
    for name, value in (
        ("added_p50_ms", lambda r: percentile(r.added_total, 50)),
        ("sidecar_cpu_ms", lambda r: r.cpu_ms_per_request),
    ):
        points = [(percentile(r.body_bytes, 50) / 1e6, value(r)) for r in results if r.body_bytes]
        fit = _fit(points)
        if fit is not None:
            out[name] = {"at_zero": round(fit[0], 3), "per_mb": round(fit[1], 3)}
    return out


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
    light: bool = False,
    floors: dict[str, FloorProc] | None = None,
    stream: bool = True,
) -> list[SizeResult]:
    """Measure every size in ``sizes`` (``1k``, ``200k``, ``1m``, ``3m``); emulator at zero latency.

    ``light``: one tool and a one-line instruction instead of the agent's 3.3 KB of instructions
    and five tools (the history sizes count the input only, the settings come on top).
    ``stream``: ``False`` asks for JSON answers (``stream: false``) instead of SSE.
    ``floors``: also run half as many turns of each size through each :mod:`bench.floor` relay,
    interleaved with the sidecar's a conversation at a time (:func:`_interleaved`), for the
    sidecar's CPU and added latency as ratios to theirs.
    """
    if floors and not stream:
        raise ValueError("the floor relays answer SSE only: measure stream: false without them")
    await emu.set_latency({})
    relays: list[SidecarProc | FloorProc] = [side, *(floors or {}).values()]
    await _interleaved([_Measure("warmup", 20_000, warmup, 3, emu, r, seed, light) for r in relays])
    results = []
    for label in sizes:
        size = parse_size(label)
        turns = per_chain or (2 if size < 20_000 else 10)
        n = reps if size < 2_000_000 else max(10, reps // 2)
        started = time.perf_counter()
        lead = _Measure(label, size, n, turns, emu, side, seed, light, stream)
        others = {name: _Measure(label, size, max(20, n // 2), turns, emu, proc, seed + 1, light)
                  for name, proc in (floors or {}).items()}  # fmt: skip
        await _interleaved([lead, *others.values()])
        res = lead.result
        res.floors = {name: m.result for name, m in others.items()}
        rep = res.report()
        log(
            f"  overhead {label}: added p50 {rep['added_ms']['p50']:.2f} ms p99 {rep['added_ms']['p99']:.2f} ms "
            f"(vs same-body HTTP p50 {rep['vs_direct_http_ms']['p50']:.2f} ms; header p50 "
            f"{rep['header_overhead_ms'].get('p50', float('nan')):.2f} ms); CPU/turn sidecar "
            f"{rep['sidecar_cpu_ms_per_request']:.2f} ms vs emulator (WS turn) "
            f"{rep['emulator_cpu_ms_per_ws_turn']:.2f} ms; {rep['events_per_turn'].get('p50', 0):.0f} events/turn "
            f"in {time.perf_counter() - started:.0f} s"
        )
        for name in res.floors:
            f = rep[name]
            log(
                f"  {name} relay {label}: added p50 {f['added_ms']['p50']:.2f} ms, CPU/turn "
                f"{f['cpu_ms_per_request']:.2f} ms (floor/emulator {f['cpu_ratio_floor_over_emulator_ws']}; "
                f"sidecar/floor {f['cpu_ratio_sidecar_over_floor']})"
            )
        results.append(res)
        await emu.reset()
        await asyncio.sleep(0.2)
    return results
